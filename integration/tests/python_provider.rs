//! The Python example provider (integration/example-providers/python/), written from
//! the proto and the contract docs alone, generated with grpcio-tools on this machine,
//! passes every conformance check (those of WatchInstances, which it does not offer,
//! are skipped); and the `provider-conformance` binary's options and
//! exit statuses work as documented, also with a provider that loops its page tokens.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use egressproxy_integration::eventually::eventually;
use egressproxy_integration::process::spawn_listening;
use egressproxy_integration::reference_provider::{ReferenceProvider, workspace_binary};
use egressproxy_integration::tools;

struct PythonProvider {
    child: Child,
    endpoint: String,
    _generated: tempfile::TempDir,
}

impl Drop for PythonProvider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn example_dir() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/example-providers/python"
    ))
}

fn start_python_provider() -> PythonProvider {
    let python = tools::python().unwrap();
    let generated = tempfile::tempdir().unwrap();
    let status = Command::new(example_dir().join("generate.sh"))
        .arg(generated.path())
        .arg(&python)
        .status()
        .unwrap();
    assert!(status.success(), "generate.sh failed");
    let (child, address) = spawn_listening(
        Command::new(&python)
            .arg(example_dir().join("provider.py"))
            .args(["--listen", "127.0.0.1:0", "--generated"])
            .arg(generated.path())
            .stderr(Stdio::inherit()),
        "the Python provider",
    )
    .unwrap();
    PythonProvider {
        child,
        endpoint: format!("http://{address}"),
        _generated: generated,
    }
}

fn conformance(endpoint: &str, extra: &[&str]) -> (std::process::Output, Duration) {
    let started = Instant::now();
    let output = Command::new(workspace_binary("provider-conformance").unwrap())
        .args([
            "--endpoint",
            endpoint,
            "--machine-type",
            "small",
            "--image",
            "debian-12",
        ])
        .args(["--running-timeout", "10s", "--check-timeout", "30s"])
        .args(extra)
        .output()
        .unwrap();
    (output, started.elapsed())
}

#[test]
fn the_python_provider_passes_every_check() {
    let provider = start_python_provider();
    let (output, took) = conformance(&provider.endpoint, &["--output", "json"]);
    let report: serde_json::Value = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&output.stdout)));
    println!("python provider: {} in {took:?}", report["summary"]);
    assert!(output.status.success(), "{report:#}");
    assert_eq!(report["passed"], true);
    let checks = report["checks"].as_array().unwrap();
    assert!(checks.len() >= 30, "{report:#}");
    // The example implements contract 1.5: WatchInstances is the one optional call it
    // leaves out (callers poll it), so those checks, and only those, are skipped.
    for check in checks {
        let name = check["name"].as_str().unwrap();
        let wanted = if name.starts_with("watch-") {
            "skip"
        } else {
            "pass"
        };
        assert_eq!(check["status"], wanted, "{name}: {report:#}");
    }
}

#[test]
fn a_cycling_page_token_fails_fast_and_the_run_cleans_up() {
    let provider = ReferenceProvider::start(&[
        "--provisioning-delay",
        "0s",
        "--misbehave",
        "cycling-page-token",
    ])
    .unwrap();
    let (output, took) = conformance(provider.endpoint(), &[]);
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    assert!(text.contains("FAIL paging-walks-once"), "{text}");
    assert!(text.contains("rule:"), "{text}");
    assert!(!text.contains("Status {"), "Rust Debug output:\n{text}");
}

#[test]
fn unknown_check_names_are_refused() {
    let provider = ReferenceProvider::start(&[]).unwrap();
    let (output, _) = conformance(provider.endpoint(), &["--run", "no-such-check"]);
    let error = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        error.contains("no-such-check") && error.contains("--list"),
        "{error}"
    );
}

#[tokio::test]
async fn ctrl_c_deletes_what_the_run_created_and_nothing_else() {
    use egressproxy_provider::client::{ClientOptions, connect_lazy};
    use egressproxy_provider::pb;
    // Instances stay PROVISIONING, so the run waits in `becomes-running`.
    let provider = ReferenceProvider::start(&["--provisioning-delay", "1h"]).unwrap();
    let mut client = connect_lazy(&ClientOptions::new(provider.endpoint())).unwrap();
    let foreign = client
        .create_instance(pb::CreateInstanceRequest {
            key: "not-the-suites".into(),
            name: "prod/egress".into(),
            placement: Some(pb::Placement {
                location: None,
                machine_type: "small".into(),
                image: "debian-12".into(),
            }),
            proxy_port: 3128,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    let mut run = tokio::process::Command::new(workspace_binary("provider-conformance").unwrap())
        .args(["--endpoint", provider.endpoint(), "--machine-type", "small"])
        .args([
            "--image",
            "debian-12",
            "--running-timeout",
            "5m",
            "--run",
            "becomes-running",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let list = |mut client: egressproxy_provider::client::Client| async move {
        client
            .list_instances(pb::ListInstancesRequest::default())
            .await
            .unwrap()
            .into_inner()
            .instances
    };
    eventually(
        "the run to create an instance",
        Duration::from_secs(30),
        || async {
            match list(client.clone()).await.len() {
                2.. => Ok(()),
                n => Err(format!("{n} instances")),
            }
        },
    )
    .await;
    let pid = nix::unistd::Pid::from_raw(run.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = tokio::time::timeout(Duration::from_secs(30), run.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status.code(), Some(130));
    let left: Vec<String> = list(client).await.into_iter().map(|i| i.id).collect();
    assert_eq!(left, [foreign.id]);
}
