//! The leader's Lease renewals against a real kube-apiserver reached through a relay
//! that can freeze connections: a renewal that hangs (its connection died with the
//! request sent) is given up and retried on a new connection within the renew
//! deadline, as client-go does, so one hung call does not cost the leadership.

mod common;

use std::time::Duration;

use common::freezing_relay::FreezingRelay;
use common::{LEASE, wait_until};
use egressproxy_operator::k8s::leader::{self, LeaseConfig};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;

fn renew_time(lease: Option<&Lease>) -> Option<jiff::Timestamp> {
    Some(lease?.spec.as_ref()?.renew_time.as_ref()?.0)
}

#[tokio::test]
async fn one_hung_renewal_is_retried_and_the_leader_stays() {
    let env = common::env_with_crd("leader-hung-renewal").await;
    let relay = FreezingRelay::start(socket_address(env.apiserver().server())).await;
    let mut config = env.apiserver().admin_config().await.unwrap();
    config.cluster_url = format!("https://{}", relay.address()).parse().unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let mut leadership = leader::acquire(
        client,
        LeaseConfig::new(
            LEASE.to_owned(),
            env.namespace.clone(),
            "leader".to_owned(),
            Duration::from_secs(6),
        ),
    )
    .await;

    let leases: Api<Lease> = env.namespaced();
    let first = renew_time(leases.get_opt(LEASE).await.unwrap().as_ref()).unwrap();
    // Right after a renewal, freeze every connection: the next renewal hangs on one.
    wait_until(&leases, LEASE, "a renewal", |lease: Option<&Lease>| {
        renew_time(lease).is_some_and(|renewed| renewed > first)
    })
    .await;
    relay.freeze();
    relay.wait_for_a_stuck_request().await;
    let stuck = renew_time(leases.get_opt(LEASE).await.unwrap().as_ref()).unwrap();
    relay.thaw();

    let renewed = wait_until(&leases, LEASE, "a renewal after the hung one", {
        move |lease: Option<&Lease>| renew_time(lease).is_some_and(|renewed| renewed > stuck)
    });
    tokio::select! {
        biased;
        () = leadership.lost() => panic!("one hung renewal cost the leadership"),
        _ = renewed => {}
    }
    assert_eq!(
        common::holder(leases.get_opt(LEASE).await.unwrap().as_ref()).as_deref(),
        Some("leader")
    );
}

/// The socket address of an `https://host:port` URL.
fn socket_address(url: &str) -> std::net::SocketAddr {
    let authority = url.trim_start_matches("https://").trim_end_matches('/');
    authority.parse().unwrap()
}
