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

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use egressproxy_integration::reference_provider::{ReferenceProvider, workspace_binary};
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, ListParams, PostParams};

const CRD: &str = include_str!("../../charts/egressproxy/files/proxies.egressproxy.dev.yaml");
const TARGET_READY: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let count: usize = std::env::var("SCALE_PROXIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let env = KubeTestEnv::new("scale").await?;
    apply_crds_yaml(&env.client, CRD).await?;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "0s"])?;
    let providers = tempfile::NamedTempFile::new()?;
    std::fs::write(
        providers.path(),
        format!(
            "providers:\n  reference:\n    endpoint: {}\n",
            provider.endpoint()
        ),
    )?;
    let http = std::net::TcpListener::bind("127.0.0.1:0")?;
    let metrics_address = http.local_addr()?;
    drop(http);
    let mut operator = Command::new(workspace_binary("egressproxy-operator")?)
        .env("KUBECONFIG", env.apiserver().kubeconfig_path())
        .env("RUST_LOG", "warn")
        .args([
            "--cluster-name",
            "scale",
            "--namespace",
            &env.namespace,
            "--lease-namespace",
            &env.namespace,
        ])
        .arg("--providers")
        .arg(providers.path())
        .args([
            "--http-listen",
            &metrics_address.to_string(),
            "--gc-interval",
            "1h",
        ])
        .stdin(Stdio::null())
        .spawn()?;

    // Every instance reports 127.0.0.1: one listener answers every health check.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            drop(stream);
        }
    });

    let requests_before = apiserver_requests(&env.client).await?;
    let proxies: Api<Proxy> = env.namespaced();
    let started = Instant::now();
    futures::stream::iter(0..count)
        .map(|i| {
            let proxies = proxies.clone();
            async move {
                proxies
                    .create(&PostParams::default(), &proxy(i, port))
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
    let mut control = ControlServiceClient::connect(provider.endpoint().to_owned()).await?;
    let calls = control
        .get_call_counts(control::GetCallCountsRequest {})
        .await?
        .into_inner()
        .counts;
    let writes_at_ready =
        operator_metric(metrics_address, "egressproxy_status_writes_total").await?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let steady_writes = operator_metric(metrics_address, "egressproxy_status_writes_total").await?
        - writes_at_ready;
    let peak_rss_kib = peak_rss_kib(operator.id())?;
    let _ = operator.kill();
    let _ = operator.wait();

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
    Ok(())
}

fn proxy(i: usize, port: u16) -> Proxy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": format!("proxy-{i:04}")},
        "spec": {
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "proxyPort": port,
        },
    }))
    .expect("valid Proxy")
}

/// Sum of `apiserver_request_total` over every verb, resource and client.
async fn apiserver_requests(client: &kube::Client) -> anyhow::Result<f64> {
    let text = client
        .request_text(http::Request::get("/metrics").body(Vec::new())?)
        .await?;
    Ok(sum_metric(&text, "apiserver_request_total"))
}

async fn operator_metric(address: std::net::SocketAddr, name: &str) -> anyhow::Result<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n")
        .await?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await?;
    Ok(sum_metric(&text, name))
}

fn sum_metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn peak_rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .ok_or_else(|| anyhow::anyhow!("no VmHWM"))?;
    Ok(line.split_whitespace().nth(1).unwrap_or("0").parse()?)
}
