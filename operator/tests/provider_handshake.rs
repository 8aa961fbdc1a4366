//! The handshake with a provider (GetPluginInfo + GetCapabilities) against the
//! reference provider as a process: many callers at once share one handshake, and an
//! unreachable provider's error names the endpoint and the OS error.

use std::sync::Arc;

use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::shared::metrics::Metrics;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};

fn providers(endpoint: &str) -> Providers {
    let config = ProvidersConfig::parse(&format!(
        "providers:\n  reference:\n    endpoint: {endpoint}\n    callTimeout: 5s\n"
    ))
    .unwrap();
    Providers::new(config, Arc::new(Metrics::default()))
}

async fn call_counts(provider: &ReferenceProvider) -> std::collections::HashMap<String, u64> {
    ControlServiceClient::connect(provider.endpoint().to_owned())
        .await
        .unwrap()
        .get_call_counts(control::GetCallCountsRequest {})
        .await
        .unwrap()
        .into_inner()
        .counts
}

#[tokio::test]
async fn concurrent_callers_share_one_handshake() {
    let reference = ReferenceProvider::start(&[]).unwrap();
    // A slow answer keeps the first handshake in flight while the others arrive, as
    // after a restart with many Proxies pending.
    ControlServiceClient::connect(reference.endpoint().to_owned())
        .await
        .unwrap()
        .inject_fault(control::InjectFaultRequest {
            method: "GetPluginInfo".into(),
            count: None,
            effect: Some(control::inject_fault_request::Effect::Latency(
                prost_types::Duration {
                    seconds: 0,
                    nanos: 300_000_000,
                },
            )),
            message: String::new(),
            retry_after: None,
        })
        .await
        .unwrap();
    let providers = providers(reference.endpoint());
    let provider = providers.get("reference").unwrap();
    let answers = futures::future::join_all((0..200).map(|_| provider.handshake())).await;
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    let counts = call_counts(&reference).await;
    assert_eq!(counts.get("GetPluginInfo"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("GetCapabilities"), Some(&1), "{counts:?}");
}

#[tokio::test]
async fn callers_waiting_on_a_failed_handshake_share_its_failure() {
    let reference = ReferenceProvider::start(&[]).unwrap();
    ControlServiceClient::connect(reference.endpoint().to_owned())
        .await
        .unwrap()
        .inject_fault(control::InjectFaultRequest {
            method: "GetPluginInfo".into(),
            count: Some(1),
            effect: Some(control::inject_fault_request::Effect::Fail(
                control::ErrorClass::Transient.into(),
            )),
            message: "starting up".into(),
            retry_after: None,
        })
        .await
        .unwrap();
    let providers = providers(reference.endpoint());
    let provider = providers.get("reference").unwrap();
    let answers = futures::future::join_all((0..50).map(|_| provider.handshake())).await;
    let failures = answers.iter().filter(|a| a.is_err()).count();
    let counts = call_counts(&reference).await;
    assert_eq!(
        counts.get("GetPluginInfo"),
        Some(&1),
        "one failed handshake, shared by {failures} callers: {counts:?}"
    );
    provider
        .handshake()
        .await
        .expect("a later caller asks again, and the provider now answers");
}

#[tokio::test]
async fn an_unreachable_provider_is_named_with_its_os_error() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = closed.local_addr().unwrap();
    drop(closed);
    let providers = providers(&format!("http://{address}"));
    let error = providers
        .get("reference")
        .unwrap()
        .handshake()
        .await
        .unwrap_err();
    let mut text = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    assert!(text.contains(&address.to_string()), "{text}");
    assert!(
        text.contains("Connection refused") && text.contains("os error 111"),
        "{text}"
    );
}
