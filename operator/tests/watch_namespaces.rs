//! An operator that watches a list of namespaces, against the real kube-apiserver and
//! the reference provider: Proxies in the two watched namespaces become Ready and go
//! with their instances; a Proxy in a third namespace is never touched, and garbage
//! collection leaves that namespace's instances alone.

mod common;

use std::time::Duration;

use common::fixtures::instance_request;
use common::{Controller, WAIT, reference_config};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_provider::pb;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};

const FINALIZER: &str = "egressproxy.dev/instance";

fn proxy(name: &str, port: u16) -> Proxy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": {
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "proxyPort": port,
        },
    }))
    .unwrap()
}

/// A stand-in for the VM's proxy: the reference provider's instances report
/// 127.0.0.1, so a listener there answers the health check.
async fn proxy_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            drop(stream);
        }
    });
    port
}

async fn wait_ready(proxies: &Api<Proxy>, name: &str) -> Proxy {
    let ready = |proxy: Option<&Proxy>| {
        proxy
            .and_then(|p| p.status.as_ref())
            .is_some_and(|status| status.phase == Some(Phase::Ready))
    };
    let what = format!("{name} in {} to be Ready", proxies.namespace().unwrap());
    common::wait_until(proxies, name, &what, ready)
        .await
        .unwrap()
}

/// The instances of `cluster` that the provider holds, by id.
async fn instance_ids(provider: &ReferenceProvider, cluster: &str) -> Vec<String> {
    let client = egressproxy_provider::client::connect_lazy(
        &egressproxy_provider::client::ClientOptions::new(provider.endpoint()),
    )
    .unwrap();
    let request = pb::ListInstancesRequest {
        tag_selector: [("egressproxy.dev/cluster".to_owned(), cluster.to_owned())].into(),
        ..Default::default()
    };
    let mut ids: Vec<String> = client
        .clone()
        .list_instances(request)
        .await
        .unwrap()
        .into_inner()
        .instances
        .into_iter()
        .map(|instance| instance.id)
        .collect();
    ids.sort();
    ids
}

/// Creates an instance tagged as if a Proxy in `namespace` (long gone) had made it.
async fn orphan(provider: &ReferenceProvider, cluster: &str, namespace: &str) -> String {
    let client = egressproxy_provider::client::connect_lazy(
        &egressproxy_provider::client::ClientOptions::new(provider.endpoint()),
    )
    .unwrap();
    let tags = [
        ("egressproxy.dev/cluster", cluster),
        ("egressproxy.dev/namespace", namespace),
        ("egressproxy.dev/uid", "gone"),
    ];
    let request = instance_request(&format!("orphan-{namespace}"), &tags);
    client
        .clone()
        .create_instance(request)
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap()
        .id
}

#[tokio::test]
async fn two_watched_namespaces_are_served_and_a_third_is_ignored() {
    let first = common::env_with_crd("watch-first").await;
    let second = KubeTestEnv::new("watch-second").await.unwrap();
    let ignored = KubeTestEnv::new("watch-ignored").await.unwrap();
    let provider = ReferenceProvider::start(&["--provisioning-delay", "200ms"]).unwrap();
    let cluster = format!("test-{}", first.namespace);
    let port = proxy_port().await;
    let apis = |env: &KubeTestEnv| -> Api<Proxy> { env.namespaced() };

    // The unwatched Proxy exists before the operator starts, so its first list would
    // include it if the scope were wrong.
    apis(&ignored)
        .create(&PostParams::default(), &proxy("egress", port))
        .await
        .unwrap();
    let scope =
        WatchScope::from_flags([format!("{},{}", second.namespace, first.namespace)]).unwrap();
    let controller = Controller::start_in(
        &first,
        scope.clone(),
        &reference_config(provider.endpoint(), "5s"),
        &cluster,
    );
    for env in [&first, &second] {
        apis(env)
            .create(&PostParams::default(), &proxy("egress", port))
            .await
            .unwrap();
    }
    let mut served = Vec::new();
    for env in [&first, &second] {
        let ready = wait_ready(&apis(env), "egress").await;
        assert_eq!(
            ready.metadata.finalizers.as_deref(),
            Some(&[FINALIZER.to_owned()][..])
        );
        served.push(ready.status.unwrap().provider_id.unwrap());
    }
    let second_instance = served[1].clone();
    served.sort();
    assert_eq!(instance_ids(&provider, &cluster).await, served);
    let untouched = apis(&ignored).get("egress").await.unwrap();
    assert!(untouched.status.is_none(), "{:?}", untouched.status);
    assert!(untouched.metadata.finalizers.is_none());

    // Deleting a Proxy in one watched namespace deletes its instance and leaves the
    // other namespace's Proxy as it was.
    let deleted_uid = apis(&first)
        .get("egress")
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    apis(&first)
        .delete("egress", &DeleteParams::default())
        .await
        .unwrap();
    let gone = await_condition(apis(&first), "egress", conditions::is_deleted(&deleted_uid));
    tokio::time::timeout(WAIT, gone)
        .await
        .expect("the finalizer was never removed")
        .unwrap();
    let still_ready = apis(&second).get("egress").await.unwrap();
    assert_eq!(still_ready.status.and_then(|s| s.phase), Some(Phase::Ready));
    let remaining = instance_ids(&provider, &cluster).await;
    assert_eq!(remaining, vec![second_instance]);

    // Garbage collection judges the watched namespaces only: an orphan of a watched
    // namespace goes, one of the ignored namespace stays (its Proxies are invisible).
    let watched_orphan = orphan(&provider, &cluster, &second.namespace).await;
    let foreign_orphan = orphan(&provider, &cluster, &ignored.namespace).await;
    let report =
        egressproxy_operator::proxy::gc::sweep(&controller.ctx, &controller.cache, Duration::ZERO)
            .await;
    assert_eq!(report.deleted, vec![watched_orphan]);
    let mut expected = [remaining, vec![foreign_orphan]].concat();
    expected.sort();
    assert_eq!(instance_ids(&provider, &cluster).await, expected);
}
