//! `/healthz` says whether the control loop is alive, not a constant "ok": the leader's
//! answers how long ago its controller processed a request (the liveness probes it is
//! sent go through the controller's queue like a Proxy's), a candidate's that it waits
//! for the lease. When the leader's controller processes nothing for too long,
//! `/healthz` fails (`liveness.rs`'s unit tests, on a paused clock).

mod common;

use common::{OperatorOptions, OperatorProcess, eventually, wait_for_holder};

#[tokio::test]
async fn healthz_reports_the_leader_s_controller_and_a_waiting_candidate() {
    let env = common::env_with_crd("liveness").await;
    let providers = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(providers.path(), "providers: {}\n").unwrap();
    let start = |identity| {
        OperatorProcess::start(
            &env,
            &OperatorOptions {
                identity,
                providers: providers.path(),
                lease_duration: "3s",
                clock_offset: None,
                extra_args: &[],
            },
        )
    };
    let leader = start("live-a");
    wait_for_holder(&env, "live-a").await;
    let candidate = start("live-b");

    // The first probe goes through as soon as the controller has listed its Proxies.
    // Until then the probe is answered without it: ask again, as the kubelet would at
    // its next period.
    let what = "the leader's controller to process a probe";
    let body = eventually(what, std::time::Duration::from_secs(60), || async {
        let (status, body) = leader.get("/healthz").await;
        assert_eq!(status, 200, "{body}");
        if body.contains("the controller processed its last request") {
            Ok(body)
        } else {
            Err(body)
        }
    })
    .await;
    assert!(body.starts_with("ok: "), "{body}");

    let (status, body) = candidate.get("/healthz").await;
    assert_eq!(status, 200);
    assert!(
        body.contains("candidate, waiting for the leader lease"),
        "{body}"
    );
}
