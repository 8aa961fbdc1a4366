//! A Proxy for which no location has room, against the real kube-apiserver and the
//! reference provider as a process whose one host holds no instance: the Create is
//! refused (RESOURCE_EXHAUSTED, CAPACITY_EXHAUSTED), and the Proxy's `Ready` condition
//! and `lastError` say which locations its placement allows and what each lacks, from
//! the provider's ListLocations.

mod common;

use common::{Controller, env_with_crd, reference_config};
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::{Proxy, condition};
use kube::Api;
use kube::api::PostParams;

#[tokio::test]
async fn a_proxy_that_fits_nowhere_says_what_each_location_lacks() {
    let env = env_with_crd("no-room").await;
    let provider = ReferenceProvider::start(&[
        "--hosts",
        "full",
        "--host-zone",
        "full=rack",
        "--zones",
        "rack",
        "--max-instances",
        "full=0",
    ])
    .unwrap();
    let _controller = Controller::start(
        &env,
        &reference_config(provider.endpoint(), "5s"),
        &format!("test-{}", env.namespace),
    );
    let proxies: Api<Proxy> = Api::namespaced(env.client.clone(), &env.namespace);
    let proxy: Proxy = serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "nowhere"},
        "spec": {
            "provider": "reference",
            "placement": {"zone": "rack", "machineType": "small", "image": "debian-12"},
            "proxyPort": 3128,
        },
    }))
    .unwrap();
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .unwrap();

    let explained = |proxy: Option<&Proxy>| {
        proxy
            .and_then(|p| p.status.as_ref())
            .and_then(|status| status.last_error.as_deref())
            .is_some_and(|error| error.contains("room for machine type small"))
    };
    let proxy = common::wait_until(&proxies, "nowhere", "the no-room explanation", explained)
        .await
        .unwrap();
    let status = proxy.status.unwrap();
    let last_error = status.last_error.unwrap();
    for part in [
        "no room for machine type small in zone rack",
        "room for machine type small and image debian-12: \
         host full (room 0, no room: 0 of 0 instances, 0 of 0 instances); \
         zone rack (room 0, no room: 0 of 0 instances, 0 of 0 instances)",
    ] {
        assert!(last_error.contains(part), "{part:?} in {last_error}");
    }
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == condition::READY)
        .unwrap();
    assert_eq!(ready.status, "False");
    assert_eq!(ready.reason, "QuotaExhausted");
    assert!(
        ready.message.contains("host full (room 0"),
        "{}",
        ready.message
    );
}
