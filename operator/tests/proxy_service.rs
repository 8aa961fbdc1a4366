//! A Proxy's Service and EndpointSlice against a real kube-apiserver, with the
//! reference provider as a process. The apiserver refuses loopback addresses in an
//! EndpointSlice, so the provider's instances report one of this host's own
//! non-loopback addresses, where a listener of the test stands in for the VM's proxy.

mod common;

use std::net::IpAddr;

use common::stand_in::{ProxyStandIn, host_addresses};
use common::{Controller, WAIT, eventually, reference_config, wait_until};
use egressproxy_integration::eventually::count_reached;
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::context::Context;
use egressproxy_operator::crd::Proxy;
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};

struct Harness {
    env: KubeTestEnv,
    provider: ReferenceProvider,
    controller: Controller,
}

impl Harness {
    async fn start(test: &str, address: IpAddr) -> Harness {
        Harness::start_configured(test, address, |_, _| {}).await
    }

    /// Like [`Harness::start`], with the controller's context changed by `configure`.
    async fn start_configured(
        test: &str,
        address: IpAddr,
        configure: impl FnOnce(&mut Context, &KubeTestEnv),
    ) -> Harness {
        let env = common::env_with_crd(test).await;
        let provider = start_provider("127.0.0.1:0", address);
        let cluster = format!("test-{}", env.namespace);
        let controller = Controller::start_configured(
            &env,
            WatchScope::Namespaces(vec![env.namespace.clone()]),
            &reference_config(provider.endpoint(), "5s"),
            &cluster,
            |ctx| configure(ctx, &env),
        );
        Harness {
            env,
            provider,
            controller,
        }
    }

    async fn create(&self, name: &str, port: u16, extra: serde_json::Value) {
        let proxy = common::fixtures::proxy(name, port, extra);
        self.proxies()
            .create(&PostParams::default(), &proxy)
            .await
            .unwrap();
    }

    fn proxies(&self) -> Api<Proxy> {
        self.env.namespaced()
    }

    fn services(&self) -> Api<Service> {
        self.env.namespaced()
    }

    fn slices(&self) -> Api<EndpointSlice> {
        self.env.namespaced()
    }

    /// Waits until the slices of Service `name` list exactly `addresses`.
    async fn wait_endpoints(&self, name: &str, addresses: &[IpAddr]) -> Vec<EndpointSlice> {
        let wanted: Vec<String> = addresses.iter().map(ToString::to_string).collect();
        let what = format!("the slices of {name} to list {wanted:?}");
        let name = name.to_owned();
        common::wait_for_all(&self.slices(), &what, |slices: &[EndpointSlice]| {
            let ours: Vec<&EndpointSlice> = slices
                .iter()
                .filter(|s| s.labels().get("kubernetes.io/service-name") == Some(&name))
                .collect();
            !ours.is_empty() && ready_addresses(&ours) == wanted
        })
        .await;
        self.slices()
            .list(&ListParams::default().labels(&format!("kubernetes.io/service-name={name}")))
            .await
            .unwrap()
            .items
    }

    fn service_writes(&self) -> u64 {
        let text = self.controller.ctx.metrics.encode();
        let line = text
            .lines()
            .find(|l| l.starts_with("egressproxy_service_writes_total "))
            .unwrap();
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    async fn get_instance_calls(&self) -> u64 {
        let mut control = ControlServiceClient::connect(self.provider.endpoint().to_owned())
            .await
            .unwrap();
        let counts = control
            .get_call_counts(control::GetCallCountsRequest {})
            .await
            .unwrap()
            .into_inner()
            .counts;
        counts.get("GetInstance").copied().unwrap_or(0)
    }

    /// Waits until the controller has run `count` more reconciles.
    async fn wait_reconciles(&self, count: u64) {
        let reconciles = || {
            let text = self.controller.ctx.metrics.encode();
            text.lines()
                .find_map(|l| l.strip_prefix("egressproxy_reconciles_total "))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let target = reconciles() + count;
        let what = format!("{count} more reconciles");
        eventually(&what, WAIT, || async {
            count_reached(reconciles(), target, "reconciles")
        })
        .await;
    }

    /// Waits until the provider has answered `calls` more GetInstance calls: as many
    /// polls of a steady Proxy have run.
    async fn wait_polls(&self, calls: u64) {
        let target = self.get_instance_calls().await + calls;
        let what = format!("{calls} more polls");
        eventually(&what, WAIT, || async {
            count_reached(self.get_instance_calls().await, target, "GetInstance calls")
        })
        .await;
    }
}

fn start_provider(listen: &str, address: IpAddr) -> ReferenceProvider {
    let address = address.to_string();
    ReferenceProvider::start_at(
        listen,
        &[
            "--provisioning-delay",
            "300ms",
            "--instance-address",
            &address,
        ],
    )
    .unwrap()
}

/// The ready addresses the slices list.
fn ready_addresses(slices: &[&EndpointSlice]) -> Vec<String> {
    slices
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .flat_map(|e| e.addresses.clone())
        .collect()
}

fn first_address() -> IpAddr {
    *host_addresses()
        .first()
        .expect("this host has no non-loopback address for the EndpointSlice")
}

#[tokio::test]
async fn the_slice_lists_the_checked_address_while_the_proxy_is_ready() {
    let address = first_address();
    let h = Harness::start("svc-ready", address).await;
    let port = ProxyStandIn::port().await;
    let stand_in = ProxyStandIn::listen(port).await;
    h.create("egress", port, serde_json::json!({})).await;

    let slices = h.wait_endpoints("egress", &[address]).await;
    let proxy = common::wait_ready(&h.proxies(), "egress").await;
    let status = proxy.status.clone().unwrap();
    assert_eq!(status.service_name.as_deref(), Some("egress"));
    assert_eq!(
        status.addresses[0].address,
        address.to_string(),
        "the slice lists the address the Address column shows"
    );
    let family = if address.is_ipv6() { "IPv6" } else { "IPv4" };
    assert_eq!(slices.len(), 1);
    let slice = &slices[0];
    assert_eq!(slice.address_type, family);
    assert_eq!(
        slice
            .labels()
            .get("endpointslice.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("egressproxy-operator.egressproxy.dev")
    );
    let slice_port = &slice.ports.as_ref().unwrap()[0];
    assert_eq!(
        (slice_port.name.as_deref(), slice_port.port),
        (Some("proxy"), Some(i32::from(port)))
    );

    let service = h.services().get("egress").await.unwrap();
    let spec = service.spec.clone().unwrap();
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    assert!(spec.selector.is_none(), "a VM is no Pod: no selector");
    let service_port = &spec.ports.unwrap()[0];
    assert_eq!(
        (service_port.name.as_deref(), service_port.port),
        (Some("proxy"), i32::from(port))
    );
    // No garbage collector runs beside this apiserver: the owner references are what
    // makes Kubernetes delete both with the Proxy.
    for owners in [service.owner_references(), slice.owner_references()] {
        assert_eq!(owners.len(), 1);
        assert_eq!(owners[0].kind, "Proxy");
        assert_eq!(Some(&owners[0].uid), proxy.metadata.uid.as_ref());
        assert_eq!(owners[0].controller, Some(true));
    }

    // The proxy stops answering: once the Proxy is not Ready, the slice lists nothing.
    drop(stand_in);
    h.wait_endpoints("egress", &[]).await;
    let degraded = h.proxies().get("egress").await.unwrap();
    assert!(
        !degraded
            .status
            .unwrap()
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
    );
    // It answers again: Ready, and back in the slice.
    let _stand_in = ProxyStandIn::listen(port).await;
    h.wait_endpoints("egress", &[address]).await;
}

#[tokio::test]
async fn a_replacement_vm_s_address_takes_the_old_one_s_place() {
    let addresses = host_addresses();
    assert!(
        addresses.len() >= 2,
        "this test needs two non-loopback addresses on the host (for the old and the new VM), found {addresses:?}"
    );
    let (old, new) = (addresses[0], addresses[1]);
    let mut h = Harness::start("svc-replace", old).await;
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen(port).await;
    h.create("egress", port, serde_json::json!({})).await;
    h.wait_endpoints("egress", &[old]).await;

    // The provider loses its VM and comes back on the same endpoint, making VMs with
    // another address: the operator replaces the vanished VM.
    let listen = h.provider.address().to_owned();
    h.provider.kill();
    h.provider = start_provider(&listen, new);
    h.wait_endpoints("egress", &[new]).await;
    // The new family's slice is written before the old one is deleted, so the
    // Service is never without its endpoint; the old one then goes.
    let family = if new.is_ipv6() { "IPv6" } else { "IPv4" };
    common::wait_for_all(&h.slices(), "the old family's slice to go", |slices| {
        let ours: Vec<&EndpointSlice> = slices
            .iter()
            .filter(|s| {
                s.labels()
                    .get("kubernetes.io/service-name")
                    .map(String::as_str)
                    == Some("egress")
            })
            .collect();
        ours.len() == 1 && ours[0].address_type == family
    })
    .await;
    let proxy = common::wait_ready(&h.proxies(), "egress").await;
    assert_eq!(proxy.status.unwrap().addresses[0].address, new.to_string());
}

#[tokio::test]
async fn a_service_changed_by_hand_is_restored_and_a_steady_proxy_writes_nothing() {
    let address = first_address();
    let h = Harness::start("svc-drift", address).await;
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen(port).await;
    let spec = serde_json::json!({"service": {"annotations": {"team": "net"}}});
    h.create("egress", port, spec).await;
    h.wait_endpoints("egress", &[address]).await;
    common::wait_ready(&h.proxies(), "egress").await;

    // A steady Proxy: several polls, no write, the objects untouched.
    h.wait_polls(1).await;
    let service = h.services().get("egress").await.unwrap();
    let writes = h.service_writes();
    h.wait_polls(3).await;
    assert_eq!(
        h.service_writes(),
        writes,
        "a steady Proxy's Service is not rewritten"
    );
    let after = h.services().get("egress").await.unwrap();
    assert_eq!(after.resource_version(), service.resource_version());

    // The rest is on a Proxy polled once in ten minutes: what repairs its Service
    // within the wait is the watch of the operator's objects, not a poll.
    let quiet_port = ProxyStandIn::port().await;
    let _quiet_stand_in = ProxyStandIn::listen(quiet_port).await;
    let spec = serde_json::json!({
        "service": {"annotations": {"team": "net"}},
        "healthCheck": {"periodSeconds": 600, "timeoutSeconds": 1},
    });
    h.create("quiet", quiet_port, spec).await;
    common::wait_ready(&h.proxies(), "quiet").await;
    h.wait_endpoints("quiet", &[address]).await;

    // By hand: another port, another annotation value. Both come back.
    let edit = serde_json::json!({
        "metadata": {"annotations": {"team": "someone-else"}},
        "spec": {"ports": [{"name": "proxy", "port": 9999, "targetPort": 9999, "protocol": "TCP"}]},
    });
    h.services()
        .patch("quiet", &PatchParams::default(), &Patch::Merge(&edit))
        .await
        .unwrap();
    let wanted_port = i32::from(quiet_port);
    wait_until(
        &h.services(),
        "quiet",
        "the Service restored",
        |s: Option<&Service>| {
            s.is_some_and(|s| {
                let ports = s
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.ports.clone())
                    .unwrap_or_default();
                s.annotations().get("team").map(String::as_str) == Some("net")
                    && ports.len() == 1
                    && ports[0].port == wanted_port
            })
        },
    )
    .await;

    // A slice emptied by hand comes back too.
    let slice_name = format!("quiet-{}", if address.is_ipv6() { "ipv6" } else { "ipv4" });
    let emptied = serde_json::json!({"endpoints": []});
    h.slices()
        .patch(
            &slice_name,
            &PatchParams::default(),
            &Patch::Merge(&emptied),
        )
        .await
        .unwrap();
    h.wait_endpoints("quiet", &[address]).await;

    // And a Service deleted by hand.
    let deleted = h.services().get("quiet").await.unwrap().uid();
    h.services()
        .delete("quiet", &DeleteParams::default())
        .await
        .unwrap();
    wait_until(
        &h.services(),
        "quiet",
        "the Service recreated",
        |s: Option<&Service>| s.is_some_and(|s| s.uid() != deleted),
    )
    .await;
}

/// A Ready Proxy is reconciled once per health-check period. When nothing changed,
/// those reconciles neither write nor read its Service and EndpointSlices: with
/// thousands of Proxies those reads were most of the apiserver's load. (What a change
/// by hand brings back is in the test above.)
#[tokio::test]
async fn a_steady_proxy_does_not_read_its_service_again() {
    let address = first_address();
    let mut log = None;
    let h = Harness::start_configured("svc-reads", address, |ctx, env| {
        let (client, requests) = common::request_log::recording(ctx.client.clone(), &env.namespace);
        ctx.client = client;
        log = Some(requests);
    })
    .await;
    let log = log.unwrap();
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen(port).await;
    let spec = serde_json::json!({"healthCheck": {"periodSeconds": 1, "timeoutSeconds": 1}});
    h.create("egress", port, spec).await;
    common::wait_ready(&h.proxies(), "egress").await;
    h.wait_endpoints("egress", &[address]).await;
    let first = log.reads_and_writes_of(0, &["services", "endpointslices"]);
    assert!(
        !first.is_empty(),
        "the log records the first sync's requests"
    );

    // The reconciles the first publish itself set off (its own writes seen by the
    // watch before the status they follow) are over after two more.
    h.wait_reconciles(2).await;
    let mark = log.len();
    h.wait_reconciles(3).await;
    let again = log.reads_and_writes_of(mark, &["services", "endpointslices"]);
    assert!(
        again.is_empty(),
        "a steady Proxy's reconciles asked the apiserver for its Service again: {again:#?}"
    );
}

/// A new Proxy's objects are published twice: before it is Ready (a Service and an
/// empty slice), then with its address. The second time only the slice differs, and
/// nothing said it drifted: it is written without reading the Service or listing the
/// slices again (two requests per new Proxy, which thousands of them pay at once).
#[tokio::test]
async fn a_new_proxy_lists_no_slices_and_turning_ready_writes_its_slice_without_reading() {
    let address = first_address();
    let mut log = None;
    let h = Harness::start_configured("svc-ready", address, |ctx, env| {
        let (client, requests) = common::request_log::recording(ctx.client.clone(), &env.namespace);
        ctx.client = client;
        log = Some(requests);
    })
    .await;
    let log = log.unwrap();
    assert!(
        address.is_ipv4(),
        "{address}: the empty slice is named -ipv4"
    );
    // Nothing answers the health check at first, so the Proxy is published before it
    // is Ready; then its proxy answers.
    let port = ProxyStandIn::port().await;
    let spec = serde_json::json!({"healthCheck": {"periodSeconds": 1, "timeoutSeconds": 1}});
    h.create("egress", port, spec).await;
    wait_until(
        &h.slices(),
        "egress-ipv4",
        "the empty slice",
        |s: Option<&EndpointSlice>| s.is_some(),
    )
    .await;
    let _stand_in = ProxyStandIn::listen(port).await;
    h.wait_endpoints("egress", &[address]).await;

    // Method and what is asked for: the object's name, or `list`.
    let asked: Vec<String> = log
        .reads_and_writes_of(0, &["services", "endpointslices"])
        .iter()
        .map(|request| {
            let (method, path) = request.split_once(' ').unwrap();
            let path = path.split('?').next().unwrap();
            let last = path.rsplit('/').next().unwrap();
            let what = if last == "services" || last == "endpointslices" {
                "list"
            } else {
                last
            };
            format!("{method} {what}")
        })
        .collect();
    // The watches of those objects list them first: the sync's requests start at its
    // read of the Service.
    let synced = asked
        .iter()
        .position(|a| a == "GET egress")
        .expect("the first sync reads the Service");
    let asked = &asked[synced..];
    // A new Proxy has no slices to list (nothing was ever published for it): its
    // Service is read, as a stranger may hold the name.
    let published = [
        "GET egress",
        "PATCH egress",
        "PATCH egress-ipv4",
        "PATCH egress-ipv4",
    ];
    assert!(
        asked.len() >= published.len() && asked[..published.len()] == published,
        "the Service and the empty slice, then the slice with the address: {asked:#?}"
    );
}

#[tokio::test]
async fn a_disabled_service_and_a_deleted_proxy_leave_no_service() {
    let address = first_address();
    let h = Harness::start("svc-off", address).await;
    let port = ProxyStandIn::port().await;
    let _stand_in = ProxyStandIn::listen(port).await;
    h.create(
        "egress",
        port,
        serde_json::json!({"service": {"type": "NodePort"}}),
    )
    .await;
    h.wait_endpoints("egress", &[address]).await;
    let service = h.services().get("egress").await.unwrap();
    assert_eq!(service.spec.unwrap().type_.as_deref(), Some("NodePort"));

    let off = serde_json::json!({"spec": {"service": {"enabled": false}}});
    h.proxies()
        .patch("egress", &PatchParams::default(), &Patch::Merge(&off))
        .await
        .unwrap();
    wait_until(
        &h.services(),
        "egress",
        "the Service deleted",
        |s: Option<&Service>| s.is_none(),
    )
    .await;
    common::wait_for_all(&h.slices(), "no slices", |slices: &[EndpointSlice]| {
        slices.is_empty()
    })
    .await;
    let proxy = h.proxies().get("egress").await.unwrap();
    assert_eq!(proxy.status.unwrap().service_name, None);

    // On again, then the Proxy is deleted: its Service goes with it (the operator
    // deletes it before the VM; no garbage collector runs here).
    let on = serde_json::json!({"spec": {"service": {"enabled": true}}});
    h.proxies()
        .patch("egress", &PatchParams::default(), &Patch::Merge(&on))
        .await
        .unwrap();
    h.wait_endpoints("egress", &[address]).await;
    h.proxies()
        .delete("egress", &DeleteParams::default())
        .await
        .unwrap();
    wait_until(
        &h.proxies(),
        "egress",
        "the Proxy deleted",
        |p: Option<&Proxy>| p.is_none(),
    )
    .await;
    assert!(h.services().get_opt("egress").await.unwrap().is_none());
    let left = h.slices().list(&ListParams::default()).await.unwrap().items;
    assert!(left.is_empty(), "{left:?}");
}
