//! Running → Ready against the reference provider (no VM): how long the operator takes
//! from the provider reporting an instance RUNNING with an address to its Proxy's
//! `Ready`, against the target of 0.5 s plus one health check.
//!
//! 1. A kube-apiserver (the shared test one), the reference provider as a process
//!    (instances RUNNING [`PROVISIONING`] after Create, at 127.0.0.1), the operator
//!    binary as a process, and a TCP listener on 127.0.0.1 that answers every health
//!    check, as a VM's proxy would.
//! 2. The benchmark watches the provider itself (WatchInstances, the operator's
//!    selector) and the Proxies (a Kubernetes watch), and notes when each Proxy's
//!    instance is first RUNNING with an address and when the Proxy is first Ready.
//! 3. [`SAMPLES`] Proxies, applied one after another; each gap is printed, with the
//!    time of one health check (a TCP connect to the listener, as the operator's check
//!    does), and the run fails when any gap misses 0.5 s plus that check.
//! 4. The same again with a provider that does not declare the watch, so the operator
//!    polls (a provisioning instance every 0.5–2 s): its gaps are printed beside, as
//!    the baseline the watch improves on.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use egressproxy_integration::reference_provider::{ReferenceProvider, workspace_binary};
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::pb::{self, InstanceState, WatchEventType};
use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::runtime::{WatchStreamExt, watcher};

const CRD: &str = include_str!("../../../charts/egressproxy/files/crds.yaml");
/// Proxies measured.
const SAMPLES: usize = 10;
/// Create → RUNNING at the reference provider.
const PROVISIONING: &str = "3s";
/// The target's fixed part, beside one health check.
const TARGET: Duration = Duration::from_millis(500);
const WAIT: Duration = Duration::from_secs(60);

/// When each Proxy (by name) was first seen at a point of its life.
#[derive(Debug, Clone)]
struct Seen(Arc<tokio::sync::watch::Sender<HashMap<String, Instant>>>);

impl Default for Seen {
    fn default() -> Self {
        Seen(Arc::new(tokio::sync::watch::Sender::new(HashMap::new())))
    }
}

impl Seen {
    fn note(&self, name: &str) {
        self.0.send_if_modified(|seen| {
            if seen.contains_key(name) {
                return false;
            }
            seen.insert(name.to_owned(), Instant::now());
            true
        });
    }

    /// Waits until `name` was seen; when.
    async fn when(&self, name: &str) -> anyhow::Result<Instant> {
        let mut seen = self.0.subscribe();
        let found = tokio::time::timeout(WAIT, seen.wait_for(|seen| seen.contains_key(name)))
            .await
            .map_err(|_| anyhow::anyhow!("{name} not seen within {WAIT:?}"))??;
        Ok(found[name])
    }
}

/// Notes when each Proxy's instance is first RUNNING with an address.
async fn follow_provider(endpoint: String, cluster: String, running: Seen) -> anyhow::Result<()> {
    let mut client = connect_lazy(&ClientOptions::new(endpoint))?;
    let mut request = tonic::Request::new(pb::WatchInstancesRequest {
        tag_selector: [("egressproxy.dev/cluster".to_owned(), cluster)].into(),
        ..Default::default()
    });
    request.set_timeout(Duration::from_secs(3600));
    let mut stream = client.watch_instances(request).await?.into_inner();
    while let Some(event) = stream.message().await? {
        let Some(instance) = &event.instance else {
            continue;
        };
        if event.r#type() == WatchEventType::Updated
            && instance.state() == InstanceState::Running
            && !instance.addresses.is_empty()
            && let Some(name) = instance.tags.get("egressproxy.dev/name")
        {
            running.note(name);
        }
    }
    Ok(())
}

/// Notes when each Proxy is first Ready.
async fn follow_proxies(proxies: Api<DynamicObject>, ready: Seen) {
    let mut events = watcher(proxies, watcher::Config::default())
        .default_backoff()
        .applied_objects()
        .boxed();
    while let Some(Ok(proxy)) = events.next().await {
        if proxy.data["status"]["phase"] == "Ready"
            && let Some(name) = &proxy.metadata.name
        {
            ready.note(name);
        }
    }
}

/// One health check's time: a TCP connect to the stand-in proxy (median of 20).
async fn health_check_time(port: u16) -> Duration {
    let mut times = Vec::new();
    for _ in 0..20 {
        let started = Instant::now();
        let _ = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
        times.push(started.elapsed());
    }
    times.sort();
    times[times.len() / 2]
}

/// Accepts every connection on 127.0.0.1, as a VM's proxy would; its port.
async fn stand_in_proxy() -> anyhow::Result<u16> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            drop(stream);
        }
    });
    Ok(port)
}

fn proxy(name: &str, port: u16) -> anyhow::Result<DynamicObject> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": {
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "proxyPort": port,
            "healthCheck": {"periodSeconds": 60, "timeoutSeconds": 1},
        },
    }))?)
}

/// The gaps of [`SAMPLES`] Proxies against a reference provider started with
/// `provider_args`, and one health check's time.
async fn measure(provider_args: &[&str]) -> anyhow::Result<(Vec<Duration>, Duration)> {
    let env = KubeTestEnv::new("bench-running-ready").await?;
    apply_crds_yaml(&env.client, CRD).await?;
    let args = [&["--provisioning-delay", PROVISIONING], provider_args].concat();
    let provider = ReferenceProvider::start(&args)?;
    let cluster = format!("bench-{}", env.namespace);
    let dir = tempfile::tempdir()?;
    let providers = dir.path().join("providers.yaml");
    std::fs::write(
        &providers,
        format!(
            "providers:\n  reference:\n    endpoint: {}\n    callTimeout: 5s\n",
            provider.endpoint()
        ),
    )?;
    let mut operator = std::process::Command::new(workspace_binary("egressproxy-operator")?)
        .env("KUBECONFIG", env.apiserver().kubeconfig_path())
        .env("RUST_LOG", "warn")
        .args(["--cluster-name", &cluster])
        .args([
            "--namespace",
            &env.namespace,
            "--lease-namespace",
            &env.namespace,
        ])
        .arg("--providers")
        .arg(&providers)
        .args(["--http-listen", "127.0.0.1:0", "--gc-interval", "1h"])
        .spawn()?;
    let running = Seen::default();
    let ready = Seen::default();
    let provider_watch = tokio::spawn(follow_provider(
        provider.endpoint().to_owned(),
        cluster,
        running.clone(),
    ));
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("egressproxy.dev", "v1alpha1", "Proxy"),
        "proxies",
    );
    let proxies: Api<DynamicObject> =
        Api::namespaced_with(env.client.clone(), &env.namespace, &resource);
    let proxy_watch = tokio::spawn(follow_proxies(proxies.clone(), ready.clone()));
    let port = stand_in_proxy().await?;

    let mut gaps = Vec::new();
    let mut failure = None;
    for n in 0..SAMPLES {
        let name = format!("p{n}");
        let sample = async {
            proxies
                .create(&PostParams::default(), &proxy(&name, port)?)
                .await?;
            let at_running = running.when(&name).await?;
            let at_ready = ready.when(&name).await?;
            anyhow::Ok(at_ready.saturating_duration_since(at_running))
        };
        match sample.await {
            Ok(gap) => gaps.push(gap),
            Err(error) => {
                failure = Some(error);
                break;
            }
        }
    }
    let check = health_check_time(port).await;
    let _ = operator.kill();
    let _ = operator.wait();
    provider_watch.abort();
    proxy_watch.abort();
    match failure {
        Some(error) => Err(error),
        None => Ok((gaps, check)),
    }
}

/// Median and worst of `gaps`.
fn summary(gaps: &[Duration]) -> (Duration, Duration) {
    let mut sorted = gaps.to_vec();
    sorted.sort();
    (sorted[sorted.len() / 2], sorted[sorted.len() - 1])
}

/// Runs the measurement, with the watch and (for comparison) by polling alone;
/// whether every sample with the watch met the target.
pub(crate) async fn run() -> anyhow::Result<bool> {
    let (gaps, check) = measure(&[]).await?;
    // The same provider, but not declaring CAPABILITY_WATCH_INSTANCES: the operator
    // polls, as it does for a provider without the watch.
    let (polled, _) = measure(&["--misbehave", "watch-undeclared"]).await?;
    let limit = TARGET + check;
    println!(
        "provider RUNNING with an address -> Proxy Ready (reference provider, {SAMPLES} Proxies one after another)"
    );
    println!("  {:<6} {:>10} {:>10}", "", "watched", "polled");
    for (n, (gap, poll)) in gaps.iter().zip(&polled).enumerate() {
        println!(
            "  p{n:<5} {:>8.3} s {:>8.3} s",
            gap.as_secs_f64(),
            poll.as_secs_f64()
        );
    }
    let (median, worst) = summary(&gaps);
    let (polled_median, polled_worst) = summary(&polled);
    println!(
        "  watched: median {:.3} s, worst {:.3} s; polled: median {:.3} s, worst {:.3} s; one health check {:.4} s",
        median.as_secs_f64(),
        worst.as_secs_f64(),
        polled_median.as_secs_f64(),
        polled_worst.as_secs_f64(),
        check.as_secs_f64()
    );
    let met = worst <= limit;
    println!(
        "worst RUNNING -> Ready {:.3} s (target <= 0.5 s + one health check = {:.3} s): {}",
        worst.as_secs_f64(),
        limit.as_secs_f64(),
        if met { "met" } else { "MISSED" }
    );
    Ok(met)
}
