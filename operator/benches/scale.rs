//! Scale benchmark: 500 Proxies against the reference provider (zero provisioning
//! delay), one operator process, a real kube-apiserver.
//!
//! Prints, beside each target: time until every Proxy is Ready, apiserver requests
//! per Proxy (from the apiserver's own `apiserver_request_total`), provider calls per
//! Proxy (from the reference provider's call counts), the operator's peak RSS, and the
//! status writes in a steady period (target: none).
//!
//! Run: `make bench` (or `cargo build --release --workspace --bins && cargo bench -p
//! egressproxy-operator --bench scale`). `SCALE_PROXIES` changes the count.

mod support;

use std::time::{Duration, Instant};

use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, ListParams, PostParams};
use support::{Stack, sum_metric};

const TARGET_READY: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let count: usize = std::env::var("SCALE_PROXIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let stack = Stack::start("scale").await?;
    let (env, port) = (&stack.env, stack.proxy_port);

    let requests_before = apiserver_requests(&env.client).await?;
    let proxies: Api<Proxy> = env.namespaced();
    let started = Instant::now();
    futures::stream::iter(0..count)
        .map(|i| {
            let proxies = proxies.clone();
            async move {
                proxies
                    .create(
                        &PostParams::default(),
                        &support::proxy(&format!("proxy-{i:04}"), port),
                    )
                    .await
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    let created = started.elapsed();
    let ready = loop {
        let list = proxies.list(&ListParams::default()).await?;
        let ready = list
            .items
            .iter()
            .filter(|p| p.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready))
            .count();
        if ready == count {
            break started.elapsed();
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(300),
            "only {ready} of {count} Ready after 300 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let requests_at_ready = apiserver_requests(&env.client).await? - requests_before;
    let mut control = ControlServiceClient::connect(stack.provider.endpoint().to_owned()).await?;
    let calls = control
        .get_call_counts(control::GetCallCountsRequest {})
        .await?
        .into_inner()
        .counts;
    let writes_at_ready = stack.metric("egressproxy_status_writes_total").await?;
    // Steady state is a span of time by definition: 10 s is five health periods of
    // nothing to write.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let steady_writes = stack.metric("egressproxy_status_writes_total").await? - writes_at_ready;
    let peak_rss_kib = stack.memory_kib("VmHWM:")?;
    stack.stop();

    let per_proxy = |n: f64| n / count as f64;
    let provider_calls: u64 = calls.values().sum();
    println!(
        "scale benchmark: {count} Proxies, reference provider with zero provisioning delay, 2 cores"
    );
    println!("{:<44} {:>12}   baseline / target", "figure", "measured");
    println!(
        "{:<44} {:>10.1} s   target <= {} s",
        "time until all Ready",
        ready.as_secs_f64(),
        TARGET_READY.as_secs()
    );
    println!(
        "{:<44} {:>10.1} s   (client side, 32 in flight)",
        "time to create the Proxies",
        created.as_secs_f64()
    );
    println!(
        "{:<44} {:>12.1}   (all clients, until all Ready)",
        "apiserver requests per Proxy",
        per_proxy(requests_at_ready)
    );
    println!(
        "{:<44} {:>12.1}   minimum 2 (Create, Get)",
        "provider calls per Proxy",
        per_proxy(provider_calls as f64)
    );
    for (method, n) in &calls {
        println!("  {:<42} {:>12.2}", method, per_proxy(*n as f64));
    }
    println!(
        "{:<44} {:>12}   target 0",
        "status writes in 10 s of steady state", steady_writes
    );
    println!(
        "{:<44} {:>9.1} MiB",
        "operator peak RSS",
        peak_rss_kib as f64 / 1024.0
    );
    anyhow::ensure!(ready <= TARGET_READY, "missed the {TARGET_READY:?} target");
    anyhow::ensure!(
        steady_writes == 0.0,
        "{steady_writes} status writes at steady state (target 0)"
    );
    Ok(())
}

/// Sum of `apiserver_request_total` over every verb, resource and client.
async fn apiserver_requests(client: &kube::Client) -> anyhow::Result<f64> {
    let text = client
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    Ok(sum_metric(&text, "apiserver_request_total"))
}
