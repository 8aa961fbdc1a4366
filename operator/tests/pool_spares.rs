//! A ProxyPool's spares against a real kube-apiserver, with the reference provider as a
//! process and both controllers in-process: spares boot outside the pool's Service, a
//! new member adopts one instead of creating a VM (and the pool boots another), two
//! members told the same spare share nothing, a provider that cannot hand instances
//! over gets cold members and no spares, a deleted pool takes its spares along, and a
//! member whose VM is lost is swapped for a Ready spare (or, without one, replaces its
//! VM itself).
//!
//! The reference provider gives each of two hosts its own address (two of this host's
//! non-loopback addresses, where the test's listeners stand in for the VMs' proxies),
//! so an EndpointSlice shows which host's instance it lists.

mod common;

use std::collections::HashMap;
use std::net::IpAddr;

use common::pool_harness::PoolHarness;
use common::stand_in::{ProxyStandIn, host_addresses};
use common::{wait_for_all, wait_until};
use egressproxy_integration::garbage_collector::GarbageCollector;
use egressproxy_operator::crd::{ADOPT_INSTANCE_ANNOTATION, Proxy, ProxyPool};
use egressproxy_provider::pb;
use k8s_openapi::api::events::v1::Event;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

const POOL_LABEL: &str = "egressproxy.dev/pool";
const ROLE_TAG: &str = "egressproxy.dev/role";
const PLACED_AT_TAG: &str = "egressproxy.dev/placed-at";

/// What this file's tests ask of the shared harness beyond what it has.
impl PoolHarness {
    /// Waits until `pool` reports `ready` Ready members and `spares` Ready spares.
    async fn wait_pool(&self, pool: &str, ready: u32, spares: u32) -> ProxyPool {
        let what = format!("pool {pool} to report {ready} Ready members and {spares} Ready spares");
        wait_until(&self.pools(), pool, &what, move |p: Option<&ProxyPool>| {
            p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
                s.ready_replicas == ready && s.replicas == ready && s.spares_ready == spares
            })
        })
        .await
        .unwrap()
    }

    /// The spares at the provider, by where they were placed.
    async fn spares(&self) -> HashMap<String, pb::Instance> {
        self.instances()
            .await
            .into_iter()
            .filter(|i| i.tags.get(ROLE_TAG).map(String::as_str) == Some("spare"))
            .map(|i| (i.tags[PLACED_AT_TAG].clone(), i))
            .collect()
    }
}

fn two_addresses() -> (IpAddr, IpAddr) {
    let addresses = host_addresses();
    assert!(
        addresses.len() >= 2,
        "this test needs two non-loopback addresses on the host (one per hypervisor host), found {addresses:?}"
    );
    (addresses[0], addresses[1])
}

/// Pool `egress` of `replicas` members and one spare, on host address `a` of
/// `two_addresses`, once the pool reports them all Ready.
struct ReadySpare {
    h: PoolHarness,
    /// The members' and the spare's proxy port.
    port: u16,
    /// The pool, as it reported them Ready.
    pool: ProxyPool,
    /// The spare, as the provider lists it.
    spare: pb::Instance,
    /// Their proxies' stand-in: they stay Ready as long as it listens.
    _stand_in: ProxyStandIn,
}

async fn pool_with_a_ready_spare(test: &str, replicas: u32) -> ReadySpare {
    let (a, _) = two_addresses();
    let h = PoolHarness::start(test, a, a, &[]).await;
    let port = ProxyStandIn::port().await;
    let stand_in = ProxyStandIn::listen_on(a, port).await;
    h.create_pool(
        "egress",
        port,
        serde_json::json!({"replicas": replicas, "spares": 1}),
    )
    .await;
    let pool = h.wait_pool("egress", replicas, 1).await;
    let spare = h.spares().await["template"].clone();
    ReadySpare {
        h,
        port,
        pool,
        spare,
        _stand_in: stand_in,
    }
}

/// Spares boot at the spread targets and stay out of the pool's Service; scaling up
/// adopts the spare at the new member's host (no VM created for the member) and the
/// pool boots a replacement spare.
#[tokio::test]
async fn spares_stay_out_of_the_service_and_a_new_member_adopts_one() {
    let (a, b) = two_addresses();
    let h = PoolHarness::start("spares-adopt", a, b, &[]).await;
    let port = ProxyStandIn::port().await;
    let _on_a = ProxyStandIn::listen_on(a, port).await;
    let _on_b = ProxyStandIn::listen_on(b, port).await;
    h.create_pool(
        "egress",
        port,
        serde_json::json!({"replicas": 1, "spares": 2, "spread": [{"host": "h0"}, {"host": "h1"}]}),
    )
    .await;

    let pool = h.wait_pool("egress", 1, 2).await;
    let condition = pool
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == "SparesReady");
    assert_eq!(
        condition.map(|c| c.status.as_str()),
        Some("True"),
        "{condition:?}"
    );
    // The member is at h0; the spare at h1 (address b) is in no slice.
    h.wait_endpoints("egress", &[a], |_| Ok(())).await;
    let spares = h.spares().await;
    assert_eq!(spares.len(), 2, "{spares:?}");
    let spare_at_h1 = spares["host/h1"].clone();
    assert_eq!(h.instances().await.len(), 3);

    let patch = serde_json::json!({"spec": {"replicas": 2}});
    h.pools()
        .patch("egress", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let adopted = common::wait_ready(&h.proxies(), "egress-1").await;
    let status = adopted.status.as_ref().unwrap();
    assert_eq!(
        status.provider_id.as_ref(),
        Some(&spare_at_h1.id),
        "the new member adopts the spare at its host"
    );
    assert_eq!(status.instance_key.as_ref(), Some(&spare_at_h1.key));
    assert_eq!(
        adopted.annotations()[ADOPT_INSTANCE_ANNOTATION],
        spare_at_h1.id
    );
    h.wait_endpoints("egress", &[a, b], |_| Ok(())).await;
    let events: Api<Event> = h.env.namespaced();
    common::fixtures::wait_event(&events, "egress-1", "AdoptedSpare").await;

    // The pool boots a replacement spare; nothing was created under the member's own key.
    h.wait_pool("egress", 2, 2).await;
    let instances = h.instances().await;
    assert_eq!(instances.len(), 4, "2 members and 2 spares: {instances:?}");
    let member_key = format!("{}-0", adopted.uid().unwrap());
    assert!(
        instances.iter().all(|i| i.key != member_key),
        "the member created a VM of its own"
    );
    let taken = instances.iter().find(|i| i.id == spare_at_h1.id).unwrap();
    assert_eq!(
        taken.tags.get("egressproxy.dev/name").map(String::as_str),
        Some("egress-1")
    );
    assert_eq!(
        taken.tags.get(ROLE_TAG),
        None,
        "the adopted instance is a spare no more"
    );
}

/// Deletes instance `id` behind the operator's back.
async fn make_vanish(h: &PoolHarness, id: &str) {
    pb::provider_client::ProviderClient::connect(h.provider.endpoint().to_owned())
        .await
        .unwrap()
        .delete_instance(pb::DeleteInstanceRequest { id: id.to_owned() })
        .await
        .unwrap();
}

/// A member's VM vanishes while the pool has a Ready spare: a new member adopts the
/// spare, the member that lost its VM is deleted, the pool is back to its Ready
/// members without booting one, and it boots another spare.
#[tokio::test]
async fn a_member_that_lost_its_vm_is_swapped_for_a_ready_spare() {
    let ready = pool_with_a_ready_spare("spares-swap", 2).await;
    let (h, spare) = (&ready.h, &ready.spare);
    let lost = common::wait_ready(&h.proxies(), "egress-0").await;
    let lost_id = lost.status.unwrap().provider_id.unwrap();

    let started = std::time::Instant::now();
    make_vanish(h, &lost_id).await;
    let events: Api<Event> = h.env.namespaced();
    common::fixtures::wait_event(&events, "egress-0", "InstanceVanished").await;
    let swapped = common::fixtures::wait_event(&events, "egress", "MemberSwapped").await;
    let note = swapped.note.unwrap_or_default();
    assert!(
        note.contains("egress-0") && note.contains("egress-2") && note.contains(&spare.id),
        "{note}"
    );
    let adopted = common::wait_ready(&h.proxies(), "egress-2").await;
    assert_eq!(
        adopted.status.as_ref().unwrap().provider_id.as_ref(),
        Some(&spare.id),
        "the new member adopts the spare"
    );
    // The spare was booted without a location: the member records the host the
    // provider chose for it.
    let chosen = spare.placement.as_ref().and_then(|p| p.location.clone());
    assert!(chosen.is_some(), "{spare:?}");
    let recorded = adopted.status.as_ref().unwrap().location.clone();
    assert_eq!(
        recorded
            .and_then(|l| l.host)
            .map(pb::placement::Location::Host),
        chosen
    );
    let what = "the member that lost its VM to be deleted";
    wait_until(&h.proxies(), "egress-0", what, |p: Option<&Proxy>| {
        p.is_none()
    })
    .await;
    let what = "pool egress to list its 2 Ready members egress-1 and egress-2";
    wait_until(&h.pools(), "egress", what, |p: Option<&ProxyPool>| {
        p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
            let names: Vec<&str> = s.members.iter().map(|m| m.name.as_str()).collect();
            s.ready_replicas == 2 && names == ["egress-1", "egress-2"]
        })
    })
    .await;
    eprintln!(
        "from the instance's deletion to 2 Ready members again: {:?}",
        started.elapsed()
    );

    // Another spare boots in place of the one adopted; the lost VM's replacement, if
    // its member had started one, went with the member.
    h.wait_pool("egress", 2, 1).await;
    let now = h.spares().await;
    assert!(now.values().all(|s| s.id != spare.id), "{now:?}");
    let instances = h.instances().await;
    assert_eq!(instances.len(), 3, "2 members and 1 spare: {instances:?}");
}

/// Without a Ready spare, a member whose VM vanished replaces it itself, as before:
/// no member is swapped.
#[tokio::test]
async fn without_a_ready_spare_a_member_replaces_its_lost_vm_itself() {
    let (a, _) = two_addresses();
    let h = PoolHarness::start("spares-no-swap", a, a, &[]).await;
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen_on(a, port).await;
    h.create_pool("egress", port, serde_json::json!({"replicas": 2}))
        .await;
    h.wait_pool("egress", 2, 0).await;
    let lost = common::wait_ready(&h.proxies(), "egress-0").await;
    let lost_id = lost.status.unwrap().provider_id.unwrap();

    make_vanish(&h, &lost_id).await;
    let events: Api<Event> = h.env.namespaced();
    common::fixtures::wait_event(&events, "egress-0", "InstanceVanished").await;
    let what = "egress-0 to be Ready on a new VM";
    wait_until(&h.proxies(), "egress-0", what, |p: Option<&Proxy>| {
        p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
            s.provider_id.as_ref().is_some_and(|id| *id != lost_id)
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True")
        })
    })
    .await;
    h.wait_pool("egress", 2, 0).await;
    assert!(h.proxies().get_opt("egress-2").await.unwrap().is_none());
    let swapped: Vec<Event> = events
        .list(&Default::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("MemberSwapped"))
        .collect();
    assert_eq!(swapped, [], "no member was swapped");
}

/// Two Proxies of the pool told to adopt the same spare: exactly one gets it, the
/// other creates a VM of its own; the pool replaces the spare taken.
#[tokio::test]
async fn two_members_told_the_same_spare_exactly_one_adopts_it() {
    let ready = pool_with_a_ready_spare("spares-race", 0).await;
    let (h, port, pool, spare) = (&ready.h, ready.port, &ready.pool, &ready.spare);

    // Not members (no pool label: the pool neither counts nor deletes them), but
    // controlled by the pool, as a member is.
    let contender = |name: &str| {
        let mut proxy = common::fixtures::proxy(name, port, serde_json::json!({}));
        proxy.metadata.annotations =
            Some([(ADOPT_INSTANCE_ANNOTATION.to_owned(), spare.id.clone())].into());
        proxy.metadata.owner_references = Some(vec![
            k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
                api_version: "egressproxy.dev/v1alpha1".into(),
                kind: "ProxyPool".into(),
                name: "egress".into(),
                uid: pool.uid().unwrap(),
                controller: Some(true),
                ..Default::default()
            },
        ]);
        proxy
    };
    let (first, second) = (contender("first"), contender("second"));
    let proxies = h.proxies();
    let params = PostParams::default();
    let (one, two) = tokio::join!(
        proxies.create(&params, &first),
        proxies.create(&params, &second)
    );
    one.unwrap();
    two.unwrap();
    let first = common::wait_ready(&proxies, "first").await;
    let second = common::wait_ready(&proxies, "second").await;
    let ids: Vec<String> = [&first, &second]
        .iter()
        .map(|p| p.status.as_ref().unwrap().provider_id.clone().unwrap())
        .collect();
    let winners = ids.iter().filter(|id| **id == spare.id).count();
    assert_eq!(
        winners, 1,
        "exactly one adopts the spare: {ids:?} vs {}",
        spare.id
    );
    assert_ne!(ids[0], ids[1]);
    let loser = if ids[0] == spare.id {
        "second"
    } else {
        "first"
    };
    let events: Api<Event> = h.env.namespaced();
    common::fixtures::wait_event(&events, loser, "SpareNotAdopted").await;

    // The pool boots another spare in place of the one taken. Its members' changes
    // start its passes; these two are not members, so a change of the pool does.
    let kick = serde_json::json!({"metadata": {"annotations": {"test/kick": "1"}}});
    h.pools()
        .patch("egress", &PatchParams::default(), &Patch::Merge(&kick))
        .await
        .unwrap();
    let what = "a second spare booted";
    wait_until(&h.pools(), "egress", what, |p: Option<&ProxyPool>| {
        p.and_then(|p| p.status.as_ref())
            .is_some_and(|s| s.spares_created == 2 && s.spares_ready == 1)
    })
    .await;
    let now = h.spares().await;
    assert!(now.values().all(|s| s.id != spare.id), "{now:?}");
    assert_eq!(now.len(), 1);
}

/// A provider without CAPABILITY_UPDATE_TAGS: the pool keeps no spares, says so, and
/// its members are created as ever.
#[tokio::test]
async fn without_a_hand_over_a_pool_keeps_no_spares_and_says_so() {
    let (a, _) = two_addresses();
    let h = PoolHarness::start("spares-none", a, a, &["--no-update-tags"]).await;
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen_on(a, port).await;
    h.create_pool(
        "egress",
        port,
        serde_json::json!({"replicas": 1, "spares": 2}),
    )
    .await;
    let what = "the pool to say it keeps no spares";
    wait_until(&h.pools(), "egress", what, |p: Option<&ProxyPool>| {
        p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
            s.ready_replicas == 1
                && s.conditions.iter().any(|c| {
                    c.type_ == "SparesReady" && c.status == "False" && c.reason == "NoHandOver"
                })
        })
    })
    .await;
    let events: Api<Event> = h.env.namespaced();
    common::fixtures::wait_event(&events, "egress", "SparesUnavailable").await;
    let instances = h.instances().await;
    assert_eq!(instances.len(), 1, "one member, no spare: {instances:?}");
    let member = h.proxies().get("egress-0").await.unwrap();
    assert_eq!(
        member.status.unwrap().provider_id.as_ref(),
        Some(&instances[0].id)
    );
    assert!(!instances[0].tags.contains_key(ROLE_TAG));
}

/// A deleted pool deletes its spares before it goes: no instance is left.
#[tokio::test]
async fn a_deleted_pool_takes_its_spares_along() {
    let (a, _) = two_addresses();
    let h = PoolHarness::start("spares-delete", a, a, &[]).await;
    let mut collector = GarbageCollector::start(h.env.apiserver()).unwrap();
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen_on(a, port).await;
    h.create_pool(
        "egress",
        port,
        serde_json::json!({"replicas": 1, "spares": 2}),
    )
    .await;
    h.wait_pool("egress", 1, 2).await;
    assert_eq!(h.instances().await.len(), 3);

    h.pools()
        .delete("egress", &DeleteParams::default())
        .await
        .unwrap();
    wait_for_all(
        &h.pools(),
        "the pool to be gone",
        |pools: &[ProxyPool]| pools.is_empty(),
    )
    .await;
    wait_for_all(
        &h.proxies(),
        "every member to be gone",
        |proxies: &[Proxy]| proxies.iter().all(|p| p.labels().get(POOL_LABEL).is_none()),
    )
    .await;
    assert_eq!(
        h.instances().await,
        Vec::new(),
        "instances outlived their pool"
    );
    collector.ensure_running().unwrap();
}

/// A template change replaces the spares made from the old template: a new member
/// never adopts an outdated VM.
#[tokio::test]
async fn a_template_change_replaces_the_spares() {
    let ready = pool_with_a_ready_spare("spares-template", 0).await;
    let (h, old) = (&ready.h, &ready.spare);

    let patch =
        serde_json::json!({"spec": {"template": {"metadata": {"labels": {"revision": "2"}}}}});
    h.pools()
        .patch("egress", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let what = "a spare of the new template Ready";
    wait_until(&h.pools(), "egress", what, |p: Option<&ProxyPool>| {
        p.and_then(|p| p.status.as_ref())
            .is_some_and(|s| s.spares_created == 2 && s.spares_ready == 1)
    })
    .await;
    let instances = h.instances().await;
    assert_eq!(
        instances.len(),
        1,
        "the old spare is deleted: {instances:?}"
    );
    assert_ne!(instances[0].id, old.id);
    assert_ne!(
        instances[0].tags["egressproxy.dev/template-hash"],
        old.tags["egressproxy.dev/template-hash"]
    );
}

/// The garbage collection deletes a spare whose pool is gone (its finalizer removed by
/// hand) and leaves a live pool's spare alone, though neither has a Proxy.
#[tokio::test]
async fn the_garbage_collection_takes_only_the_spares_of_pools_that_are_gone() {
    let ready = pool_with_a_ready_spare("spares-gc", 0).await;
    let (h, port, live) = (&ready.h, ready.port, &ready.spare);

    // A spare left by an earlier pool of the same name: same tags, another pool UID.
    let mut tags = live.tags.clone();
    tags.insert("egressproxy.dev/pool-uid".into(), "an-earlier-pool".into());
    let mut client = pb::provider_client::ProviderClient::connect(h.provider.endpoint().to_owned())
        .await
        .unwrap();
    let left = client
        .create_instance(pb::CreateInstanceRequest {
            key: "an-earlier-pool-spare-0".into(),
            tags,
            placement: Some(pb::Placement {
                machine_type: "small".into(),
                image: "debian-12".into(),
                ..Default::default()
            }),
            proxy_port: u32::from(port),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();

    let ctx = &h.controller.ctx;
    let report =
        egressproxy_operator::proxy::gc::sweep(ctx, &h.controller.cache, std::time::Duration::ZERO)
            .await;
    assert_eq!(report.deleted, vec![left.id.clone()], "{report:?}");
    let ids: Vec<String> = h.instances().await.into_iter().map(|i| i.id).collect();
    assert_eq!(ids, vec![live.id.clone()], "the live pool's spare stays");
}
