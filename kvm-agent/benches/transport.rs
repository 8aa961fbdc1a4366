//! The agent's libvirt transport against libvirt's own, side by side, on loopback.
//!
//! Run: `cargo bench -p kvm-agent --bench transport` (root; needs
//! `integration/tools/install-system-packages.sh`). Starts a private libvirtd and sshd and
//! prints, with the targets:
//! 1. median/p90 of 200 cheap calls (`virConnectGetLibVersion`) through the agent's SSH
//!    forward, libvirt's `qemu+ssh://` (OpenSSH client), `qemu+libssh://`, the local socket
//!    directly, and the agent's local mode;
//! 2. the time to open a libvirt connection on the agent's warm SSH session versus
//!    `qemu+ssh://`'s open;
//! 3. throughput of a 256 MiB volume upload through the forward, through `qemu+ssh://`,
//!    and raw SSH (`ssh host 'cat >/dev/null'`);
//! 4. the delay a concurrent bulk upload adds to cheap calls on the same host.
//!
//! `BENCH_UPLOAD_MIB` changes the upload size.

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;
use kvm_agent::transport::bulk::upload_volume;
use kvm_agent::transport::call::LibvirtOp;
use kvm_agent::transport::pool::{HostPool, Pool};
use support::{Targets, median, percentile, ssh_and_local_config, write_ssh_wrapper};
use virt::connect::Connect;
use virt::stream::Stream;

const CALLS: usize = 200;
const OPENS: usize = 20;
const CHUNK: usize = 256 * 1024;

fn main() -> anyhow::Result<()> {
    let upload_mib: u64 = std::env::var("BENCH_UPLOAD_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let upload_bytes = upload_mib * 1024 * 1024;
    let mut targets = Targets::default();
    virt::error::clear_error_callback();
    kvm_agent::transport::event_loop::ensure_started().map_err(anyhow::Error::msg)?;

    let libvirtd = Libvirtd::start()?;
    let sshd = Sshd::start()?;
    let work = tempfile::Builder::new().prefix("bench-").tempdir()?;
    let images = libvirtd.dir().join("images");
    std::fs::create_dir_all(&images)?;
    let ssh_wrapper = work.path().join("ssh");
    write_ssh_wrapper(&ssh_wrapper, &sshd)?;

    let socket = libvirtd.socket();
    let socket_q = socket.display().to_string();
    let qemu_ssh = format!(
        "qemu+ssh://root@127.0.0.1:{}/system?socket={socket_q}&proxy=netcat&command={}",
        sshd.port(),
        ssh_wrapper.display()
    );
    let qemu_libssh = format!(
        "qemu+libssh://root@127.0.0.1:{}/system?socket={socket_q}&proxy=netcat&keyfile={}&known_hosts={}&sshauth=privkey",
        sshd.port(),
        sshd.client_key().display(),
        sshd.known_hosts().display(),
    );
    let local_uri = libvirtd.uri();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let config = ssh_and_local_config(&sshd, &libvirtd, "bench", None, Duration::from_secs(600));
    let pool = Pool::new(&config)?;
    let ssh_host = pool.host("ssh")?;
    let local_host = pool.host("local")?;

    // Storage pool for the uploads.
    {
        let conn = Connect::open(Some(&local_uri))?;
        let xml = format!(
            "<pool type='dir'><name>bench</name><target><path>{}</path></target></pool>",
            images.display()
        );
        conn.create_storage_pool_xml(&xml, 0)?;
    }

    println!(
        "kvm-agent transport benchmark (loopback, {} CPUs)",
        num_cpus()
    );
    println!();
    println!(
        "1. cheap call virConnectGetLibVersion, {CALLS} calls, interleaved    median        p90"
    );
    let _enter = runtime.enter();
    let relay = kvm_agent::transport::relay::Forward::listen(
        work.path().join("diag.sock"),
        kvm_agent::transport::relay::Upstream::Local {
            host: "diag".into(),
            socket: socket.clone(),
        },
    )?;
    let libssh = Connect::open(Some(&qemu_libssh));
    if let Err(e) = &libssh {
        println!("   qemu+libssh:// unavailable: {e}");
    }
    let mut transports = vec![
        (
            "agent, SSH forward (russh)",
            Transport::Agent(ssh_host.clone()),
        ),
        (
            "libvirt qemu+ssh:// (OpenSSH client)",
            Transport::Direct(Arc::new(Connect::open(Some(&qemu_ssh))?)),
        ),
    ];
    if let Ok(conn) = libssh {
        transports.push(("libvirt qemu+libssh://", Transport::Direct(Arc::new(conn))));
    }
    let local_direct = Arc::new(Connect::open(Some(&local_uri))?);
    transports.extend([
        (
            "local socket, direct",
            Transport::Direct(local_direct.clone()),
        ),
        ("agent, local mode", Transport::Agent(local_host.clone())),
        (
            "  diagnostic: agent relay, caller's thread",
            Transport::Direct(Arc::new(Connect::open(Some(&relay.uri()))?)),
        ),
        (
            "  diagnostic: local socket via spawn_blocking",
            Transport::SpawnBlocking(local_direct),
        ),
    ]);
    let samples = interleaved(&runtime, &transports)?;
    for ((label, _), s) in transports.iter().zip(&samples) {
        row(label, s);
    }
    let (agent_ssh, qemu_ssh_calls) = (&samples[0], &samples[1]);
    let ratio = median(agent_ssh).as_secs_f64() / median(qemu_ssh_calls).as_secs_f64();
    targets.check(
        &format!("agent SSH / qemu+ssh:// median = {ratio:.2}x"),
        "<= 1.10x",
        ratio <= 1.10,
    );

    println!();
    println!("2. open a libvirt connection ({OPENS} opens)                median        p90");
    let agent_opens = runtime.block_on(agent_opens(&ssh_host))?;
    let qemu_ssh_opens = direct_opens(&qemu_ssh)?;
    row("agent, on its warm SSH session", &agent_opens);
    row("libvirt qemu+ssh:// (new ssh process)", &qemu_ssh_opens);

    println!();
    println!("3. volume upload, {upload_mib} MiB                                throughput");
    let agent_upload = runtime.block_on(agent_upload(&ssh_host, upload_bytes))?;
    delete_volume(&local_uri, "agent.raw")?;
    let qemu_ssh_upload = direct_upload(&qemu_ssh, upload_bytes)?;
    delete_volume(&local_uri, "direct.raw")?;
    let raw_ssh = raw_ssh_throughput(&sshd, upload_bytes)?;
    throughput_row("agent, SSH forward", upload_bytes, agent_upload);
    throughput_row("libvirt qemu+ssh://", upload_bytes, qemu_ssh_upload);
    throughput_row("raw SSH: ssh host 'cat >/dev/null'", upload_bytes, raw_ssh);
    let vs_libvirt = qemu_ssh_upload.as_secs_f64() / agent_upload.as_secs_f64();
    let vs_raw = raw_ssh.as_secs_f64() / agent_upload.as_secs_f64();
    targets.check(
        &format!("agent / qemu+ssh:// throughput = {vs_libvirt:.2}x"),
        ">= 0.90x",
        vs_libvirt >= 0.9,
    );
    targets.check(
        &format!("agent / raw SSH throughput = {vs_raw:.2}x"),
        ">= 0.80x",
        vs_raw >= 0.8,
    );

    println!();
    println!("4. cheap calls during a concurrent upload on the same host");
    let (baseline, during) = runtime.block_on(runtime.spawn({
        let host = ssh_host.clone();
        async move { calls_during_upload(&host, upload_bytes).await }
    }))??;
    delete_volume(&local_uri, "concurrent.raw")?;
    let base = median(&baseline);
    let added = |d: Duration| d.saturating_sub(base);
    println!(
        "   {:<44} {:>10} {:>10} {:>10}",
        format!("idle ({} calls): p50 / p99 / max", baseline.len()),
        fmt_duration(base),
        fmt_duration(percentile(&baseline, 0.99)),
        fmt_duration(*baseline.iter().max().unwrap_or(&Duration::ZERO)),
    );
    println!(
        "   {:<44} {:>10} {:>10} {:>10}",
        format!("during upload ({} calls): p50 / p99 / max", during.len()),
        fmt_duration(percentile(&during, 0.5)),
        fmt_duration(percentile(&during, 0.99)),
        fmt_duration(*during.iter().max().unwrap_or(&Duration::ZERO)),
    );
    let max_added = added(*during.iter().max().unwrap_or(&Duration::ZERO));
    targets.check(
        &format!("largest added delay = {}", fmt_duration(max_added)),
        "<= 10 ms",
        max_added <= Duration::from_millis(10),
    );
    drop(pool);
    targets.finish()
}

fn deadline() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(600)
}

async fn agent_calls(host: &HostPool) -> anyhow::Result<Vec<Duration>> {
    host.lib_version(deadline()).await?;
    let mut samples = Vec::with_capacity(CALLS);
    for _ in 0..CALLS {
        let started = Instant::now();
        host.lib_version(deadline()).await?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

async fn agent_opens(host: &Arc<HostPool>) -> anyhow::Result<Vec<Duration>> {
    host.lib_version(deadline()).await?;
    let mut samples = Vec::with_capacity(OPENS);
    for _ in 0..OPENS {
        let started = Instant::now();
        host.bulk::<_, kvm_agent::TransportError, _>(
            LibvirtOp::new("virConnectOpen"),
            deadline(),
            |_| Ok(()),
        )
        .await?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

fn direct_opens(uri: &str) -> anyhow::Result<Vec<Duration>> {
    let mut samples = Vec::with_capacity(OPENS);
    for _ in 0..OPENS {
        let started = Instant::now();
        let conn = Connect::open(Some(uri))?;
        samples.push(started.elapsed());
        drop(conn);
    }
    Ok(samples)
}

fn volume_xml(name: &str, bytes: u64) -> String {
    format!(
        "<volume><name>{name}</name><capacity unit='bytes'>{bytes}</capacity>\
         <target><format type='raw'/></target></volume>"
    )
}

async fn create_volume(host: &HostPool, name: &str, bytes: u64) -> anyhow::Result<()> {
    let xml = volume_xml(name, bytes);
    host.call::<_, kvm_agent::TransportError, _>(
        LibvirtOp::new("virStorageVolCreateXML"),
        deadline(),
        move |c| {
            let pool = c.lookup_storage_pool_by_name("bench")?;
            virt::storage_vol::StorageVol::create_xml(&pool, &xml, 0)?;
            Ok(())
        },
    )
    .await?;
    Ok(())
}

fn delete_volume(uri: &str, name: &str) -> anyhow::Result<()> {
    let conn = Connect::open(Some(uri))?;
    let pool = conn.lookup_storage_pool_by_name("bench")?;
    pool.lookup_storage_vol_by_name(name)?.delete(0)?;
    Ok(())
}

async fn agent_upload(host: &Arc<HostPool>, bytes: u64) -> anyhow::Result<Duration> {
    create_volume(host, "agent.raw", bytes).await?;
    let started = Instant::now();
    upload_volume(
        host,
        "bench",
        "agent.raw",
        std::io::repeat(0x5a),
        bytes,
        deadline(),
    )
    .await?;
    Ok(started.elapsed())
}

fn direct_upload(uri: &str, bytes: u64) -> anyhow::Result<Duration> {
    let conn = Connect::open(Some(uri))?;
    let pool = conn.lookup_storage_pool_by_name("bench")?;
    let vol =
        virt::storage_vol::StorageVol::create_xml(&pool, &volume_xml("direct.raw", bytes), 0)?;
    let buf = vec![0x5au8; CHUNK];
    let started = Instant::now();
    let stream = Stream::new(&conn, 0)?;
    vol.upload(&stream, 0, bytes, 0)?;
    let mut sent = 0u64;
    while sent < bytes {
        let want = usize::try_from(bytes - sent).unwrap_or(CHUNK).min(CHUNK);
        let mut chunk = &buf[..want];
        while !chunk.is_empty() {
            let n = usize::try_from(stream.send(chunk)?).unwrap_or(0);
            chunk = &chunk[n.min(chunk.len())..];
        }
        sent += want as u64;
    }
    stream.finish()?;
    Ok(started.elapsed())
}

fn raw_ssh_throughput(sshd: &Sshd, bytes: u64) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut child = Command::new("ssh")
        .args(sshd.ssh_client_args())
        .arg("127.0.0.1")
        .arg("cat >/dev/null")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let buf = vec![0x5au8; CHUNK];
    let mut sent = 0u64;
    while sent < bytes {
        let want = usize::try_from(bytes - sent).unwrap_or(CHUNK).min(CHUNK);
        stdin.write_all(&buf[..want])?;
        sent += want as u64;
    }
    drop(stdin);
    let status = child.wait()?;
    anyhow::ensure!(status.success(), "ssh cat exited with {status}");
    Ok(started.elapsed())
}

async fn calls_during_upload(
    host: &Arc<HostPool>,
    bytes: u64,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let baseline = agent_calls(host).await?;
    create_volume(host, "concurrent.raw", bytes).await?;
    let upload = {
        let host = host.clone();
        tokio::spawn(async move {
            upload_volume(
                &host,
                "bench",
                "concurrent.raw",
                std::io::repeat(0x5a),
                bytes,
                deadline(),
            )
            .await
        })
    };
    let mut during = Vec::new();
    while !upload.is_finished() {
        let started = Instant::now();
        host.lib_version(deadline()).await?;
        let took = started.elapsed();
        if !upload.is_finished() {
            during.push(took);
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    upload.await??;
    Ok((baseline, during))
}

fn fmt_duration(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{} µs", d.as_micros())
    } else {
        format!("{:.2} ms", d.as_secs_f64() * 1000.0)
    }
}

fn row(label: &str, samples: &[Duration]) {
    println!(
        "   {label:<44} {:>10} {:>10}",
        fmt_duration(median(samples)),
        fmt_duration(percentile(samples, 0.9))
    );
}

fn throughput_row(label: &str, bytes: u64, took: Duration) {
    let mib_s = bytes as f64 / (1024.0 * 1024.0) / took.as_secs_f64();
    println!(
        "   {label:<44} {mib_s:>8.0} MiB/s ({:.2} s)",
        took.as_secs_f64()
    );
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// A way to make the cheap call.
enum Transport {
    /// Through the agent's pool (spawn_blocking + relay + SSH or local socket).
    Agent(Arc<HostPool>),
    /// On the calling thread, on a connection libvirt opened itself.
    Direct(Arc<Connect>),
    /// On a direct connection, but handed to tokio's blocking pool like the agent does.
    SpawnBlocking(Arc<Connect>),
}

/// `CALLS` calls per transport, transports interleaved call by call, so that load from
/// other processes on a shared machine affects every transport alike.
fn interleaved(
    runtime: &tokio::runtime::Runtime,
    transports: &[(&str, Transport)],
) -> anyhow::Result<Vec<Vec<Duration>>> {
    const ROUND: usize = 1;
    let mut samples = vec![Vec::with_capacity(CALLS); transports.len()];
    // Warm up: dial, first-call effects.
    for (_, transport) in transports {
        one_call(runtime, transport)?;
    }
    for _ in 0..CALLS / ROUND {
        for ((_, transport), out) in transports.iter().zip(samples.iter_mut()) {
            for _ in 0..ROUND {
                out.push(one_call(runtime, transport)?);
            }
        }
    }
    Ok(samples)
}

fn one_call(runtime: &tokio::runtime::Runtime, transport: &Transport) -> anyhow::Result<Duration> {
    let started = Instant::now();
    match transport {
        Transport::Agent(host) => {
            // Timed inside a runtime task, where the agent's gRPC handlers make their
            // calls; the hand-off from this thread to the runtime and back is not the
            // agent's.
            let host = host.clone();
            let timed = runtime.spawn(async move {
                let started = Instant::now();
                host.lib_version(deadline()).await?;
                Ok::<_, kvm_agent::Error>(started.elapsed())
            });
            return Ok(runtime.block_on(timed)??);
        }
        Transport::Direct(conn) => {
            conn.lib_version()?;
        }
        Transport::SpawnBlocking(conn) => {
            let conn = conn.clone();
            runtime.block_on(tokio::task::spawn_blocking(move || conn.lib_version()))??;
        }
    }
    Ok(started.elapsed())
}
