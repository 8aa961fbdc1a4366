//! `--max-concurrent-reconciles` bounds the calls a provider sees at once, against a
//! real kube-apiserver and the reference provider served in-process (so its peak of
//! calls in flight can be read): a provider config change sets off a reconcile of
//! every Proxy at the same moment, each calls GetInstance, and a slow provider makes
//! those calls overlap as far as the bound lets them.

mod common;

use std::time::Duration;

use common::fixtures::{proxy, proxy_port};
use common::{Controller, WAIT, eventually, reference_config, wait_for_all};
use egressproxy_integration::eventually::count_reached;
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_operator::providers::ProvidersConfig;
use egressproxy_provider::reference::{Fault, FaultEffect, MemoryProvider, ReferenceConfig};
use egressproxy_provider::server::ProviderServer;
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, PostParams};

/// The bound under test.
const BOUND: u16 = 3;
/// Proxies: several times the bound, so that a burst of them has to queue.
const PROXIES: usize = 12;
/// How long each GetInstance takes: long enough that the burst's calls overlap.
const SLOW_ANSWER: Duration = Duration::from_millis(300);

#[tokio::test]
async fn a_burst_of_reconciles_never_runs_more_provider_calls_than_the_bound() {
    let env = common::env_with_crd("max-concurrent").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let provider = MemoryProvider::new(ReferenceConfig {
        provisioning_delay: Duration::ZERO,
        // Instances then answer at 127.0.0.1, where the stand-in proxy listens.
        address_identities: false,
        ..ReferenceConfig::default()
    });
    tokio::spawn(ProviderServer::new(provider.clone()).serve(listener, std::future::pending()));
    let config = |call_timeout| ProvidersConfig::parse(&reference_config(&endpoint, call_timeout));
    let controller = Controller::start_configured(
        &env,
        WatchScope::Namespaces(vec![env.namespace.clone()]),
        &reference_config(&endpoint, "30s"),
        "max-concurrent",
        |ctx| ctx.max_concurrent_reconciles = BOUND,
    );

    // Checked rarely, so that the burst below is what reconciles them.
    let port = proxy_port().await;
    let steady = serde_json::json!({"healthCheck": {"periodSeconds": 300, "timeoutSeconds": 1}});
    let proxies: Api<Proxy> = env.namespaced();
    futures::stream::iter(0..PROXIES)
        .map(|i| {
            let (proxies, proxy) = (
                proxies.clone(),
                proxy(&format!("p{i:02}"), port, steady.clone()),
            );
            async move { proxies.create(&PostParams::default(), &proxy).await }
        })
        .buffer_unordered(PROXIES)
        .try_collect::<Vec<_>>()
        .await
        .unwrap();
    wait_for_all(&proxies, "every Proxy Ready", |all: &[Proxy]| {
        all.len() == PROXIES
            && all
                .iter()
                .all(|p| p.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready))
    })
    .await;

    provider.faults().inject(Fault {
        method: Some("GetInstance".into()),
        remaining: None,
        effect: FaultEffect::Latency(SLOW_ANSWER),
        message: String::new(),
        retry_after: None,
    });
    let get_instance_calls = || {
        provider
            .call_counts()
            .get("GetInstance")
            .copied()
            .unwrap_or(0)
    };
    // The peak from here on is the burst's alone.
    provider.restart_peak_calls_in_flight();
    let target = get_instance_calls() + PROXIES as u64;
    assert!(
        controller.ctx.providers.apply(config("31s").unwrap()),
        "a changed call timeout is a provider config change"
    );
    eventually("every Proxy reconciled after the change", WAIT, || async {
        count_reached(get_instance_calls(), target, "GetInstance calls")
    })
    .await;

    let peak = provider.peak_calls_in_flight()["GetInstance"];
    assert!(
        peak <= u64::from(BOUND),
        "{peak} GetInstance calls ran at once with --max-concurrent-reconciles {BOUND}"
    );
    assert_eq!(
        peak,
        u64::from(BOUND),
        "the burst of {PROXIES} reconciles fills every slot the bound allows"
    );
}
