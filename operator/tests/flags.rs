//! The operator binary refuses absurd durations before doing anything, naming the flag
//! and its bounds.

use egressproxy_integration::reference_provider::workspace_binary;

fn refusal(flag: &str, value: &str) -> String {
    let output = std::process::Command::new(workspace_binary("egressproxy-operator").unwrap())
        .args([
            "--cluster-name",
            "flags-test",
            "--providers",
            "/nonexistent",
        ])
        .args([flag, value])
        .output()
        .unwrap();
    assert!(!output.status.success(), "{flag} {value} must be refused");
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn out_of_range_durations_are_refused_with_the_flag_and_its_bounds() {
    let cases = [
        ("--lease-duration", "100years", "at most 10m"),
        ("--lease-duration", "1s", "at least 3s"),
        ("--gc-interval", "0s", "at least 1s"),
        ("--gc-grace", "10years", "at most 30days"),
        // An orphan younger than this may be the instance of a Proxy created a moment
        // ago: a grace of 0 would race it.
        ("--gc-grace", "0s", "at least 1m"),
        ("--gc-grace", "59s", "at least 1m"),
        ("--providers-reload-interval", "1ms", "at least 100ms"),
    ];
    for (flag, value, bound) in cases {
        let stderr = refusal(flag, value);
        assert!(
            stderr.contains(flag) && stderr.contains(bound),
            "{flag} {value}: {stderr}"
        );
    }
}

#[test]
fn a_concurrency_bound_outside_its_range_is_refused() {
    for flag in [
        "--max-concurrent-reconciles",
        "--max-concurrent-service-syncs",
    ] {
        for value in ["0", "1001"] {
            let stderr = refusal(flag, value);
            assert!(
                stderr.contains(flag) && stderr.contains("1..=1000"),
                "{flag} {value}: {stderr}"
            );
        }
    }
}

#[test]
fn a_bad_namespace_is_refused_with_the_flag_and_the_name() {
    let stderr = refusal("--namespace", "team-a,Team_B");
    assert!(
        stderr.contains("--namespace") && stderr.contains("\"Team_B\""),
        "{stderr}"
    );
}
