//! Benchmark: a ProxyPool of 3 on the real path loses a VM while a client sends
//! requests through it.
//!
//! 1. Starts the end-to-end stack and applies a pool of 3 (the sample's squid, health
//!    checked every [`PERIOD_SECONDS`] with one failure enough), then waits until its
//!    Service's EndpointSlices list 3 addresses.
//! 2. A client inside the hypervisor's network namespace sends requests, one after
//!    another, each to the next address the slices list (as kube-proxy would spread
//!    them), through the proxy to the stack's target server. A request whose attempt
//!    fails is retried at once on the next address, up to 3 attempts; it is lost when
//!    all fail.
//! 3. After a few seconds of steady traffic, `virsh destroy` one member's VM. A watch of
//!    the slices records every change with its time.
//! 4. Waits until the pool is back to 3 Ready members listed in its slices (the member's
//!    Proxy replaces the VM), then prints, beside their targets:
//!    - how long the lost member stayed listed (target: the health check's period
//!      times its failure threshold, plus 2 s);
//!    - whether the slices were ever empty (target: never);
//!    - requests lost by a client that retries (target: 0), and single attempts that
//!      failed (no target: the figure to know);
//!    - how long until 3 members were Ready again (no target: the replacement boots).
//!
//! Exits non-zero when a target is missed. Runs as root, like the end-to-end tests;
//! `cargo bench -p egressproxy-integration --bench pool_failover` (`make bench`).
//! Until the chart's in-cluster test drives it, the client sends to the addresses the
//! slices list rather than through kube-proxy and CoreDNS.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use egressproxy_integration::e2e::pool_view::follow_listed;
use egressproxy_integration::e2e::stack::{HOST, IMAGE, MACHINE_TYPE, PROVIDER, Stack};
use egressproxy_integration::e2e::timeline::Timeline;
use egressproxy_integration::netns::command_in;

const POOL: &str = "egress";
const REPLICAS: usize = 3;
const PERIOD_SECONDS: u64 = 2;
const FAILURE_THRESHOLD: u64 = 1;
/// How long the lost member may stay listed, beyond its health check's detection.
const SLACK: Duration = Duration::from_secs(2);
const WAIT: Duration = Duration::from_secs(900);
const STEADY: Duration = Duration::from_secs(5);
const ATTEMPTS: usize = 3;

fn manifest(stack: &Stack) -> String {
    format!(
        "apiVersion: egressproxy.dev/v1alpha1\n\
         kind: ProxyPool\n\
         metadata: {{name: {POOL}}}\n\
         spec:\n\
         \x20 replicas: {REPLICAS}\n\
         \x20 template:\n\
         \x20   spec:\n\
         \x20     provider: {PROVIDER}\n\
         \x20     placement: {{host: {HOST}, machineType: {MACHINE_TYPE}, image: {IMAGE}}}\n\
         \x20     service: {{enabled: false}}\n\
         \x20     healthCheck: {{type: Http, url: \"{url}\", periodSeconds: {PERIOD_SECONDS}, \
         timeoutSeconds: 1, failureThreshold: {FAILURE_THRESHOLD}}}\n",
        url = stack.target.url(),
    )
}

/// One attempt through the proxy at `address`.
fn attempt(netns: &str, address: &str, url: &str) -> bool {
    command_in(netns, "curl")
        .args(["-sS", "-o", "/dev/null", "--max-time", "2", "-x"])
        .arg(format!("http://{address}:3128"))
        .arg(url)
        .output()
        .is_ok_and(|out| out.status.success())
}

#[derive(Debug, Default)]
struct Traffic {
    requests: usize,
    lost: usize,
    failed_attempts: usize,
}

/// Sends requests until `stop` is set, each to the next listed address.
fn client(
    netns: String,
    url: String,
    listed: Timeline<Vec<String>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Traffic {
    let mut traffic = Traffic::default();
    let mut next = 0usize;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        traffic.requests += 1;
        let mut done = false;
        for _ in 0..ATTEMPTS {
            let addresses = listed.latest().unwrap_or_default();
            if addresses.is_empty() {
                traffic.failed_attempts += 1;
                continue;
            }
            let address = &addresses[next % addresses.len()];
            next += 1;
            if attempt(&netns, address, &url) {
                done = true;
                break;
            }
            traffic.failed_attempts += 1;
        }
        if !done {
            traffic.lost += 1;
        }
    }
    traffic
}

async fn run() -> anyhow::Result<bool> {
    let stack = Stack::start("bench-failover").await?;
    let listed = follow_listed(&stack, POOL);
    let started = Instant::now();
    stack.kubectl_apply(&manifest(&stack))?;
    let (_, before) = listed
        .first_after(
            &format!("the pool's slices to list {REPLICAS}"),
            WAIT,
            started,
            |a| a.len() == REPLICAS,
        )
        .await?;
    println!(
        "pool of {REPLICAS} Ready in {:.1} s: {before:?}",
        started.elapsed().as_secs_f64()
    );

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = tokio::task::spawn_blocking({
        let (netns, url, listed, stop) = (
            stack.netns().to_owned(),
            stack.target.url(),
            listed.clone(),
            stop.clone(),
        );
        move || client(netns, url, listed, stop)
    });
    tokio::time::sleep(STEADY).await;

    // The member to lose: the first domain, by its guest agent's address.
    let domain = stack
        .domains()?
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("no domain"))?;
    let lost = stack
        .virsh(&["domifaddr", &domain, "--source", "agent"])?
        .lines()
        .filter(|l| l.contains("ipv4"))
        .filter_map(|l| l.split_whitespace().nth(3))
        .map(|cidr| cidr.split('/').next().unwrap_or_default().to_owned())
        .find(|ip| before.contains(ip))
        .ok_or_else(|| anyhow::anyhow!("{domain}'s address is not among {before:?}"))?;
    let destroyed = Instant::now();
    stack.virsh(&["destroy", &domain])?;
    println!("destroyed {domain} ({lost})");

    let (back_at, _) = listed
        .first_after(
            &format!("the pool's slices to list {REPLICAS} again"),
            WAIT,
            destroyed,
            // The member's replacement VM keeps its address: count, not addresses.
            |a| a.len() == REPLICAS,
        )
        .await?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let traffic = traffic.await?;

    let changes = listed.since(destroyed);
    let left = changes
        .iter()
        .find(|(_, addresses)| !addresses.contains(&lost))
        .map(|(at, _)| at.duration_since(destroyed));
    let ever_empty = changes.iter().any(|(_, addresses)| addresses.is_empty());
    let limit = Duration::from_secs(PERIOD_SECONDS * FAILURE_THRESHOLD) + SLACK;

    let left_ok = left.is_some_and(|d| d <= limit);
    println!(
        "pool failover, a pool of {REPLICAS} on the real path (TCG guests), one VM destroyed:"
    );
    println!(
        "  lost member left the slices after   {:>6}   target <= {:.1} s  {}",
        left.map_or("never".to_owned(), |d| format!("{:.2} s", d.as_secs_f64())),
        limit.as_secs_f64(),
        if left_ok { "ok" } else { "MISSED" }
    );
    println!(
        "  slices ever empty                   {:>6}   target never    {}",
        if ever_empty { "yes" } else { "no" },
        if ever_empty { "MISSED" } else { "ok" }
    );
    println!(
        "  requests lost (retrying client)     {:>6}   target 0        {}  of {} requests",
        traffic.lost,
        if traffic.lost == 0 { "ok" } else { "MISSED" },
        traffic.requests
    );
    println!(
        "  single attempts that failed         {:>6}",
        traffic.failed_attempts
    );
    println!(
        "  back to {REPLICAS} Ready members after     {:>6.1} s",
        back_at.duration_since(destroyed).as_secs_f64()
    );
    Ok(left_ok && !ever_empty && traffic.lost == 0)
}

fn main() -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    match runtime.block_on(run()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("pool_failover: {error:#}");
            ExitCode::FAILURE
        }
    }
}
