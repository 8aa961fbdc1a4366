//! Leader election between operator processes against a real kube-apiserver:
//! replicas whose wall clocks are minutes apart (libfaketime) never lead at the same
//! time and take over from a crashed leader after one lease duration, and a leader that
//! stops gracefully releases the lease on its way out, so its successor need not wait
//! for the lease to expire (the leaderless time is printed beside its baseline).
//!
//! Clocks are only ever set ahead: the test apiserver's certificate is valid from one
//! minute before it started, so a replica whose clock runs minutes behind could not
//! connect at all.

mod common;

use std::time::Instant;

use common::{LEASE, OperatorOptions, OperatorProcess, holder, wait_for_holder, wait_until};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::k8s::leader::{self, LeaseConfig};
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

/// Runs a leader with wall-clock offset `leader_offset` and then a candidate with
/// `candidate_offset`; checks that the lease stays with the leader over ten renewals,
/// then crashes the leader and returns how long the candidate took to take over and
/// the renewTime it wrote.
async fn skewed_pair(
    test: &str,
    leader_offset: Option<&str>,
    candidate_offset: Option<&str>,
) -> (std::time::Duration, jiff::Timestamp) {
    let s = setup(test).await;
    let options = |identity, clock_offset| OperatorOptions {
        identity,
        providers: s.providers_file.path(),
        lease_duration: "3s",
        clock_offset,
        extra_args: &[],
    };
    let leader = OperatorProcess::start(&s.env, &options("leader", leader_offset));
    let lease = wait_for_holder(&s.env, "leader").await;
    let candidate = OperatorProcess::start(&s.env, &options("candidate", candidate_offset));
    assert_eq!(candidate.get("/healthz").await.0, 200);

    // Count the leader's renewals (one a second) instead of waiting a fixed time: over
    // ten of them, three lease durations, the candidate looks at the lease many times.
    let leases: Api<Lease> = s.env.namespaced();
    let renewals = std::cell::RefCell::new(std::collections::BTreeSet::new());
    let holders = std::cell::RefCell::new(std::collections::BTreeSet::new());
    wait_until(
        &leases,
        LEASE,
        "ten renewals by the leader",
        |lease: Option<&Lease>| {
            let current = holder(lease);
            holders.borrow_mut().insert(current.clone());
            if current.as_deref() == Some("leader")
                && let Some(renewed) = lease.and_then(renew_time)
            {
                renewals.borrow_mut().insert(renewed);
            }
            renewals.borrow().len() >= 10 || current.as_deref() != Some("leader")
        },
    )
    .await;
    assert_eq!(
        holders.into_inner().into_iter().collect::<Vec<_>>(),
        vec![Some("leader".to_owned())],
        "the lease never changed hands while its holder renewed it (first renewTime {:?})",
        renew_time(&lease)
    );
    assert!(
        leader
            .get("/metrics")
            .await
            .1
            .contains("egressproxy_is_leader 1")
    );
    assert!(
        candidate
            .get("/metrics")
            .await
            .1
            .contains("egressproxy_is_leader 0"),
        "the candidate does not lead while the leader renews"
    );

    // The leader crashes (no release): the candidate takes over once the record has
    // not changed for a lease duration on its own clock.
    let crashed = Instant::now();
    leader.kill().await;
    let taken = wait_for_holder(&s.env, "candidate").await;
    let took = crashed.elapsed();
    assert_eq!(taken.spec.as_ref().unwrap().lease_transitions, Some(1));
    (took, renew_time(&taken).unwrap())
}

fn minutes_from_now(time: jiff::Timestamp) -> f64 {
    time.duration_since(jiff::Timestamp::now()).as_secs_f64() / 60.0
}

#[tokio::test]
async fn a_candidate_whose_clock_runs_ahead_never_takes_a_renewed_lease() {
    // To the candidate, three minutes ahead, every renewTime the leader writes lies
    // three minutes in the past.
    let (took, written) = skewed_pair("skew-ahead", None, Some("+3m")).await;
    assert!(
        minutes_from_now(written) > 2.5,
        "the candidate's clock really runs ahead (faketime works): {written}"
    );
    println!(
        "takeover after a crash, candidate clock +3 min: {:.2} s (lease 3 s)",
        took.as_secs_f64()
    );
    assert!(took.as_secs_f64() < 10.0, "{took:?}");
}

#[tokio::test]
async fn a_crashed_leader_whose_clock_ran_ahead_is_replaced_after_one_lease_duration() {
    // The leader's clock runs three minutes ahead: its renewTime lies three minutes in
    // the future, so a renewTime comparison would wait those minutes before taking over.
    let (took, _) = skewed_pair("skew-leader", Some("+3m"), None).await;
    println!(
        "takeover after a crash, leader clock +3 min: {:.2} s (lease 3 s)",
        took.as_secs_f64()
    );
    assert!(
        took.as_secs_f64() < 10.0,
        "the candidate waited for the leader's future renewTime: {took:?}"
    );
}

#[tokio::test]
async fn a_graceful_restart_releases_the_lease_for_its_successor() {
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

    // A restart: the old process gets SIGTERM and exits, then the new one (with another
    // identity) starts.
    let stopped = Instant::now();
    first.terminate();
    assert!(
        first.exit_status().await.success(),
        "a graceful shutdown exits 0"
    );
    // It released the Lease on the way out, so its successor need not wait for the
    // record to expire.
    let leases: Api<Lease> = s.env.namespaced();
    let released = leases.get(LEASE).await.unwrap();
    assert_eq!(
        holder(Some(&released)),
        None,
        "the old leader released the Lease on SIGTERM: {:?}",
        released.spec
    );
    let _second = OperatorProcess::start(&s.env, &options("after-restart"));
    let lease = wait_for_holder(&s.env, "after-restart").await;
    println!(
        "leaderless after a graceful restart: {:.2} s (baseline {BASELINE}; lease 15 s)",
        stopped.elapsed().as_secs_f64()
    );
    let spec = lease.spec.unwrap();
    assert_eq!(spec.lease_transitions, Some(1));
    assert_eq!(spec.lease_duration_seconds, Some(15));
}

/// A Lease record as another replica (or this one) wrote it just now.
fn held_by(identity: &str) -> Lease {
    let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(jiff::Timestamp::now());
    Lease {
        metadata: kube::api::ObjectMeta {
            name: Some(LEASE.to_owned()),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::coordination::v1::LeaseSpec {
            holder_identity: Some(identity.to_owned()),
            lease_duration_seconds: Some(15),
            acquire_time: Some(now.clone()),
            renew_time: Some(now),
            lease_transitions: Some(0),
            ..Default::default()
        }),
    }
}

#[tokio::test]
async fn a_stop_during_the_election_hands_back_a_lease_already_won() {
    // A SIGTERM that comes while the write that won the Lease is landing: the record
    // already names this replica, but the election has not returned yet. Stopping
    // there must still hand the Lease back, or the successor waits out the lease.
    let env = common::env_with_crd("stop-while-winning").await;
    let leases: Api<Lease> = env.namespaced();
    leases
        .create(&kube::api::PostParams::default(), &held_by("stopping"))
        .await
        .unwrap();
    let config = |identity: &str| {
        LeaseConfig::new(
            LEASE.to_owned(),
            env.namespace.clone(),
            identity.to_owned(),
            std::time::Duration::from_secs(15),
        )
    };
    let client = env.client.clone();
    let stopped =
        leader::acquire_unless_stopped(client.clone(), config("stopping"), std::future::ready(()))
            .await;
    assert!(stopped.is_none(), "a stopped election leads nothing");
    assert_eq!(
        holder(leases.get_opt(LEASE).await.unwrap().as_ref()),
        None,
        "the stopped replica handed back the Lease it had won"
    );

    // A replica stopped while another leads leaves that leader alone.
    leases.delete(LEASE, &Default::default()).await.unwrap();
    leases
        .create(&kube::api::PostParams::default(), &held_by("other"))
        .await
        .unwrap();
    let stopped =
        leader::acquire_unless_stopped(client, config("stopping"), std::future::ready(())).await;
    assert!(stopped.is_none());
    assert_eq!(
        holder(leases.get_opt(LEASE).await.unwrap().as_ref()).as_deref(),
        Some("other")
    );
}

#[tokio::test]
async fn a_stopping_leader_releases_the_lease_to_the_standby() {
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
    assert!(leader.exit_status().await.success());
    // The stopped leader released the Lease: no holder, or already the standby, which
    // so need not wait for the record to expire.
    let leases: Api<Lease> = s.env.namespaced();
    let after_exit = leases.get(LEASE).await.unwrap();
    let holder_after_exit = holder(Some(&after_exit));
    assert!(
        matches!(holder_after_exit.as_deref(), None | Some("standby")),
        "the leader still holds the Lease after it exited: {:?}",
        after_exit.spec
    );
    wait_for_holder(&s.env, "standby").await;
    println!(
        "leaderless when the leader of two stops: {:.2} s (baseline {BASELINE}; lease 15 s)",
        stopped.elapsed().as_secs_f64()
    );
}
