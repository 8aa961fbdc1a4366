//! An operator told to watch two namespaces but allowed into only one, against a real
//! kube-apiserver (RBAC applies to its ServiceAccount token) and the reference provider:
//! the namespace it may watch is served at once, and a Warning Event about the operator
//! names the namespace it cannot watch and why.

mod common;

use std::sync::Arc;

use common::fixtures::{proxy, proxy_port, wait_event};
use common::wait_until;
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::context::Context;
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_operator::k8s::proxy_cache::ProxyCache;
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::shared::metrics::Metrics;
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, ObjectMeta, PostParams};

/// A ServiceAccount `operator` in `env`'s namespace with the chart's namespaced rules
/// there, and nothing anywhere else.
async fn operator_account(env: &KubeTestEnv) -> kube::Client {
    let meta = |name: &str| ObjectMeta {
        name: Some(name.into()),
        ..ObjectMeta::default()
    };
    let rule = |group: &str, resource: &str, verbs: &[&str]| PolicyRule {
        api_groups: Some(vec![group.into()]),
        resources: Some(vec![resource.into()]),
        verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
        ..PolicyRule::default()
    };
    let create = PostParams::default();
    env.namespaced::<ServiceAccount>()
        .create(
            &create,
            &ServiceAccount {
                metadata: meta("operator"),
                ..ServiceAccount::default()
            },
        )
        .await
        .unwrap();
    let role = Role {
        metadata: meta("operator"),
        rules: Some(vec![
            rule(
                "egressproxy.dev",
                "proxies",
                &["get", "list", "watch", "patch"],
            ),
            rule("egressproxy.dev", "proxies/status", &["get", "patch"]),
            rule("", "secrets", &["get", "list", "watch"]),
            rule("events.k8s.io", "events", &["create", "patch"]),
            rule(
                "",
                "services",
                &["get", "list", "watch", "create", "patch", "delete"],
            ),
            rule(
                "discovery.k8s.io",
                "endpointslices",
                &["list", "watch", "create", "patch", "delete"],
            ),
        ]),
    };
    env.namespaced::<Role>()
        .create(&create, &role)
        .await
        .unwrap();
    let binding = RoleBinding {
        metadata: meta("operator"),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: "operator".into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: "operator".into(),
            namespace: Some(env.namespace.clone()),
            ..Subject::default()
        }]),
    };
    env.namespaced::<RoleBinding>()
        .create(&create, &binding)
        .await
        .unwrap();
    env.service_account_client("operator").await.unwrap()
}

#[tokio::test]
async fn a_namespace_the_operator_may_not_watch_holds_back_only_itself() {
    let allowed = common::env_with_crd("ns-allowed").await;
    let forbidden = KubeTestEnv::new("ns-forbidden").await.unwrap();
    let provider = ReferenceProvider::start(&["--provisioning-delay", "100ms"]).unwrap();
    let client = operator_account(&allowed).await;
    let config =
        ProvidersConfig::parse(&common::reference_config(provider.endpoint(), "5s")).unwrap();
    let metrics = Arc::new(Metrics::default());
    let mut ctx = Context::new(
        client,
        Providers::new(config, metrics.clone()),
        format!("test-{}", allowed.namespace),
        metrics,
    );
    // The operator's own Pod, where the chart runs it: in the namespace it may use.
    ctx.operator.name = Some("operator".into());
    ctx.operator.namespace = Some(allowed.namespace.clone());
    let ctx = Arc::new(ctx);
    let scope =
        WatchScope::from_flags([format!("{},{}", allowed.namespace, forbidden.namespace)]).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (cache, writer) = ProxyCache::new(scope);
    tokio::spawn(egressproxy_operator::proxy::controller::run_with_cache(
        ctx.clone(),
        cache.clone(),
        writer,
        async {
            let _ = stopped.await;
        },
    ));

    let proxies: Api<Proxy> = allowed.namespaced();
    let port = proxy_port().await;
    proxies
        .create(
            &PostParams::default(),
            &proxy("egress", port, serde_json::json!({})),
        )
        .await
        .unwrap();
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

    let events: Api<Event> = allowed.namespaced();
    let warning = wait_event(&events, "operator", "NamespaceNotWatched").await;
    let note = warning.note.unwrap_or_default();
    assert_eq!(warning.type_.as_deref(), Some("Warning"));
    assert!(
        note.contains(&forbidden.namespace) && note.contains("forbidden"),
        "the Event names the namespace and why: {note}"
    );
    let gauge =
        |namespace: &str| format!("egressproxy_namespace_watch_up{{namespace=\"{namespace}\"}}");
    let metrics = ctx.metrics.encode();
    assert!(
        metrics.contains(&format!("{} 0", gauge(&forbidden.namespace))),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("{} 1", gauge(&allowed.namespace))),
        "{metrics}"
    );
    // Garbage collection cannot judge the namespace it cannot see.
    let report =
        egressproxy_operator::proxy::gc::sweep(&ctx, &cache, std::time::Duration::ZERO).await;
    assert_eq!(
        report.unlisted_namespaces,
        vec![forbidden.namespace.clone()]
    );
    drop(stop);
}
