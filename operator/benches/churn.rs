//! Churn benchmark: waves of Proxies created, brought to Ready and deleted against
//! one operator process (reference provider with zero provisioning delay, a real
//! kube-apiserver), to show that nothing the operator keeps per Proxy outlives it.
//!
//! Prints per wave the operator's CPU time, its RSS and the per-Proxy map sizes it
//! exports (`egressproxy_tracked_proxies{map}`, `egressproxy_proxies{phase}`), then
//! the verdicts. Exits non-zero when a target is missed:
//! - after the last wave every per-Proxy map and phase gauge is back to its baseline
//!   (0: no Proxy exists);
//! - CPU per wave is flat: the median over the last third of the waves is within 10%
//!   of the median over the first third (without wave 1, which warms caches and
//!   connections); medians of many waves, since other processes share the cores;
//! - RSS at the end is within 10% of its level after half the waves (once the
//!   allocator's arenas and the caches that keep recent Proxies have filled).
//!
//! The long form is 10,000 create/delete cycles: `CHURN_WAVES=50` of
//! `CHURN_WAVE_SIZE=200` (the defaults). Run: `cargo build --release --workspace --bins
//! && cargo bench -p egressproxy-operator --bench churn` (part of `make bench`).
//!
//! `make test` (so CI) runs a short form on every change, on the debug build: 7 waves
//! of 30 (`make churn-short`). It catches a per-Proxy entry that outlives its Proxy
//! exactly; with medians of two waves, its CPU and RSS checks allow
//! `CHURN_FLAT_WITHIN=0.25` (default 0.10), enough to catch a leak that grows with
//! every wave, not a slow one.

mod support;

use std::time::{Duration, Instant};

use egressproxy_operator::crd::Proxy;
use kube::api::{Api, DeleteParams, ListParams};
use support::Stack;

/// How much CPU per wave and RSS may grow, by default.
const FLAT_WITHIN: f64 = 0.10;
const WAVE_TIMEOUT: Duration = Duration::from_secs(300);

fn env_number(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let waves = env_number("CHURN_WAVES", 50).max(7);
    let size = env_number("CHURN_WAVE_SIZE", 200);
    let flat_within = std::env::var("CHURN_FLAT_WITHIN")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|v| *v >= 0.0)
        .unwrap_or(FLAT_WITHIN);
    let stack = Stack::start("churn").await?;
    let proxies: Api<Proxy> = stack.env.namespaced();
    println!(
        "churn benchmark: {waves} waves of {size} Proxies ({} create/delete cycles), reference provider, 2 cores",
        waves * size
    );
    println!(
        "{:>5} {:>9} {:>10} {:>9}   per-Proxy maps after the wave",
        "wave", "wave s", "CPU s", "RSS MiB"
    );
    let mut cpu_per_wave = Vec::new();
    let mut rss_after = Vec::new();
    let mut leftovers = Vec::new();
    for wave in 1..=waves {
        let cpu_before = stack.cpu_seconds()?;
        let started = Instant::now();
        run_wave(&proxies, wave, size, stack.proxy_port).await?;
        let maps = settled_maps(&stack).await?;
        let cpu = stack.cpu_seconds()? - cpu_before;
        let rss = stack.memory_kib("VmRSS:")? as f64 / 1024.0;
        println!(
            "{wave:>5} {:>9.1} {cpu:>10.2} {rss:>9.1}   {}",
            started.elapsed().as_secs_f64(),
            support::describe(&maps)
        );
        cpu_per_wave.push(cpu);
        rss_after.push(rss);
        leftovers = maps.into_iter().filter(|(_, n)| *n != 0).collect();
    }
    let failed_reconciles = stack.metric("egressproxy_reconcile_errors_total").await? as u64;
    stack.stop();

    let third = waves / 3;
    let early = median(&cpu_per_wave[1..=third]);
    let late = median(&cpu_per_wave[waves - third..]);
    let rss_reference = rss_after[waves / 2 - 1];
    let rss_end = *rss_after.last().unwrap_or(&0.0);
    println!();
    println!("{:<46} {:>12}   target", "figure", "measured");
    println!(
        "{:<46} {:>12}   all 0",
        "per-Proxy entries left after the last wave",
        if leftovers.is_empty() {
            "0".to_owned()
        } else {
            support::describe(&leftovers)
        }
    );
    println!(
        "{:<46} {:>10.2} s   baseline {early:.2} s (waves 2-{}), within {:.0}%",
        format!("CPU per wave, waves {}-{waves} (median)", waves - third + 1),
        late,
        third + 1,
        flat_within * 100.0
    );
    println!(
        "{:<46} {:>8.1} MiB   baseline {rss_reference:.1} MiB (after wave {}), within {:.0}%; {:.1} MiB after wave 1",
        "RSS after the last wave",
        rss_end,
        waves / 2,
        flat_within * 100.0,
        rss_after[0]
    );
    println!(
        "{:<46} {:>12}   0 (the provider never fails)",
        "failed reconciles", failed_reconciles
    );
    anyhow::ensure!(
        failed_reconciles == 0,
        "{failed_reconciles} reconciles failed against a provider that never fails: read the operator's log above"
    );
    anyhow::ensure!(
        leftovers.is_empty(),
        "per-Proxy entries outlived their Proxies: {leftovers:?}"
    );
    anyhow::ensure!(
        late <= early * (1.0 + flat_within),
        "CPU per wave grew from {early:.2} s to {late:.2} s"
    );
    anyhow::ensure!(
        rss_end <= rss_reference * (1.0 + flat_within),
        "RSS grew from {rss_reference:.1} MiB to {rss_end:.1} MiB"
    );
    Ok(())
}

/// Creates `size` Proxies, waits until all are Ready, deletes them, waits until
/// all are gone.
async fn run_wave(proxies: &Api<Proxy>, wave: usize, size: usize, port: u16) -> anyhow::Result<()> {
    support::create_wave(proxies, &format!("w{wave}"), size, port).await?;
    support::wait_all_ready(proxies, wave as u64, size, WAVE_TIMEOUT).await?;
    proxies
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    support::wait_all_gone(proxies, wave as u64, WAVE_TIMEOUT).await
}

/// The per-Proxy map sizes and phase gauges, once they stop changing (the Delete
/// watch events of the last Proxies may still be on their way).
async fn settled_maps(stack: &Stack) -> anyhow::Result<Vec<(String, i64)>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = stack.metrics().await?;
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

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted[sorted.len() / 2]
}
