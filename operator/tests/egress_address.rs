//! `status.egressAddress`, the address destinations see, observed through the proxy
//! against a real kube-apiserver and the reference provider as a process.
//!
//! The provider keeps addresses for identities in a range of loopback addresses, where
//! the test's natting proxies stand in for the VMs' proxies: each forwards to the
//! test's echo service from another loopback address, as a proxy behind NAT does, so
//! the address a destination sees differs from the VM's own.

mod common;

use std::net::{IpAddr, SocketAddr};

use common::Controller;
use common::egress::{EchoService, NattingProxy};
use common::fixtures::{proxy, wait_event};
use common::stand_in::ProxyStandIn;
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::{Proxy, ProxyPool};
use egressproxy_provider::pb;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};

/// In the check URL, where only a leak would show it.
const SECRET: &str = "s3cret-token";

struct Harness {
    env: KubeTestEnv,
    provider: ReferenceProvider,
    _controller: Controller,
}

impl Harness {
    /// The provider grants identities the addresses `first..=last`; its config names
    /// the echo service as `egressCheckUrl`, with credentials and a query that must
    /// never show.
    async fn start(test: &str, first: &str, last: &str, echo: &EchoService) -> Harness {
        let env = common::env_with_crd(test).await;
        let provider = ReferenceProvider::start_keeping_addresses(&[
            "--provisioning-delay",
            "200ms",
            "--identity-range-first",
            first,
            "--identity-range-last",
            last,
        ])
        .unwrap();
        let config = format!(
            "{}    egressCheckUrl: http://user:{SECRET}@{}/ip?key={SECRET}\n",
            common::reference_config(provider.endpoint(), "5s"),
            echo.address
        );
        let cluster = format!("test-{}", env.namespace);
        let controller = Controller::start(&env, &config, &cluster).with_pools(&env);
        Harness {
            env,
            provider,
            _controller: controller,
        }
    }

    fn proxies(&self) -> Api<Proxy> {
        self.env.namespaced()
    }

    fn events(&self) -> Api<Event> {
        self.env.namespaced()
    }

    async fn wait_for(&self, name: &str, what: &str, check: impl Fn(&Proxy) -> bool) -> Proxy {
        common::wait_until(&self.proxies(), name, what, |p: Option<&Proxy>| {
            p.is_some_and(&check)
        })
        .await
        .unwrap()
    }

    /// No Event or Proxy status of the namespace shows the check URL's secret.
    async fn assert_nothing_shows_the_secret(&self) {
        let events = self.events().list(&ListParams::default()).await.unwrap();
        let proxies = self.proxies().list(&ListParams::default()).await.unwrap();
        let statuses: Vec<_> = proxies.items.iter().map(|p| &p.status).collect();
        let text = format!(
            "{}{}",
            serde_json::to_string(&events.items).unwrap(),
            serde_json::to_string(&statuses).unwrap()
        );
        assert!(!text.contains(SECRET), "the secret shows: {text}");
    }
}

fn egress(proxy: &Proxy) -> Option<&str> {
    proxy.status.as_ref()?.egress_address.as_deref()
}

fn vm_address(proxy: &Proxy) -> Option<&str> {
    Some(&proxy.status.as_ref()?.addresses.first()?.address)
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// Plain HTTP Proxies without a Service of their own (an EndpointSlice refuses
/// loopback addresses).
fn plain(name: &str, port: u16, egress: serde_json::Value) -> Proxy {
    let mut extra = serde_json::json!({"service": {"enabled": false}});
    if !egress.is_null() {
        extra["egress"] = egress;
    }
    proxy(name, port, extra)
}

#[tokio::test]
async fn the_egress_address_is_what_the_destination_saw_and_a_change_is_announced() {
    let echo = EchoService::start().await;
    let h = Harness::start("egress-seen", "127.0.0.2", "127.0.0.2", &echo).await;
    let port = ProxyStandIn::port().await;
    let nat = NattingProxy::start(SocketAddr::new(ip("127.0.0.2"), port), ip("127.0.0.5")).await;
    h.proxies()
        .create(
            &PostParams::default(),
            &plain("egress", port, serde_json::Value::Null),
        )
        .await
        .unwrap();

    let seen = h
        .wait_for("egress", "an egress address", |p| egress(p).is_some())
        .await;
    assert_eq!(egress(&seen), Some("127.0.0.5"), "{:?}", seen.status);
    assert_eq!(vm_address(&seen), Some("127.0.0.2"), "the VM's own differs");
    let callers = echo.callers();
    assert!(
        !callers.is_empty() && callers.iter().all(|c| *c == ip("127.0.0.5")),
        "the echo service saw what the status shows: {callers:?}"
    );
    let observed = seen
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == "EgressAddressObserved" && c.status == "True");
    assert!(observed.is_some(), "{:?}", seen.status);

    // The NAT in front of the VMs changes; the VM is lost, and its replacement (same
    // identity, same VM address) is seen from the new address.
    nat.set_source(ip("127.0.0.6"));
    let first_id = seen.status.as_ref().unwrap().provider_id.clone().unwrap();
    ControlServiceClient::connect(h.provider.endpoint().to_owned())
        .await
        .unwrap()
        .set_instance_state(control::SetInstanceStateRequest {
            id: first_id.clone(),
            state: pb::InstanceState::Stopped.into(),
        })
        .await
        .unwrap();
    let replaced = h
        .wait_for("egress", "the new egress address", |p| {
            egress(p) == Some("127.0.0.6")
        })
        .await;
    let status = replaced.status.as_ref().unwrap();
    assert_ne!(status.provider_id.as_deref(), Some(first_id.as_str()));
    assert_eq!(vm_address(&replaced), Some("127.0.0.2"));
    assert_eq!(echo.callers().last(), Some(&ip("127.0.0.6")));
    let changed = wait_event(&h.events(), "egress", "EgressAddressChanged").await;
    let note = changed.note.unwrap_or_default();
    assert!(
        note.contains("from 127.0.0.5 to 127.0.0.6") && note.contains("http://127.0.0.1:"),
        "{note}"
    );
    h.assert_nothing_shows_the_secret().await;
    drop(nat);
}

#[tokio::test]
async fn a_proxy_s_own_check_url_wins_and_its_failure_is_said_without_its_secret() {
    let echo = EchoService::start().await;
    let h = Harness::start("egress-fails", "127.0.0.2", "127.0.0.2", &echo).await;
    let port = ProxyStandIn::port().await;
    let _nat = NattingProxy::start(SocketAddr::new(ip("127.0.0.2"), port), ip("127.0.0.5")).await;
    // Nothing listens at the Proxy's own URL: had the provider's been used, the check
    // would pass.
    let refused = h
        .proxies()
        .create(
            &PostParams::default(),
            &plain(
                "ftp",
                port,
                serde_json::json!({"checkUrl": "ftp://echo.example/"}),
            ),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("egress.checkUrl must start with http:// or https://"),
        "{refused}"
    );
    let closed = ProxyStandIn::port().await;
    let url = format!("http://me:{SECRET}@127.0.0.1:{closed}/?token={SECRET}");
    h.proxies()
        .create(
            &PostParams::default(),
            &plain("own-url", port, serde_json::json!({"checkUrl": url})),
        )
        .await
        .unwrap();
    let failed = h
        .wait_for("own-url", "a failed egress check", |p| {
            p.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == "EgressAddressObserved" && c.reason == "EgressCheckFailed")
            })
        })
        .await;
    let status = failed.status.unwrap();
    assert_eq!(
        status.egress_address, None,
        "nothing observed, nothing shown"
    );
    let message = &status
        .conditions
        .iter()
        .find(|c| c.type_ == "EgressAddressObserved")
        .unwrap()
        .message;
    assert!(
        message.contains(&format!("http://127.0.0.1:{closed}/?…")) && message.contains("502"),
        "{message}"
    );
    assert_eq!(
        echo.callers(),
        Vec::<IpAddr>::new(),
        "the provider's URL was not used"
    );
    wait_event(&h.events(), "own-url", "EgressCheckFailed").await;
    h.assert_nothing_shows_the_secret().await;
}

#[tokio::test]
async fn a_pool_lists_its_members_egress_addresses_as_one_allow_list() {
    let echo = EchoService::start().await;
    let h = Harness::start("egress-pool", "127.0.0.2", "127.0.0.3", &echo).await;
    let port = ProxyStandIn::port().await;
    let _nat_a = NattingProxy::start(SocketAddr::new(ip("127.0.0.2"), port), ip("127.0.0.6")).await;
    let _nat_b = NattingProxy::start(SocketAddr::new(ip("127.0.0.3"), port), ip("127.0.0.5")).await;
    let pool: ProxyPool = serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "ProxyPool",
        "metadata": {"name": "partner"},
        "spec": {
            "replicas": 2,
            "service": {"enabled": false},
            "template": {"spec": plain("x", port, serde_json::Value::Null).spec},
        },
    }))
    .unwrap();
    let pools: Api<ProxyPool> = h.env.namespaced();
    pools.create(&PostParams::default(), &pool).await.unwrap();
    let listed = common::wait_until(
        &pools,
        "partner",
        "two egress addresses",
        |p: Option<&ProxyPool>| {
            p.and_then(|p| p.status.as_ref())
                .is_some_and(|s| s.egress_addresses.len() == 2)
        },
    )
    .await
    .unwrap();
    let status = listed.status.unwrap();
    assert_eq!(status.egress_addresses, ["127.0.0.5", "127.0.0.6"]);
    let mut per_member: Vec<_> = status
        .members
        .iter()
        .filter_map(|m| m.egress_address.clone())
        .collect();
    per_member.sort();
    assert_eq!(per_member, status.egress_addresses);
}
