//! Nothing the operator keeps per Proxy outlives the Proxy, even when work for it
//! finishes after the watch saw it go: against a real kube-apiserver (whose client the
//! operator's context holds), with the reconcile's error policy and the per-Proxy maps
//! driven as the controller drives them.

mod common;

use std::sync::Arc;

use egressproxy_operator::context::Context;
use egressproxy_operator::crd::Proxy;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::proxy::reconcile::error_policy;
use egressproxy_operator::shared::error::Error;
use egressproxy_operator::shared::metrics::Metrics;

fn context(env: &egressproxy_integration::kube_env::KubeTestEnv) -> Arc<Context> {
    let config = ProvidersConfig::parse("providers: {}\n").unwrap();
    let metrics = Arc::new(Metrics::default());
    Arc::new(Context::new(
        env.client.clone(),
        Providers::new(config, metrics.clone()),
        "memory-test".into(),
        metrics,
    ))
}

fn proxy(namespace: &str, uid: &str) -> Arc<Proxy> {
    Arc::new(
        serde_json::from_value(serde_json::json!({
            "apiVersion": "egressproxy.dev/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": "egress", "namespace": namespace, "uid": uid},
            "spec": {
                "provider": "reference",
                "placement": {"machineType": "small", "image": "debian-12"},
            },
        }))
        .unwrap(),
    )
}

/// A reconcile that fails after the watch saw its Proxy deleted (its last status write
/// meets a 404) must not leave a backoff entry that nothing will ever remove.
#[tokio::test]
async fn an_error_after_the_proxy_was_forgotten_leaves_no_backoff_entry() {
    let env = common::env_with_crd("memory-error-policy").await;
    let ctx = context(&env);
    let proxy = proxy(&env.namespace, "uid-gone");
    // The watch saw it, then saw it deleted.
    ctx.trigger_changed("uid-gone", 1);
    ctx.forget_proxy("uid-gone");
    let action = error_policy(proxy, &not_found(&env).await, ctx.clone());
    assert_ne!(action, kube::runtime::controller::Action::await_change());
    assert_eq!(
        ctx.retry_backoff.len(),
        0,
        "a backoff entry outlived its Proxy"
    );
    // A Proxy still watched keeps its backoff, so its retries still grow.
    let live = proxy_live(&env, &ctx, "uid-live");
    error_policy(live, &not_found(&env).await, ctx.clone());
    assert_eq!(ctx.retry_backoff.len(), 1);
}

/// The apiserver's answer to a write of a Proxy that is gone.
async fn not_found(env: &egressproxy_integration::kube_env::KubeTestEnv) -> Error {
    let proxies = kube::api::Api::<Proxy>::namespaced(env.client.clone(), &env.namespace);
    Error::Kube(proxies.get("egress").await.unwrap_err())
}

fn proxy_live(
    env: &egressproxy_integration::kube_env::KubeTestEnv,
    ctx: &Context,
    uid: &str,
) -> Arc<Proxy> {
    ctx.trigger_changed(uid, 1);
    proxy(&env.namespace, uid)
}

/// Whatever was recorded for a Proxy the store no longer has is swept, whichever map
/// holds it: the controller sweeps against its store periodically and at every relist.
#[tokio::test]
async fn a_sweep_against_the_live_proxies_empties_every_map_of_the_gone() {
    let env = common::env_with_crd("memory-sweep").await;
    let ctx = context(&env);
    // Written by work that finished after the Proxy left the watch.
    ctx.poll_backoff.next("uid-gone");
    ctx.replace_backoff.next("uid-gone");
    ctx.health_failures
        .lock()
        .unwrap()
        .insert("uid-gone".into(), 2);
    ctx.published.begin(
        "uid-gone",
        &egressproxy_operator::k8s::published::Objects::default(),
    );
    ctx.poll_backoff.next("uid-live");
    let live = std::collections::HashSet::from(["uid-live".to_owned()]);
    ctx.forget_proxies_except(|| live.clone());
    assert_eq!(ctx.poll_backoff.keys(), ["uid-live"]);
    assert!(ctx.replace_backoff.is_empty());
    assert!(ctx.health_failures.lock().unwrap().is_empty());
    assert!(ctx.published.is_empty());
}
