//! Churn with restarts: waves of Proxies created, brought to Ready and deleted while the
//! operator and the reference provider are SIGKILLed and restarted at random moments
//! (a real kube-apiserver; the provider keeps its instances in memory, so a provider
//! restart makes every instance vanish, as a rebuilt hypervisor would).
//!
//! Each wave waits until every Proxy of the wave is Ready, then deletes them all and
//! waits until they are gone: every Proxy was Ready, then gone. At the end it prints a
//! table and exits non-zero when a target is missed:
//! - 0 instances left at the provider after any wave (none leaked by a Create the
//!   operator lost track of when it was killed), counted before the next restart;
//! - every per-Proxy map and phase gauge of the operator back to 0;
//! - the operator's RSS after the last wave within 25% of the same process's RSS after
//!   its first wave (a restart resets it, so the comparison is within one process: the
//!   one alive at the end, measured after its first full wave).
//!
//! `CHURN_RESTART_WAVES` (default 10) waves of `CHURN_RESTART_WAVE_SIZE` (default 100)
//! Proxies, 1,000 in all; `CHURN_SEED` fixes the random moments (printed, so a failing
//! run can be repeated). Run: `cargo build --release --workspace --bins && cargo bench
//! -p egressproxy-operator --bench churn_restarts` (part of `make bench`).

mod support;

use std::time::{Duration, Instant};

use egressproxy_integration::chaos::Xorshift;
use egressproxy_operator::crd::Proxy;
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::pb;
use kube::api::{Api, DeleteParams, ListParams};
use support::Stack;

const WAVE_TIMEOUT: Duration = Duration::from_secs(600);
const RSS_WITHIN: f64 = 0.25;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What happens during a wave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    Operator,
    Provider,
    Both,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let waves = env_number("CHURN_RESTART_WAVES", 10).max(2);
    let size = env_number("CHURN_RESTART_WAVE_SIZE", 100) as usize;
    let mut random = Xorshift::from_env("CHURN_SEED");
    let seed = random.seed();
    let mut stack = Stack::start("churn-restarts").await?;
    let proxies: Api<Proxy> = stack.env.namespaced();
    println!(
        "churn with restarts: {waves} waves of {size} Proxies ({} in all), seed {seed}",
        waves * size as u64
    );
    println!(
        "{:>5} {:>9} {:>10} {:>9}   per-Proxy maps after the wave",
        "wave", "injected", "wave s", "RSS MiB"
    );
    let mut restarts = (0, 0);
    let mut rss_first_wave_of_process = None;
    let mut rss_end = 0.0;
    let mut leftovers = Vec::new();
    let mut instances_leaked = 0;
    for wave in 1..=waves {
        // The last wave runs without a fault, so the process alive at the end has a
        // baseline of its own before it.
        let fault = match if wave == waves { 0 } else { random.below(4) } {
            0 => Fault::None,
            1 => Fault::Operator,
            2 => Fault::Provider,
            _ => Fault::Both,
        };
        // The moment within the wave: while Proxies are created, or while they go.
        let during_delete = random.below(2) == 1;
        let started = Instant::now();
        support::create_wave(&proxies, &format!("r{wave}"), size, stack.proxy_port).await?;
        if !during_delete {
            inject(&mut stack, fault, &mut restarts)?;
        }
        support::wait_all_ready(&proxies, wave, size, WAVE_TIMEOUT).await?;
        proxies
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await?;
        if during_delete {
            inject(&mut stack, fault, &mut restarts)?;
        }
        support::wait_all_gone(&proxies, wave, WAVE_TIMEOUT).await?;
        // The provider keeps instances in memory: count them before a restart wipes them.
        let left = instances_left(&stack).await?;
        instances_leaked += left;
        let maps = settled_maps(&stack).await?;
        let rss = stack.memory_kib("VmRSS:")? as f64 / 1024.0;
        if matches!(fault, Fault::Operator | Fault::Both) {
            // A new process: its first full wave is this one.
            rss_first_wave_of_process = Some(rss);
        }
        rss_first_wave_of_process.get_or_insert(rss);
        rss_end = rss;
        let injected = match (fault, during_delete) {
            (Fault::None, _) => "-".to_owned(),
            (fault, true) => format!("{fault:?} (delete)"),
            (fault, false) => format!("{fault:?} (create)"),
        };
        println!(
            "{wave:>5} {injected:>9} {:>10.1} {rss:>9.1}   {}",
            started.elapsed().as_secs_f64(),
            support::describe(&maps)
        );
        leftovers = maps.into_iter().filter(|(_, n)| *n != 0).collect();
    }
    let instances = instances_leaked;
    stack.stop();

    let rss_reference = rss_first_wave_of_process.unwrap_or(rss_end);
    println!();
    println!("{:<44} {:>12}   target", "figure", "measured");
    println!(
        "{:<44} {:>12}",
        "restarts (operator, provider)",
        format!("{}, {}", restarts.0, restarts.1)
    );
    println!(
        "{:<44} {:>12}   0",
        "instances left at the provider", instances
    );
    println!(
        "{:<44} {:>12}   all 0",
        "per-Proxy entries left after the last wave",
        if leftovers.is_empty() {
            "0".to_owned()
        } else {
            support::describe(&leftovers)
        }
    );
    println!(
        "{:<44} {:>8.1} MiB   within {:.0}% of {rss_reference:.1} MiB (its process after its first wave)",
        "operator RSS after the last wave",
        rss_end,
        RSS_WITHIN * 100.0
    );
    anyhow::ensure!(
        instances == 0,
        "{instances} instances leaked at the provider"
    );
    anyhow::ensure!(
        leftovers.is_empty(),
        "per-Proxy entries outlived their Proxies: {leftovers:?}"
    );
    anyhow::ensure!(
        rss_end <= rss_reference * (1.0 + RSS_WITHIN),
        "RSS grew from {rss_reference:.1} MiB to {rss_end:.1} MiB"
    );
    Ok(())
}

fn inject(stack: &mut Stack, fault: Fault, restarts: &mut (u32, u32)) -> anyhow::Result<()> {
    if matches!(fault, Fault::Operator | Fault::Both) {
        stack.restart_operator()?;
        restarts.0 += 1;
    }
    if matches!(fault, Fault::Provider | Fault::Both) {
        stack.restart_provider()?;
        restarts.1 += 1;
    }
    Ok(())
}

/// Instances the current provider process still holds (every page).
async fn instances_left(stack: &Stack) -> anyhow::Result<usize> {
    let mut client = connect_lazy(&ClientOptions::new(stack.provider.endpoint()))?;
    let mut count = 0;
    let mut page_token = String::new();
    loop {
        let page = client
            .list_instances(pb::ListInstancesRequest {
                page_token: page_token.clone(),
                ..pb::ListInstancesRequest::default()
            })
            .await?
            .into_inner();
        count += page.instances.len();
        if page.next_page_token.is_empty() {
            return Ok(count);
        }
        page_token = page.next_page_token;
    }
}

/// The per-Proxy map sizes and phase gauges, once they stop changing (the Delete
/// watch events of the last Proxies may still be on their way).
async fn settled_maps(stack: &Stack) -> anyhow::Result<Vec<(String, i64)>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // A restarted operator may not listen yet.
        let text = match stack.metrics().await {
            Ok(text) => text,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Err(error) => return Err(error),
        };
        let maps = support::samples(&text, "egressproxy_tracked_proxies")
            .into_iter()
            .chain(support::samples(&text, "egressproxy_proxies"))
            .collect::<Vec<_>>();
        if maps.iter().all(|(_, n)| *n == 0) || Instant::now() > deadline {
            return Ok(maps);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
