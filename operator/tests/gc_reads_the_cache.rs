//! A garbage-collection sweep judges instances by the Proxies in the controller's cache
//! (the reflector's store), against a real kube-apiserver and the reference provider:
//! it asks the apiserver for no list of Proxies, which with thousands of them would
//! cost the apiserver a full read every sweep.

mod common;

use std::time::Duration;

use common::fixtures::{instance_request, proxy, proxy_port};
use common::request_log::recording;
use common::{Controller, reference_config, wait_ready};
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::Proxy;
use egressproxy_operator::providers::instance_tags;
use kube::api::{Api, PostParams};

#[tokio::test]
async fn a_sweep_judges_by_the_cached_proxies_without_listing_them() {
    let env = common::env_with_crd("gc-cache").await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "100ms"]).unwrap();
    let cluster = format!("test-{}", env.namespace);
    let config = reference_config(provider.endpoint(), "5s");
    let controller = Controller::start(&env, &config, &cluster);
    let proxies: Api<Proxy> = env.namespaced();
    let port = proxy_port().await;
    proxies
        .create(
            &PostParams::default(),
            &proxy("egress", port, serde_json::json!({})),
        )
        .await
        .unwrap();
    let live = wait_ready(&proxies, "egress")
        .await
        .status
        .unwrap()
        .provider_id
        .unwrap();
    let mut client = egressproxy_provider::client::connect_lazy(
        &egressproxy_provider::client::ClientOptions::new(provider.endpoint()),
    )
    .unwrap();
    let tags = [
        (instance_tags::CLUSTER, cluster.as_str()),
        (instance_tags::NAMESPACE, env.namespace.as_str()),
        (instance_tags::UID, "a-proxy-long-gone"),
    ];
    let orphan = client
        .create_instance(instance_request("orphan", &tags))
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap()
        .id;

    // The sweep runs with a context of its own whose client records every request, so
    // the log holds the sweep's requests and none of the controller's (whose watch
    // fills the cache).
    let (recorder, requests) = recording(env.client.clone(), &env.namespace);
    let sweeper = common::context(recorder, &config, &cluster);
    let report =
        egressproxy_operator::proxy::gc::sweep(&sweeper, &controller.cache, Duration::ZERO).await;

    assert_eq!(
        report.deleted,
        vec![orphan],
        "the orphan goes and {live}, whose Proxy is in the cache, stays: {report:?}"
    );
    let lists = requests.lists_of(0, "proxies");
    assert!(
        lists.is_empty(),
        "the sweep listed Proxies from the apiserver instead of reading its cache: {lists:#?}"
    );
}
