//! Leader election between operator processes against a real kube-apiserver:
//! replicas whose wall clocks are minutes apart (run under `faketime`) never lead at
//! the same time, and a graceful restart hands the lease over at once instead of
//! leaving the cluster leaderless until the lease expires.

mod common;

use std::time::Instant;

use common::{LEASE, OperatorOptions, OperatorProcess, holder, wait_for_holder, wait_until};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

/// Leaderless time after a graceful restart before the lease was released on
/// shutdown (the default 15 s lease had to expire).
const BASELINE: &str = "15.0–15.3 s";

struct Setup {
    env: KubeTestEnv,
    _provider: ReferenceProvider,
    providers_file: tempfile::NamedTempFile,
}

async fn setup(test: &str) -> Setup {
    let env = common::env_with_crd(test).await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "200ms"]).unwrap();
    let providers_file = tempfile::NamedTempFile::new().unwrap();
    let config = common::reference_config(provider.endpoint(), "5s");
    std::fs::write(providers_file.path(), config).unwrap();
    Setup {
        env,
        _provider: provider,
        providers_file,
    }
}

fn renew_time(lease: &Lease) -> Option<jiff::Timestamp> {
    Some(lease.spec.as_ref()?.renew_time.as_ref()?.0)
}

#[tokio::test]
async fn replicas_with_skewed_clocks_never_lead_together() {
    let s = setup("skew").await;
    // The leader's clock runs three minutes behind: every renewTime it writes looks
    // three minutes old to everyone else.
    let behind = OperatorProcess::start(
        &s.env,
        &OperatorOptions {
            identity: "clock-behind",
            providers: s.providers_file.path(),
            lease_duration: "3s",
            clock_offset: Some("-3m"),
            extra_args: &[],
        },
    );
    let lease = wait_for_holder(&s.env, "clock-behind").await;
    let written = renew_time(&lease).unwrap();
    let lag = jiff::Timestamp::now().duration_since(written);
    assert!(
        lag.as_secs() >= 150,
        "the leader's renewTime must lie minutes in the past (faketime works): {lag:?}"
    );

    // A candidate whose clock runs three minutes ahead: by comparing renewTime with
    // its own clock, the lease would look six minutes expired.
    let ahead = OperatorProcess::start(
        &s.env,
        &OperatorOptions {
            identity: "clock-ahead",
            providers: s.providers_file.path(),
            lease_duration: "3s",
            clock_offset: Some("+3m"),
            extra_args: &[],
        },
    );
    assert_eq!(ahead.get("/healthz").await.0, 200);
    // Count the leader's renewals (one per second) instead of waiting a fixed time:
    // over several lease durations the candidate has looked at the lease many times.
    let leases: Api<Lease> = s.env.namespaced();
    let renewals = std::cell::RefCell::new(std::collections::BTreeSet::new());
    let holders = std::cell::RefCell::new(Vec::new());
    wait_until(
        &leases,
        LEASE,
        "ten renewals by the leader",
        |lease: Option<&Lease>| {
            let current = holder(lease);
            holders.borrow_mut().push(current.clone());
            if current.as_deref() == Some("clock-behind")
                && let Some(renewed) = lease.and_then(renew_time)
            {
                renewals.borrow_mut().insert(renewed);
            }
            renewals.borrow().len() >= 10 || current.as_deref() != Some("clock-behind")
        },
    )
    .await;
    let holders = holders.into_inner();
    let holders_seen: std::collections::BTreeSet<_> = holders.iter().flatten().collect();
    assert_eq!(
        holders_seen.into_iter().collect::<Vec<_>>(),
        vec!["clock-behind"],
        "the lease never changed hands while its holder renewed it"
    );
    assert!(
        behind
            .get("/metrics")
            .await
            .1
            .contains("egressproxy_is_leader 1"),
        "the holder still leads"
    );
    assert!(
        ahead
            .get("/metrics")
            .await
            .1
            .contains("egressproxy_is_leader 0"),
        "the candidate with the fast clock does not lead"
    );

    // The leader goes away for good: the candidate takes over, exactly once.
    behind.terminate();
    assert!(behind.exit_status().await.success());
    let taken = wait_for_holder(&s.env, "clock-ahead").await;
    assert_eq!(taken.spec.unwrap().lease_transitions, Some(1));
}

#[tokio::test]
async fn a_graceful_restart_hands_the_lease_over_at_once() {
    let s = setup("restart").await;
    let options = |identity| OperatorOptions {
        identity,
        providers: s.providers_file.path(),
        lease_duration: "15s",
        clock_offset: None,
        extra_args: &[],
    };
    let first = OperatorProcess::start(&s.env, &options("before-restart"));
    wait_for_holder(&s.env, "before-restart").await;

    // A restart as a rolling update does it: the old process gets SIGTERM, the new one
    // (with another identity) starts.
    let stopped = Instant::now();
    first.terminate();
    let _second = OperatorProcess::start(&s.env, &options("after-restart"));
    let lease = wait_for_holder(&s.env, "after-restart").await;
    let leaderless = stopped.elapsed();
    println!(
        "leaderless after a graceful restart: {:.2} s (baseline {BASELINE}; lease 15 s)",
        leaderless.as_secs_f64()
    );
    assert!(
        first.exit_status().await.success(),
        "a graceful shutdown exits 0"
    );
    assert!(
        leaderless.as_secs_f64() < 5.0,
        "the new replica must not wait for the old lease to expire: {leaderless:?}"
    );
    let spec = lease.spec.unwrap();
    assert_eq!(spec.lease_transitions, Some(1));
    assert_eq!(spec.lease_duration_seconds, Some(15));
}

#[tokio::test]
async fn a_standby_replica_takes_over_as_soon_as_the_leader_stops() {
    let s = setup("standby").await;
    let options = |identity| OperatorOptions {
        identity,
        providers: s.providers_file.path(),
        lease_duration: "15s",
        clock_offset: None,
        extra_args: &[],
    };
    let leader = OperatorProcess::start(&s.env, &options("leader"));
    wait_for_holder(&s.env, "leader").await;
    let standby = OperatorProcess::start(&s.env, &options("standby"));
    assert!(
        standby
            .get("/metrics")
            .await
            .1
            .contains("egressproxy_is_leader 0")
    );

    let stopped = Instant::now();
    leader.terminate();
    wait_for_holder(&s.env, "standby").await;
    let leaderless = stopped.elapsed();
    println!(
        "leaderless when the leader of two stops: {:.2} s (baseline {BASELINE}; lease 15 s)",
        leaderless.as_secs_f64()
    );
    assert!(leader.exit_status().await.success());
    assert!(
        leaderless.as_secs_f64() < 5.0,
        "the standby must not wait for the old lease to expire: {leaderless:?}"
    );
}
