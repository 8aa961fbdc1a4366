//! Image fetch into a libvirt volume: the agent's image cache versus
//! `curl URL | virsh -c qemu+ssh://... vol-upload`, on loopback.
//!
//! Run: `cargo bench -p kvm-agent --bench image_fetch` (root; needs
//! `integration/tools/install-system-packages.sh`). It:
//! 1. starts a private libvirtd (dir pool `bench`) and sshd, and serves a file of
//!    `BENCH_IMAGE_MIB` MiB (default 512; incompressible bytes, so SSH compression cannot
//!    flatter either side) over HTTP on 127.0.0.1 from this process (the shared test
//!    server, `egressproxy_integration::http_server`);
//! 2. runs the agent side in a **child process** (this binary again, with
//!    `KVM_AGENT_BENCH_CHILD` set): it loads a config, builds an `ImageCache` and calls
//!    `ensure_base` once, then prints its wall time and its peak RSS (`VmHWM` of
//!    `/proc/self/status`). A child keeps the HTTP server, the image generator and the
//!    baseline's bookkeeping out of the agent's figures; its time includes SSH connects,
//!    volume creation, SHA-256, the upload, the pool refresh and the marker;
//! 3. runs the baseline: `virsh vol-create-as` (not timed), then, timed,
//!    `curl -s URL | virsh -c 'qemu+ssh://...' vol-upload --pool bench VOL /dev/stdin`
//!    (no checksum, one SSH connect included);
//! 4. repeats both `BENCH_RUNS` times (default 3), interleaved, and prints medians, the
//!    throughput ratio (target ≥ 0.9x) and the agent's peak RSS (target < 64 MiB), plus one
//!    agent run from a server that sends no `Content-Length` (spooled to disk first);
//! 5. exits non-zero when a target is missed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod support;

use egressproxy_integration::http_server::{Delivery, HttpServer, Reply};
use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;
use kvm_agent::images::cache::{ImageCache, ImageCacheOptions};
use sha2::{Digest, Sha256};
use support::{Targets, median, write_ssh_wrapper};
use virt::connect::Connect;

const CHILD_ENV: &str = "KVM_AGENT_BENCH_CHILD";
const POOL: &str = "bench";

fn main() -> anyhow::Result<()> {
    virt::error::clear_error_callback();
    if let Ok(args) = std::env::var(CHILD_ENV) {
        return child(&args);
    }
    let mib: u64 = env_number("BENCH_IMAGE_MIB", 512);
    let runs: usize = env_number("BENCH_RUNS", 3);
    let bytes = mib << 20;

    let libvirtd = Libvirtd::start()?;
    let sshd = Sshd::start()?;
    let work = tempfile::Builder::new().prefix("bench-image-").tempdir()?;
    let images = libvirtd.dir().join("images");
    std::fs::create_dir_all(&images)?;
    let local = Connect::open(Some(&libvirtd.uri()))?;
    local.create_storage_pool_xml(
        &format!(
            "<pool type='dir'><name>{POOL}</name><target><path>{}</path></target></pool>",
            images.display()
        ),
        0,
    )?;

    let image = work.path().join("image.raw");
    let sha256 = write_image(&image, bytes)?;
    // The shared test server, on a thread of its own: the file read as it is sent.
    let server = HttpServer::start();
    let url = server.route("/image.raw", Reply::File(image.clone(), Delivery::Whole));
    let url_no_length = server.route(
        "/no-length/image.raw",
        Reply::File(image.clone(), Delivery::NoLength),
    );

    let config = work.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "hosts:\n- name: hv\n  ssh:\n    address: \"{}\"\n    user: {}\n    privateKey: {}\n    \
             knownHosts: {}\n  libvirtSocket: {}\n  storagePool: {POOL}\n\
             transport:\n  defaultCallTimeout: 10m\n  imageDownloadTimeout: 30m\n  imageSpoolDir: {}\n",
            sshd.address(),
            sshd.user(),
            sshd.client_key().display(),
            sshd.known_hosts().display(),
            libvirtd.socket().display(),
            work.path().display(),
        ),
    )?;
    let ssh_wrapper = work.path().join("ssh");
    write_ssh_wrapper(&ssh_wrapper, &sshd)?;
    let qemu_ssh = format!(
        "qemu+ssh://root@127.0.0.1:{}/system?socket={}&proxy=netcat&command={}",
        sshd.port(),
        libvirtd.socket().display(),
        ssh_wrapper.display()
    );

    println!(
        "kvm-agent image fetch benchmark: {mib} MiB over HTTP (127.0.0.1) into a volume over SSH, \
         {} CPUs, {runs} runs",
        std::thread::available_parallelism().map_or(1, usize::from)
    );
    let mut agent = Vec::new();
    let mut baseline = Vec::new();
    let mut peak_rss_kib = 0;
    for _ in 0..runs {
        let (took, rss) = agent_run(&config, &url, &sha256)?;
        agent.push(took);
        peak_rss_kib = peak_rss_kib.max(rss);
        delete_base_volumes(&local)?;
        baseline.push(curl_virsh_run(&qemu_ssh, &url, bytes)?);
        local
            .lookup_storage_pool_by_name(POOL)?
            .lookup_storage_vol_by_name("curl.raw")?
            .delete(0)?;
    }
    let (spooled, spooled_rss) = agent_run(&config, &url_no_length, &sha256)?;
    delete_base_volumes(&local)?;
    peak_rss_kib = peak_rss_kib.max(spooled_rss);

    let (agent_median, baseline_median) = (median(&agent), median(&baseline));
    println!();
    println!(
        "   {:<58} {:>9} {:>12}",
        "transfer (median of runs)", "time", "throughput"
    );
    row(
        "agent ImageCache::ensure_base (child process, verified)",
        bytes,
        agent_median,
    );
    row(
        "curl | virsh vol-upload over qemu+ssh:// (no checksum)",
        bytes,
        baseline_median,
    );
    row(
        "agent, server without Content-Length (spooled, 1 run)",
        bytes,
        spooled,
    );
    let ratio = baseline_median.as_secs_f64() / agent_median.as_secs_f64();
    let rss_mib = peak_rss_kib as f64 / 1024.0;
    let targets = [
        (
            format!("agent / curl|virsh throughput = {ratio:.2}x"),
            ">= 0.9x",
            ratio >= 0.9,
        ),
        (
            format!("agent peak RSS (VmHWM) = {rss_mib:.1} MiB"),
            "< 64 MiB",
            rss_mib < 64.0,
        ),
    ];
    println!();
    let mut verdicts = Targets::default();
    for (what, target, met) in &targets {
        verdicts.check(what, target, *met);
    }
    println!(
        "   all runs, agent: {}; curl|virsh: {}",
        list(&agent),
        list(&baseline)
    );
    verdicts.finish()
}

/// The agent side: one `ensure_base`, then `<millis> <VmHWM KiB>` on stdout.
fn child(args: &str) -> anyhow::Result<()> {
    let mut parts = args.splitn(3, '\n');
    let (config, url, sha256) = (
        PathBuf::from(parts.next().unwrap_or_default()),
        parts.next().unwrap_or_default().to_owned(),
        parts.next().unwrap_or_default().to_owned(),
    );
    kvm_agent::transport::event_loop::ensure_started().map_err(anyhow::Error::msg)?;
    let config = kvm_agent::startup::load_config(&config)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let started = Instant::now();
    runtime.block_on(async {
        let pool = kvm_agent::transport::pool::Pool::new(&config)?;
        let cache = ImageCache::new(ImageCacheOptions::from_transport(&config.transport));
        let image = kvm_agent::config::ImageConfig {
            url,
            sha256: Some(sha256),
            format: kvm_agent::config::ImageFormat::Raw,
            firmware: Default::default(),
            guest_agent: Default::default(),
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1800);
        cache
            .ensure_base(&pool.host("hv")?, "bench", &image, deadline)
            .await?;
        Ok::<_, anyhow::Error>(())
    })?;
    let took = started.elapsed();
    println!("{} {}", took.as_millis(), vm_hwm_kib()?);
    Ok(())
}

fn agent_run(config: &Path, url: &str, sha256: &str) -> anyhow::Result<(Duration, u64)> {
    let started = Instant::now();
    let out = Command::new(std::env::current_exe()?)
        .env(CHILD_ENV, format!("{}\n{url}\n{sha256}", config.display()))
        .stderr(Stdio::inherit())
        .output()?;
    let took = started.elapsed();
    anyhow::ensure!(out.status.success(), "agent child failed: {out:?}");
    let text = String::from_utf8(out.stdout)?;
    let rss = text
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("agent child printed {text:?}"))?;
    Ok((took, rss))
}

fn curl_virsh_run(uri: &str, url: &str, bytes: u64) -> anyhow::Result<Duration> {
    let status = Command::new("virsh")
        .args(["-q", "-c", uri, "vol-create-as", POOL, "curl.raw"])
        .arg(bytes.to_string())
        .args(["--format", "raw", "--allocation", "0"])
        .stdout(Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "virsh vol-create-as: {status}");
    let started = Instant::now();
    let status = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "set -o pipefail; curl -sSf '{url}' | virsh -q -c '{uri}' vol-upload --pool {POOL} curl.raw /dev/stdin"
        ))
        .status()?;
    let took = started.elapsed();
    anyhow::ensure!(status.success(), "curl | virsh vol-upload: {status}");
    Ok(took)
}

fn delete_base_volumes(conn: &Connect) -> anyhow::Result<()> {
    let pool = conn.lookup_storage_pool_by_name(POOL)?;
    pool.refresh(0)?;
    for vol in pool.list_all_volumes(0)? {
        let name = vol.name()?;
        if name.starts_with(kvm_agent::libvirt::naming::BASE_PREFIX) {
            vol.delete(0)?;
        }
    }
    Ok(())
}

/// Incompressible bytes (xorshift), written once; returns their SHA-256.
fn write_image(path: &Path, bytes: u64) -> anyhow::Result<String> {
    let mut file = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
    let mut hasher = Sha256::new();
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut block = vec![0u8; 1 << 20];
    for _ in 0..bytes >> 20 {
        for word in block.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            word.copy_from_slice(&x.to_le_bytes());
        }
        hasher.update(&block);
        file.write_all(&block)?;
    }
    file.flush()?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn vm_hwm_kib() -> anyhow::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmHWM in /proc/self/status"))
}

fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn row(label: &str, bytes: u64, took: Duration) {
    let mib_s = bytes as f64 / (1024.0 * 1024.0) / took.as_secs_f64();
    println!(
        "   {label:<58} {:>7.2} s {mib_s:>7.0} MiB/s",
        took.as_secs_f64()
    );
}

fn list(samples: &[Duration]) -> String {
    samples
        .iter()
        .map(|d| format!("{:.2} s", d.as_secs_f64()))
        .collect::<Vec<_>>()
        .join(", ")
}
