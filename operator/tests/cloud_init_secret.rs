//! The cloud-init Secret a Proxy names, against a real kube-apiserver and the reference
//! provider: the operator watches Secrets, so a Secret created or fixed later is picked
//! up at once, not at the next retry of a backoff that may have grown to minutes; and
//! user-data from a Secret is held to the same size limit as inline user-data, with an
//! error that names the Secret and its key.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::fixtures::{proxy, proxy_port};
use common::{reference_config, wait_until};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::context::Context;
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_operator::k8s::proxy_cache::ProxyCache;
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::shared::backoff::Backoff;
use egressproxy_operator::shared::metrics::Metrics;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use egressproxy_provider::validation::MAX_USER_DATA_BYTES;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};

struct Setup {
    env: KubeTestEnv,
    provider: ReferenceProvider,
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// A controller whose retries after a failed reconcile wait ten minutes: anything
/// sooner is the Secret watch's doing.
async fn start(test: &str) -> Setup {
    let env = common::env_with_crd(test).await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "100ms"]).unwrap();
    let config = ProvidersConfig::parse(&reference_config(provider.endpoint(), "5s")).unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut ctx = Context::new(
        env.client.clone(),
        Providers::new(config, metrics.clone()),
        format!("test-{}", env.namespace),
        metrics,
    );
    ctx.retry_backoff = Backoff::new(Duration::from_secs(600), Duration::from_secs(600));
    let (cache, writer) = ProxyCache::new(WatchScope::Namespaces(vec![env.namespace.clone()]));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(egressproxy_operator::proxy::controller::run_with_cache(
        Arc::new(ctx),
        cache,
        writer,
        async {
            let _ = stopped.await;
        },
    ));
    Setup {
        env,
        provider,
        _stop: stop,
    }
}

async fn create_proxy(s: &Setup) {
    let port = proxy_port().await;
    let spec = serde_json::json!({"cloudInit": {"userDataSecretRef": {"name": "user-data", "key": "cloud-config"}}});
    s.env
        .namespaced::<Proxy>()
        .create(&PostParams::default(), &proxy("egress", port, spec))
        .await
        .unwrap();
}

fn secret(user_data: Vec<u8>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some("user-data".into()),
            ..ObjectMeta::default()
        },
        data: Some([("cloud-config".to_owned(), ByteString(user_data))].into()),
        ..Secret::default()
    }
}

/// Waits until the Proxy's Ready condition has `reason`; returns its message.
async fn wait_reason(s: &Setup, reason: &str) -> String {
    let proxies: Api<Proxy> = s.env.namespaced();
    let proxy = wait_until(&proxies, "egress", reason, |p: Option<&Proxy>| {
        ready_condition(p).is_some_and(|(r, _)| r == reason)
    })
    .await;
    ready_condition(proxy.as_ref()).unwrap().1
}

fn ready_condition(proxy: Option<&Proxy>) -> Option<(String, String)> {
    let conditions = &proxy?.status.as_ref()?.conditions;
    let ready = conditions.iter().find(|c| c.type_ == "Ready")?;
    Some((ready.reason.clone(), ready.message.clone()))
}

async fn wait_ready(s: &Setup) {
    let proxies: Api<Proxy> = s.env.namespaced();
    wait_until(
        &proxies,
        "egress",
        "egress to be Ready",
        |p: Option<&Proxy>| {
            p.and_then(|p| p.status.as_ref())
                .is_some_and(|s| s.phase == Some(Phase::Ready))
        },
    )
    .await;
}

#[tokio::test]
async fn a_secret_created_later_is_picked_up_at_once() {
    let s = start("secret-created-later").await;
    create_proxy(&s).await;
    wait_reason(&s, "CloudInitSecretUnavailable").await;
    s.env
        .namespaced::<Secret>()
        .create(&PostParams::default(), &secret(b"#cloud-config\n".to_vec()))
        .await
        .unwrap();
    wait_ready(&s).await;
}

#[tokio::test]
async fn user_data_from_a_secret_over_the_limit_is_refused_until_fixed() {
    let s = start("secret-too-large").await;
    s.env
        .namespaced::<Secret>()
        .create(
            &PostParams::default(),
            &secret(vec![b'#'; MAX_USER_DATA_BYTES + 1]),
        )
        .await
        .unwrap();
    create_proxy(&s).await;
    let message = wait_reason(&s, "CloudInitSecretUnavailable").await;
    for named in [
        "user-data",
        "cloud-config",
        &MAX_USER_DATA_BYTES.to_string(),
    ] {
        assert!(
            message.contains(named),
            "the message names {named}: {message}"
        );
    }
    let mut control = ControlServiceClient::connect(s.provider.endpoint().to_owned())
        .await
        .unwrap();
    let counts = control
        .get_call_counts(control::GetCallCountsRequest {})
        .await
        .unwrap()
        .into_inner()
        .counts;
    assert_eq!(counts.get("CreateInstance"), None, "{counts:?}");

    let fixed =
        serde_json::json!({"data": {"cloud-config": ByteString(b"#cloud-config\n".to_vec())}});
    s.env
        .namespaced::<Secret>()
        .patch("user-data", &PatchParams::default(), &Patch::Merge(&fixed))
        .await
        .unwrap();
    wait_ready(&s).await;
}
