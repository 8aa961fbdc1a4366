//! One trace runs from a reconcile through the provider: the provider's request span
//! is a child of the operator's client span for the call, itself a child of the
//! reconcile span (in-memory span exporter, real kube-apiserver, reference provider
//! served in-process so its spans are visible).

mod common;

use std::time::Duration;

use common::{Controller, eventually, reference_config, wait_until};
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_provider::reference::{MemoryProvider, ReferenceConfig};
use egressproxy_provider::server::ProviderServer;
use kube::api::{Api, PostParams};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing_subscriber::layer::SubscriberExt;

#[tokio::test(flavor = "current_thread")]
async fn provider_spans_are_children_of_the_reconcile_span() {
    let exporter = InMemorySpanExporter::default();
    let tracer_provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(tracer_provider.tracer("test")));
    let _guard = tracing::subscriber::set_default(subscriber);

    let env = common::env_with_crd("trace").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let provider = MemoryProvider::new(ReferenceConfig {
        provisioning_delay: Duration::ZERO,
        // Addresses kept for an identity lie in TEST-NET-1, where the health check
        // finds no proxy: without them, instances answer at 127.0.0.1.
        address_identities: false,
        ..ReferenceConfig::default()
    });
    tokio::spawn(ProviderServer::new(provider).serve(listener, std::future::pending()));

    let _controller = Controller::start(&env, &reference_config(&endpoint, "30s"), "trace");
    let proxies: Api<Proxy> = env.namespaced();

    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = health.local_addr().unwrap().port();
    let proxy: Proxy = serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "traced"},
        "spec": {"provider": "reference", "placement": {"machineType": "small", "image": "debian-12"}, "proxyPort": port},
    }))
    .unwrap();
    proxies
        .create(&PostParams::default(), &proxy)
        .await
        .unwrap();
    wait_until(&proxies, "traced", "Ready", |proxy: Option<&Proxy>| {
        proxy.and_then(|p| p.status.as_ref()).and_then(|s| s.phase) == Some(Phase::Ready)
    })
    .await;

    // The reconcile that reached Ready may still be finishing (a span is exported when
    // it ends): wait until the CreateInstance span's whole ancestry has been exported.
    let what = "an exported chain reconcile → client span → CreateInstance";
    let chain = eventually(what, Duration::from_secs(30), || async {
        tracer_provider.force_flush().unwrap();
        let spans = exporter.get_finished_spans().unwrap();
        let create = spans.iter().find(|s| {
            s.name == "grpc.request"
                && s.attributes
                    .iter()
                    .any(|kv| kv.value.as_str().ends_with("/CreateInstance"))
        });
        let client = create.and_then(|create| {
            spans
                .iter()
                .find(|s| s.span_context.span_id() == create.parent_span_id)
        });
        let parent = client.and_then(|client| {
            spans.iter().find(|s| {
                s.name == "reconcile" && s.span_context.span_id() == client.parent_span_id
            })
        });
        if let (Some(create), Some(client), Some(parent)) = (create, client, parent) {
            return Ok((create.clone(), client.clone(), parent.clone()));
        }
        Err(format!(
            "the provider's span: {}, its parent: {}, a reconcile parent of that: {}",
            create.is_some(),
            client.is_some(),
            parent.is_some()
        ))
    });
    let (create, client, parent) = chain.await;
    assert_eq!(
        client.name, "egressproxy.provider.v1.Provider/CreateInstance",
        "the provider's span is a child of the operator's client span for the call"
    );
    assert_eq!(client.span_kind, opentelemetry::trace::SpanKind::Client);
    assert_eq!(
        create.span_context.trace_id(),
        parent.span_context.trace_id()
    );
}
