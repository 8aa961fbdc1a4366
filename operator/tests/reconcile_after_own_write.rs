//! A reconcile never works from a copy of a Proxy older than the operator's own last
//! status write, against a real kube-apiserver and the reference provider served
//! in-process (so its calls can be counted). In a burst, a Proxy's next reconcile
//! (set off by the provider's watch reporting the instance just created) used to start
//! before the watch delivered the status that recorded it, and asked the provider to
//! create the instance again.

mod common;

use std::time::Duration;

use common::fixtures::{proxy, proxy_port};
use common::{Controller, reference_config, wait_for_all};
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_provider::reference::{MemoryProvider, ReferenceConfig};
use egressproxy_provider::server::ProviderServer;
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, PostParams};

/// Enough Proxies that reconciles queue behind each other.
const PROXIES: usize = 40;

#[tokio::test]
async fn a_burst_of_new_proxies_creates_each_instance_once() {
    let env = common::env_with_crd("own-writes").await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let provider = MemoryProvider::new(ReferenceConfig {
        provisioning_delay: Duration::ZERO,
        // Instances then answer at 127.0.0.1, where the stand-in proxy listens.
        address_identities: false,
        ..ReferenceConfig::default()
    });
    tokio::spawn(ProviderServer::new(provider.clone()).serve(listener, std::future::pending()));
    let _controller = Controller::start(&env, &reference_config(&endpoint, "30s"), "own-writes");

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

    let counts = provider.call_counts();
    assert_eq!(
        counts.get("CreateInstance").copied().unwrap_or(0),
        PROXIES as u64,
        "each of {PROXIES} new Proxies asks for its instance once: {counts:?}"
    );
}
