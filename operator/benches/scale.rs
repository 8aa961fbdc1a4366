//! Scale benchmark: 5,000 Proxies applied at once against the reference provider (zero
//! provisioning delay), one operator process, a real kube-apiserver, then all deleted.
//!
//! Prints, beside each target, and exits non-zero when one is missed:
//! - the time from the first create until every Proxy is Ready (target: 60 s);
//! - the time until every Proxy's Service and EndpointSlice are written too (no target:
//!   they follow in a queue of their own, bounded so that they do not hold back
//!   readiness);
//! - the operator's peak RSS (target: 150 MiB);
//! - the apiserver requests per Proxy until then (all clients, from the apiserver's own
//!   `apiserver_request_total`), by kind with the apiserver's time over each, and the
//!   provider calls per Proxy; the apiserver and etcd's CPU time, and each process's;
//! - the writes to the apiserver in a steady period afterwards, longer than a health
//!   check period so every Proxy is checked again (target: none but the leader Lease's
//!   renewals, which are printed apart);
//! - the operator's RSS once every Proxy is deleted and it has handed freed memory back
//!   (`egressproxy_allocator_trims_total`), beside its RSS before the first was created
//!   (target: within 25% of the growth of its peak over that baseline).
//!
//! Run: `make bench` (or `cargo build --release --workspace --bins && cargo bench -p
//! egressproxy-operator --bench scale`). `SCALE_PROXIES` changes the count.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use egressproxy_operator::crd::Proxy;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use support::Stack;

const TARGET_READY: Duration = Duration::from_secs(60);
const TARGET_PEAK_RSS_MIB: f64 = 150.0;
/// How much of its growth under load the operator's RSS may keep once every Proxy is
/// gone.
const TARGET_RSS_KEPT: f64 = 0.25;
/// Longer than the default health check period (30 s): every Proxy is reconciled
/// again at least once in it.
const STEADY: Duration = Duration::from_secs(35);
const GIVE_UP: Duration = Duration::from_secs(600);
/// Tries of a request that meets a dropped connection.
const ATTEMPTS: usize = 3;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let count: usize = std::env::var("SCALE_PROXIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5000);
    // The reference provider's hosts hold 1,000 instances unless told otherwise.
    let room = format!("local={count}");
    let stack = Stack::start_with("scale", &["--max-instances", &room]).await?;
    let (env, port) = (&stack.env, stack.proxy_port);
    let proxies: Api<Proxy> = env.namespaced();
    // The operator is up once it serves its metrics as leader with its first list done.
    support::watch_until(&proxies, "the first list", GIVE_UP, |_| true).await?;
    wait_for_leader(&stack).await?;
    let rss_baseline = stack.memory_kib("VmRSS:")? as f64 / 1024.0;

    let requests_before = apiserver_requests(&env.client).await?;
    let seconds_before = apiserver_seconds(&env.client).await?;
    let cpu_before = stack.cpu_by_process()?;
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
    support::watch_until(&proxies, "every Proxy Ready", GIVE_UP, |all| {
        all.len() == count && support::all_ready(all)
    })
    .await?;
    let ready = started.elapsed();
    let cpu_until_ready = stack.cpu_by_process()?;
    eprintln!(
        "all {count} Ready after {:.1} s; now {} s of steady state",
        ready.as_secs_f64(),
        STEADY.as_secs()
    );
    let requests_at_ready = total(&difference(
        &apiserver_requests(&env.client).await?,
        &requests_before,
    ));
    let mut control = ControlServiceClient::connect(stack.provider.endpoint().to_owned()).await?;
    let calls = control
        .get_call_counts(control::GetCallCountsRequest {})
        .await?
        .into_inner()
        .counts;

    // The Services and EndpointSlices follow the Proxies' status in a queue of their
    // own: in a burst, many are still to be written when the last Proxy is Ready.
    wait_until_published::<k8s_openapi::api::core::v1::Service>(env, count).await?;
    wait_until_published::<k8s_openapi::api::discovery::v1::EndpointSlice>(env, count).await?;
    let published = started.elapsed();
    eprintln!(
        "every Service and EndpointSlice written after {:.1} s",
        published.as_secs_f64()
    );
    let requests_by_kind = difference(&apiserver_requests(&env.client).await?, &requests_before);
    let requests_at_published = total(&requests_by_kind);
    let seconds_by_kind = difference(&apiserver_seconds(&env.client).await?, &seconds_before);

    let requests_before_steady = apiserver_requests(&env.client).await?;
    let writes_before = apiserver_writes(&env.client).await?;
    let status_writes_before = stack.metric("egressproxy_status_writes_total").await?;
    let reconciles_before = stack.metric("egressproxy_reconciles_total").await?;
    // Steady state is a span of time by definition.
    tokio::time::sleep(STEADY).await;
    let steady_status_writes =
        stack.metric("egressproxy_status_writes_total").await? - status_writes_before;
    let steady_reconciles = stack.metric("egressproxy_reconciles_total").await? - reconciles_before;
    let steady_writes = difference(&apiserver_writes(&env.client).await?, &writes_before);
    let steady_reads: f64 = difference(
        &apiserver_requests(&env.client).await?,
        &requests_before_steady,
    )
    .iter()
    .filter(|(key, _)| key.starts_with("GET ") || key.starts_with("LIST "))
    .map(|(_, n)| n)
    .sum::<f64>()
        + 0.0;
    let peak_rss = stack.memory_kib("VmHWM:")? as f64 / 1024.0;

    let trims_before = stack.metric("egressproxy_allocator_trims_total").await?;
    let deleting = Instant::now();
    let (delete, all) = (DeleteParams::default(), ListParams::default());
    retrying_dropped_connections(|| proxies.delete_collection(&delete, &all)).await?;
    support::watch_until(&proxies, "every Proxy deleted", GIVE_UP, |all| {
        all.is_empty()
    })
    .await?;
    let deleted = deleting.elapsed();
    wait_for_trim(&stack, trims_before).await?;
    let rss_after = settled_rss(&stack).await?;
    stack.stop();

    let per_proxy = |n: f64| n / count as f64;
    let provider_calls: u64 = calls.values().sum();
    let lease_renewals = steady_writes.get("leases").copied().unwrap_or(0.0);
    let other_writes: BTreeMap<&String, &f64> = steady_writes
        .iter()
        .filter(|(resource, n)| resource.as_str() != "leases" && **n > 0.0)
        .collect();
    // Plus 0.0: an empty sum is -0.0, which prints as "-0".
    let steady_other_writes: f64 = other_writes.values().copied().sum::<f64>() + 0.0;
    let rss_allowed = rss_baseline + (peak_rss - rss_baseline).max(0.0) * TARGET_RSS_KEPT;

    println!(
        "scale benchmark: {count} Proxies, reference provider with zero provisioning delay, 2 cores"
    );
    println!("{:<46} {:>12}   baseline / target", "figure", "measured");
    println!(
        "{:<46} {:>10.1} s   target <= {} s",
        "time until all Ready",
        ready.as_secs_f64(),
        TARGET_READY.as_secs()
    );
    println!(
        "{:<46} {:>10.1} s   (client side, 32 in flight)",
        "time to create the Proxies",
        created.as_secs_f64()
    );
    println!(
        "{:<46} {:>10.1} s   (no target)",
        "time until every Service and slice written",
        published.as_secs_f64()
    );
    println!(
        "{:<46} {:>12.1}   (all clients, until all Ready)",
        "apiserver requests per Proxy",
        per_proxy(requests_at_ready)
    );
    println!(
        "{:<46} {:>12.1}   (until every Service and slice written)",
        "apiserver requests per Proxy",
        per_proxy(requests_at_published)
    );
    // Where they went: the kinds that make up at least one request in twenty Proxies,
    // with the time the apiserver took over each (queueing included).
    for (kind, n) in &requests_by_kind {
        if per_proxy(*n) >= 0.05 {
            let seconds = seconds_by_kind.get(kind).copied().unwrap_or(0.0);
            println!(
                "  {:<44} {:>12.2}   {:>6.1} ms each",
                kind,
                per_proxy(*n),
                1000.0 * seconds / n
            );
        }
    }
    println!(
        "{:<46} {:>10.1} s   ({:.1} s on 2 cores until all Ready)",
        "CPU time until all Ready",
        total_cpu(&cpu_until_ready) - total_cpu(&cpu_before),
        2.0 * ready.as_secs_f64()
    );
    for ((process, after), (_, before)) in cpu_until_ready.iter().zip(&cpu_before) {
        println!("  {:<44} {:>10.1} s", process, after - before);
    }
    println!(
        "{:<46} {:>12.1}   minimum 2 (Create, Get)",
        "provider calls per Proxy",
        per_proxy(provider_calls as f64)
    );
    for (method, n) in &calls {
        println!("  {:<44} {:>12.2}", method, per_proxy(*n as f64));
    }
    println!(
        "{:<46} {:>12}   (all clients, the apiserver's own included; no target)",
        format!("apiserver reads in {} s of steady state", STEADY.as_secs()),
        steady_reads
    );
    println!(
        "{:<46} {:>12}   target 0 (lease renewals apart: {lease_renewals})",
        format!("apiserver writes in {} s of steady state", STEADY.as_secs()),
        steady_other_writes
    );
    for (resource, n) in &other_writes {
        println!("  {:<44} {:>12}", resource, n);
    }
    println!(
        "{:<46} {:>12}   ({steady_reconciles} reconciles)",
        "  of them status writes", steady_status_writes
    );
    println!(
        "{:<46} {:>9.1} MiB   target <= {TARGET_PEAK_RSS_MIB} MiB",
        "operator peak RSS", peak_rss
    );
    println!(
        "{:<46} {:>10.1} s",
        "time until all deleted",
        deleted.as_secs_f64()
    );
    println!(
        "{:<46} {:>9.1} MiB   baseline {rss_baseline:.1} MiB before the first Proxy; target <= {rss_allowed:.1} MiB",
        "operator RSS after all deleted", rss_after
    );
    anyhow::ensure!(ready <= TARGET_READY, "missed the {TARGET_READY:?} target");
    anyhow::ensure!(
        peak_rss <= TARGET_PEAK_RSS_MIB,
        "peak RSS {peak_rss:.1} MiB over {TARGET_PEAK_RSS_MIB} MiB"
    );
    anyhow::ensure!(
        steady_other_writes == 0.0,
        "{steady_other_writes} writes at steady state (target 0): {other_writes:?}"
    );
    anyhow::ensure!(
        rss_after <= rss_allowed,
        "RSS {rss_after:.1} MiB after all were deleted, over {rss_allowed:.1} MiB"
    );
    Ok(())
}

/// Waits until the namespace holds `count` objects of kind `K` (the bench's namespace
/// holds only the operator's: one per Proxy), counted by a list of one item and the
/// apiserver's count of the rest (which it gives only for a list without a selector;
/// without it, by a list of them all).
async fn wait_until_published<K>(
    env: &egressproxy_integration::kube_env::KubeTestEnv,
    count: usize,
) -> anyhow::Result<()>
where
    K: kube::Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = env.namespaced();
    let (mine, all) = (ListParams::default().limit(1), ListParams::default());
    let deadline = Instant::now() + GIVE_UP;
    loop {
        let page = retrying_dropped_connections(|| api.list_metadata(&mine)).await?;
        let listed = match page.metadata.remaining_item_count {
            Some(rest) => page.items.len() + rest as usize,
            None if page.metadata.continue_.is_some() => {
                retrying_dropped_connections(|| api.list_metadata(&all))
                    .await?
                    .items
                    .len()
            }
            None => page.items.len(),
        };
        if listed >= count {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {listed} of {count} {} written",
            K::kind(&())
        );
        // A count across thousands of objects: a watch would carry every object.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits until the operator says it leads (it then runs its controller).
async fn wait_for_leader(stack: &Stack) -> anyhow::Result<()> {
    let deadline = Instant::now() + GIVE_UP;
    loop {
        if let Ok(1.0) = stack.metric("egressproxy_is_leader").await {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the operator never led");
        // Its HTTP endpoint and metric are all there is to look at.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the operator has handed freed memory back to the system since
/// `trims_before` and no forgotten Proxy awaits a trim (it trims once Proxies stop being
/// forgotten for a moment).
async fn wait_for_trim(stack: &Stack, trims_before: f64) -> anyhow::Result<()> {
    let deadline = Instant::now() + GIVE_UP;
    loop {
        let trims = stack.metric("egressproxy_allocator_trims_total").await?;
        let pending = stack.metric("egressproxy_allocator_trim_pending").await?;
        if trims > trims_before && pending == 0.0 {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the operator never trimmed its allocator"
        );
        // Its metrics are all there is to look at.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The operator's RSS once it stops falling (the memory sweep and the allocator give
/// memory back over a few seconds).
async fn settled_rss(stack: &Stack) -> anyhow::Result<f64> {
    let mut last = stack.memory_kib("VmRSS:")?;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = stack.memory_kib("VmRSS:")?;
        if now >= last {
            return Ok(now as f64 / 1024.0);
        }
        last = now;
    }
    Ok(last as f64 / 1024.0)
}

/// `apiserver_request_total` by verb and resource (`proxies/status` for a subresource).
async fn apiserver_requests(client: &kube::Client) -> anyhow::Result<BTreeMap<String, f64>> {
    apiserver_by_kind(client, "apiserver_request_total{").await
}

/// The seconds the apiserver spent serving requests, by verb and resource (from
/// `apiserver_request_duration_seconds`; under load they include time queued).
async fn apiserver_seconds(client: &kube::Client) -> anyhow::Result<BTreeMap<String, f64>> {
    apiserver_by_kind(client, "apiserver_request_duration_seconds_sum{").await
}

/// The apiserver's series named by `prefix` (the metric's name and its opening brace),
/// summed by verb and resource.
async fn apiserver_by_kind(
    client: &kube::Client,
    prefix: &str,
) -> anyhow::Result<BTreeMap<String, f64>> {
    let text = retrying_dropped_connections(|| {
        client.request_text(
            http::Request::get("/metrics")
                .body(Vec::new())
                .expect("a valid request"),
        )
    })
    .await?;
    let mut requests = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(prefix) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|pair| pair.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        let mut key = format!("{} {}", label("verb"), label("resource"));
        if !label("subresource").is_empty() {
            key = format!("{key}/{}", label("subresource"));
        }
        *requests.entry(key).or_default() += value.parse::<f64>().unwrap_or(0.0);
    }
    Ok(requests)
}

/// Write requests (create, update, patch, apply, delete) by resource.
async fn apiserver_writes(client: &kube::Client) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut writes = BTreeMap::new();
    for (key, n) in apiserver_requests(client).await? {
        let (verb, resource) = key.split_once(' ').unwrap_or((&key, ""));
        if [
            "POST",
            "PUT",
            "PATCH",
            "APPLY",
            "DELETE",
            "DELETECOLLECTION",
        ]
        .contains(&verb)
        {
            *writes.entry(resource.to_owned()).or_default() += n;
        }
    }
    Ok(writes)
}

fn total_cpu(by_process: &[(&str, f64)]) -> f64 {
    by_process.iter().map(|(_, seconds)| seconds).sum()
}

fn total(requests: &BTreeMap<String, f64>) -> f64 {
    requests.values().sum()
}

fn difference(
    after: &BTreeMap<String, f64>,
    before: &BTreeMap<String, f64>,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(key, n)| (key.clone(), n - before.get(key).copied().unwrap_or(0.0)))
        .collect()
}

/// Runs `call` again once when the connection it was sent on had been dropped: after
/// the steady period the client's pooled connection may have been closed by the
/// apiserver while idle, which kube does not retry.
async fn retrying_dropped_connections<T, F, Fut>(call: F) -> Result<T, kube::Error>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    // The apiserver may close a kept-alive connection just as it is reused; each
    // attempt takes another from the pool, or opens one.
    for _ in 1..ATTEMPTS {
        match call().await {
            Err(kube::Error::Service(error)) => {
                eprintln!("retrying after a dropped connection: {error:?}");
            }
            outcome => return outcome,
        }
    }
    call().await
}
