//! ProxyPools against a real kube-apiserver, with the reference provider as a process
//! and both controllers (Proxy and pool) in-process: scaling (`kubectl scale` too),
//! spreading, a template change rolled within its bounds, the pool's Service listing
//! only Ready members, and a deleted pool taking its members, their VMs and its Service
//! along through Kubernetes' own garbage collector.
//!
//! The reference provider gives each of two hosts, both in one zone, its own address
//! (see `common::pool_harness`).

mod common;

use std::cell::Cell;

use common::pool_harness::PoolHarness;
use common::stand_in::{ProxyStandIn, host_addresses};
use common::wait_for_all;
use egressproxy_integration::garbage_collector::GarbageCollector;
use egressproxy_integration::helm::Kubectl;
use egressproxy_operator::crd::{Proxy, ProxyPool};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

const POOL_LABEL: &str = "egressproxy.dev/pool";
const HASH_LABEL: &str = "egressproxy.dev/template-hash";

/// The reference provider's hosts share zone `z0`.
const ONE_ZONE: &[&str] = &["--zones", "z0", "--host-zone", "h0=z0,h1=z0"];

/// What this file's tests ask of the shared harness beyond what it has.
impl PoolHarness {
    fn kubectl(&self, args: &[&str]) -> String {
        let kubectl = Kubectl::new(self.env.apiserver().kubeconfig_path());
        let mut all = args.to_vec();
        all.extend(["-n", &self.env.namespace]);
        kubectl.run(&all, None).unwrap()
    }

    /// Waits until the pool's live members are exactly `count`, all Ready and made from
    /// its current template; returns them.
    async fn wait_members(&self, pool: &str, count: usize) -> Vec<Proxy> {
        let what = format!("{count} Ready, up-to-date members of {pool}");
        let pools = self.pools();
        let name = pool.to_owned();
        wait_for_all(&self.proxies(), &what, |proxies: &[Proxy]| {
            let members: Vec<&Proxy> = members_of(proxies, &name);
            let hashes: Vec<Option<&String>> =
                members.iter().map(|p| p.labels().get(HASH_LABEL)).collect();
            members.len() == count
                && members
                    .iter()
                    .all(|p| is_ready(p) && p.metadata.deletion_timestamp.is_none())
                && hashes.windows(2).all(|w| w[0] == w[1])
                && proxies.len() == count
        })
        .await;
        // Every member carries the pool's current template hash: the pool reports
        // them all up to date.
        let what = format!("pool {pool} to report {count} Ready, up-to-date members");
        common::wait_until(&pools, pool, &what, move |p: Option<&ProxyPool>| {
            p.and_then(|p| p.status.as_ref()).is_some_and(|s| {
                s.ready_replicas as usize == count
                    && s.updated_replicas as usize == count
                    && s.replicas as usize == count
            })
        })
        .await;
        let all = self
            .proxies()
            .list(&Default::default())
            .await
            .unwrap()
            .items;
        members_of(&all, pool).into_iter().cloned().collect()
    }

    /// Waits until the pool's live members are exactly `names`, all Ready.
    async fn wait_members_named(&self, pool: &str, names: &[&str]) -> Vec<Proxy> {
        let what = format!("members {names:?} of {pool}, Ready");
        let pool = pool.to_owned();
        wait_for_all(&self.proxies(), &what, |proxies: &[Proxy]| {
            let members = members_of(proxies, &pool);
            let mut have: Vec<String> = members.iter().map(|p| p.name_any()).collect();
            have.sort();
            have == names && members.iter().all(|p| is_ready(p))
        })
        .await;
        let all = self
            .proxies()
            .list(&Default::default())
            .await
            .unwrap()
            .items;
        members_of(&all, &pool).into_iter().cloned().collect()
    }
}

fn members_of<'a>(proxies: &'a [Proxy], pool: &str) -> Vec<&'a Proxy> {
    proxies
        .iter()
        .filter(|p| p.labels().get(POOL_LABEL).map(String::as_str) == Some(pool))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect()
}

fn is_ready(proxy: &Proxy) -> bool {
    proxy.status.as_ref().is_some_and(|s| {
        s.conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

#[tokio::test]
async fn a_pool_spreads_its_members_and_its_service_lists_only_the_ready_ones() {
    let addresses = host_addresses();
    assert!(
        addresses.len() >= 2,
        "this test needs two non-loopback addresses on the host (one per hypervisor host), found {addresses:?}"
    );
    let (a, b) = (addresses[0], addresses[1]);
    let h = PoolHarness::start("pool-spread", a, b, ONE_ZONE).await;
    let port = ProxyStandIn::port().await;
    let _on_a = ProxyStandIn::listen_on(a, port).await;
    let on_b = ProxyStandIn::listen_on(b, port).await;
    h.create_pool(
        "egress",
        port,
        serde_json::json!({"replicas": 2, "spread": [{"host": "h0"}, {"host": "h1"}]}),
    )
    .await;

    h.wait_endpoints("egress", &[a, b], |_| Ok(())).await;
    let members = h.wait_members("egress", 2).await;
    let mut hosts: Vec<Option<String>> = members
        .iter()
        .map(|m| m.spec.placement.host.clone())
        .collect();
    hosts.sort();
    assert_eq!(hosts, [Some("h0".to_owned()), Some("h1".to_owned())]);
    let pool = h.pools().get("egress").await.unwrap();
    for member in &members {
        let owner = &member.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("ProxyPool", Some(true))
        );
        assert_eq!(Some(&owner.uid), pool.metadata.uid.as_ref());
    }
    let status = pool.status.unwrap();
    assert_eq!(status.service_name.as_deref(), Some("egress"));
    assert_eq!(
        status.selector.as_deref(),
        Some("egressproxy.dev/pool=egress")
    );
    let service: Service = h.env.namespaced().get("egress").await.unwrap();
    assert_eq!(service.owner_references()[0].kind, "ProxyPool");

    // The proxy on h1 stops answering: its member fails its health check and leaves
    // the Service's endpoints, while the other one stays listed throughout.
    let keeps_a = |listed: &[String]| {
        if listed.contains(&a.to_string()) {
            Ok(())
        } else {
            Err(format!("the Ready member at {a} left the pool's endpoints"))
        }
    };
    drop(on_b);
    h.wait_endpoints("egress", &[a], keeps_a).await;
    let names: Vec<String> = members.iter().map(|m| m.name_any()).collect();
    let now: Vec<String> = members_of(
        &h.proxies().list(&Default::default()).await.unwrap().items,
        "egress",
    )
    .iter()
    .map(|m| m.name_any())
    .collect();
    assert_eq!(
        now.len(),
        2,
        "the pool keeps the unhealthy member: its Proxy heals it"
    );
    assert!(
        now.iter().all(|n| names.contains(n)),
        "{now:?} vs {names:?}"
    );

    // It answers again: back in the endpoints.
    let _on_b = ProxyStandIn::listen_on(b, port).await;
    h.wait_endpoints("egress", &[a, b], keeps_a).await;
}

/// With `spreadAcross: hosts`, the pool asks the provider which hosts take the
/// template's machine type and spreads its members across them, showing the list it
/// used in its status.
#[tokio::test]
async fn a_pool_spread_across_hosts_uses_the_hosts_the_provider_lists() {
    let addresses = host_addresses();
    let a = addresses[0];
    let b = addresses.get(1).copied().unwrap_or(a);
    let h = PoolHarness::start("pool-across", a, b, ONE_ZONE).await;
    let port = ProxyStandIn::port().await;
    let _on_a = ProxyStandIn::listen_on(a, port).await;
    // With one usable address both hosts report it, and one listener serves both.
    let _on_b = if b != a {
        Some(ProxyStandIn::listen_on(b, port).await)
    } else {
        None
    };
    h.create_pool(
        "across",
        port,
        serde_json::json!({"replicas": 2, "spreadAcross": "hosts"}),
    )
    .await;

    let members = h.wait_members("across", 2).await;
    let mut hosts: Vec<Option<String>> = members
        .iter()
        .map(|m| m.spec.placement.host.clone())
        .collect();
    hosts.sort();
    assert_eq!(hosts, [Some("h0".to_owned()), Some("h1".to_owned())]);
    let status = h.pools().get("across").await.unwrap().status.unwrap();
    let targets: Vec<Option<String>> = status
        .spread_targets
        .iter()
        .map(|t| t.host.clone())
        .collect();
    assert_eq!(targets, [Some("h0".to_owned()), Some("h1".to_owned())]);
}

#[tokio::test]
async fn kubectl_scale_resizes_a_pool_and_a_template_change_rolls_within_its_bounds() {
    let address = host_addresses()[0];
    let h = PoolHarness::start("pool-roll", address, address, ONE_ZONE).await;
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen_on(address, port).await;
    h.create_pool("egress", port, serde_json::json!({"replicas": 2}))
        .await;
    h.wait_members("egress", 2).await;

    h.kubectl(&["scale", "proxypool/egress", "--replicas=3"]);
    let before = h.wait_members("egress", 3).await;
    let table = h.kubectl(&["get", "proxypools"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "NAME",
            "DESIRED",
            "READY",
            "UP-TO-DATE",
            "SPARES",
            "SERVICE",
            "AGE"
        ]
    );
    assert!(
        table
            .lines()
            .nth(1)
            .unwrap()
            .split_whitespace()
            .take(6)
            .eq(["egress", "3", "3", "3", "0", "egress"]),
        "{table}"
    );

    // A template change (maxSurge 1, maxUnavailable 0 by default) replaces every
    // member, never with fewer than 3 Ready or more than 4 live members.
    let patch =
        serde_json::json!({"spec": {"template": {"metadata": {"labels": {"revision": "2"}}}}});
    h.pools()
        .patch("egress", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
    let old: Vec<String> = before.iter().filter_map(|m| m.uid()).collect();
    let fewest_ready = Cell::new(usize::MAX);
    let most_live = Cell::new(0);
    wait_for_all(
        &h.proxies(),
        "the members to be replaced",
        |proxies: &[Proxy]| {
            let live = members_of(proxies, "egress");
            let ready = live.iter().filter(|p| is_ready(p)).count();
            fewest_ready.set(fewest_ready.get().min(ready));
            most_live.set(most_live.get().max(live.len()));
            live.len() == 3
                && live.iter().all(|p| {
                    is_ready(p)
                        && !p.uid().is_some_and(|uid| old.contains(&uid))
                        && p.labels().get("revision").map(String::as_str) == Some("2")
                })
        },
    )
    .await;
    assert!(
        fewest_ready.get() >= 3,
        "Ready members fell to {}",
        fewest_ready.get()
    );
    assert!(
        most_live.get() <= 4,
        "{} live members: more than replicas + maxSurge",
        most_live.get()
    );
    h.wait_members("egress", 3).await;

    h.kubectl(&["scale", "proxypool/egress", "--replicas=1"]);
    h.wait_members("egress", 1).await;
}

#[tokio::test]
async fn a_deleted_pool_takes_its_members_their_vms_and_its_service_along() {
    let address = host_addresses()[0];
    let h = PoolHarness::start("pool-delete", address, address, ONE_ZONE).await;
    // The collector learns the API's kinds when it starts: after the CRDs.
    let mut collector = GarbageCollector::start(h.env.apiserver()).unwrap();
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen_on(address, port).await;
    h.create_pool("egress", port, serde_json::json!({"replicas": 2}))
        .await;
    h.wait_members("egress", 2).await;
    assert_eq!(h.instances().await.len(), 2);

    h.pools()
        .delete("egress", &DeleteParams::default())
        .await
        .unwrap();
    wait_for_all(
        &h.proxies(),
        "every member to be gone",
        |proxies: &[Proxy]| proxies.is_empty(),
    )
    .await;
    wait_for_all(
        &h.slices(),
        "the pool's slices to be gone",
        |slices: &[EndpointSlice]| slices.is_empty(),
    )
    .await;
    let services: Api<Service> = h.env.namespaced();
    wait_for_all(
        &services,
        "the pool's Service to be gone",
        |services: &[Service]| services.is_empty(),
    )
    .await;
    // A member's finalizer goes only once its VM is gone: nothing is left behind.
    assert_eq!(h.instances().await.len(), 0, "VMs outlived their members");
    collector.ensure_running().unwrap();
}

/// A Proxy that is not a member holding a member's name, and a Service that is not the
/// pool's holding the pool's Service name: the pool steps over the first (its member
/// takes the next free name) and leaves the second alone, with a Warning each.
#[tokio::test]
async fn names_held_by_others_are_stepped_over_and_left_alone() {
    let address = host_addresses()[0];
    let h = PoolHarness::start("pool-names", address, address, ONE_ZONE).await;
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen_on(address, port).await;
    let stranger = common::fixtures::proxy("egress-0", port, serde_json::json!({}));
    h.proxies()
        .create(&PostParams::default(), &stranger)
        .await
        .unwrap();
    let services: Api<Service> = h.env.namespaced();
    let theirs: Service = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "egress"},
        "spec": {"ports": [{"name": "http", "port": 80}]},
    }))
    .unwrap();
    services
        .create(&PostParams::default(), &theirs)
        .await
        .unwrap();

    h.create_pool("egress", port, serde_json::json!({"replicas": 2}))
        .await;
    let members = h
        .wait_members_named("egress", &["egress-1", "egress-2"])
        .await;
    assert!(
        members
            .iter()
            .all(|m| m.spec.service.as_ref().is_some_and(|s| !s.enabled))
    );
    let events: Api<k8s_openapi::api::events::v1::Event> = h.env.namespaced();
    let taken = common::fixtures::wait_event(&events, "egress", "MemberNameTaken").await;
    assert!(taken.note.unwrap_or_default().contains("egress-0"));
    common::fixtures::wait_event(&events, "egress", "ServiceNameTaken").await;

    let pool = h.pools().get("egress").await.unwrap();
    assert_eq!(
        pool.status.unwrap().service_name,
        None,
        "the Service is not the pool's"
    );
    let service = services.get("egress").await.unwrap();
    assert!(
        service.owner_references().is_empty(),
        "their Service is left alone"
    );
    let proxy = h.proxies().get("egress-0").await.unwrap();
    assert!(
        proxy.owner_references().is_empty(),
        "their Proxy is left alone"
    );
}
