//! Churn with restarts on a real libvirtd: `kvm-agent serve` as a process creates small
//! iPXE guests over SSH, waits until each runs with an address (iPXE takes a DHCP lease),
//! deletes it, and is SIGKILLed and restarted at random moments: during a Create, while
//! the guest boots, or after a Delete.
//!
//! At the end it prints a table and exits non-zero when a target is missed:
//! - 0 domains, 0 instance volumes (overlays, seeds) and 0 NVRAM files are left (the
//!   cached base image stays);
//! - the agent's RSS and open file descriptors after the last cycle are back to what the
//!   same process had after its first cycle (RSS within 25%, descriptors within 2): a
//!   restart resets both, so the comparison stays within the process alive at the end.
//!
//! `CHURN_CYCLES` (default 100) create/delete cycles; `CHURN_SEED` fixes the random
//! moments (printed). Run as root: `cargo bench -p kvm-agent --bench churn` (needs
//! `integration/tools/install-system-packages.sh`; part of `make bench`).

#[path = "../tests/guest_env/mod.rs"]
mod guest_env;

use std::time::{Duration, Instant};

use egressproxy_integration::chaos::Xorshift;
use egressproxy_integration::http_server::HttpServer;
use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_integration::sshd::free_port;
use egressproxy_provider::client::{Client, ClientOptions, connect_lazy};
use egressproxy_provider::pb;
use guest_env::{GuestHost, ipxe_qcow2, sha256_file};

const RSS_WITHIN: f64 = 0.25;
const FDS_WITHIN: usize = 2;
const CALL: Duration = Duration::from_secs(120);

/// Where in a cycle the agent is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kill {
    Never,
    DuringCreate,
    WhileBooting,
    AfterDelete,
}

/// The RSS of process `pid`, in MiB.
fn rss_mib(pid: u32) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap_or("0")
        .parse()?;
    Ok(kib / 1024.0)
}

/// How many descriptors process `pid` holds open.
fn open_fds(pid: u32) -> anyhow::Result<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?.count())
}

/// `kvm-agent serve` on `port`, logging warnings only.
fn serve(config: &std::path::Path, port: u16) -> anyhow::Result<ServedAgent> {
    ServedAgent::start_with(config, &format!("127.0.0.1:{port}"), |command| {
        command
            .env("RUST_LOG", "warn")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT");
    })
}

fn request(key: &str) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.into(),
        name: format!("churn/{key}"),
        tags: [("bench".to_string(), "churn".to_string())].into(),
        placement: Some(pb::Placement {
            location: None,
            machine_type: "tiny".into(),
            image: "ipxe".into(),
        }),
        cloud_init: Some(pb::CloudInit {
            user_data: b"#cloud-config\n{}\n".to_vec(),
            vendor_data: None,
        }),
        proxy_port: 3128,
        ..Default::default()
    }
}

/// Retries `call` while the agent restarts (UNAVAILABLE, or a transient answer).
async fn retrying<T, F, Fut>(what: &str, mut call: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, tonic::Status>>,
{
    let deadline = Instant::now() + CALL;
    loop {
        match call().await {
            Ok(answer) => return Ok(answer),
            Err(status) if Instant::now() < deadline => {
                if !matches!(
                    status.code(),
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Aborted
                ) {
                    anyhow::bail!("{what}: {status:?}");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(status) => anyhow::bail!("{what}: gave up: {status:?}"),
        }
    }
}

async fn wait_running(client: &Client, id: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + CALL;
    loop {
        let instance = retrying("GetInstance", || {
            let mut client = client.clone();
            let id = id.to_owned();
            async move { client.get_instance(pb::GetInstanceRequest { id }).await }
        })
        .await?
        .into_inner()
        .instance
        .unwrap_or_default();
        if instance.state() == pb::InstanceState::Running && !instance.addresses.is_empty() {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{id} never ran with an address");
        // The guest's DHCP lease can only be polled for.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cycles: u64 = std::env::var("CHURN_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let mut random = Xorshift::from_env("CHURN_SEED");
    let seed = random.seed();
    let host = GuestHost::start();
    let work = tempfile::Builder::new().prefix("bench-churn-").tempdir()?;
    let image = ipxe_qcow2(work.path());
    let sha = sha256_file(&image);
    let server = HttpServer::serving_dir(work.path());
    let config = work.path().join("agent.yaml");
    std::fs::write(
        &config,
        host.config_yaml(&format!("{}/ipxe.qcow2", server.base_url()), &sha),
    )?;
    let port = free_port()?;
    let mut agent = serve(&config, port)?;
    let client = connect_lazy(&ClientOptions::new(format!("http://127.0.0.1:{port}")))?;
    let nvram = host.libvirtd.dir().join("lib/qemu/nvram");

    println!("kvm-agent churn: {cycles} create/delete cycles of iPXE guests, seed {seed}");
    let mut restarts = 0;
    let mut first_cycle_of_process: Option<(f64, usize)> = None;
    let started = Instant::now();
    for cycle in 0..cycles {
        // About one cycle in five kills the agent somewhere.
        // The last five cycles run without a kill, so the process alive at the end has
        // a baseline of its own.
        let kill = match if cycle + 5 >= cycles {
            99
        } else {
            random.below(15)
        } {
            0 => Kill::DuringCreate,
            1 => Kill::WhileBooting,
            2 => Kill::AfterDelete,
            _ => Kill::Never,
        };
        let key = format!("churn-{cycle}");
        let mut restart = |agent: &mut ServedAgent| -> anyhow::Result<()> {
            agent.kill();
            *agent = serve(&config, port)?;
            restarts += 1;
            first_cycle_of_process = None;
            Ok(())
        };
        if kill == Kill::DuringCreate {
            // Create in the background; kill the agent while it works on it.
            let mut racing = client.clone();
            let racing_request = request(&key);
            let create = tokio::spawn(async move { racing.create_instance(racing_request).await });
            tokio::time::sleep(Duration::from_millis(random.below(1500))).await;
            restart(&mut agent)?;
            let _ = create.await;
        }
        let id = retrying("CreateInstance", || {
            let mut client = client.clone();
            let request = request(&key);
            async move { client.create_instance(request).await }
        })
        .await?
        .into_inner()
        .instance
        .unwrap_or_default()
        .id;
        if kill == Kill::WhileBooting {
            restart(&mut agent)?;
        }
        wait_running(&client, &id).await?;
        retrying("DeleteInstance", || {
            let mut client = client.clone();
            let id = id.clone();
            async move {
                client
                    .delete_instance(pb::DeleteInstanceRequest { id })
                    .await
            }
        })
        .await?;
        if kill == Kill::AfterDelete {
            restart(&mut agent)?;
        }
        let sample = (rss_mib(agent.pid())?, open_fds(agent.pid())?);
        // The baseline is a process's first whole cycle (Create, Get, Delete): one
        // restarted while the guest booted or after the Delete has not opened all its
        // connections yet (the bulk one comes with a Create).
        if matches!(kill, Kill::Never | Kill::DuringCreate) {
            first_cycle_of_process.get_or_insert(sample);
        }
        if (cycle + 1) % 10 == 0 || std::env::var_os("CHURN_VERBOSE").is_some() {
            println!(
                "  cycle {:>4}: {:>6.1} s, RSS {:.1} MiB, {} fds, {restarts} restarts",
                cycle + 1,
                started.elapsed().as_secs_f64(),
                sample.0,
                sample.1
            );
        }
    }
    let (rss_end, fds_end) = (rss_mib(agent.pid())?, open_fds(agent.pid())?);
    let (rss_first, fds_first) = first_cycle_of_process.unwrap_or((rss_end, fds_end));
    let domains = host.domains();
    let volumes: Vec<String> = host
        .pool_files()
        .into_iter()
        .filter(|f| !f.starts_with("egressproxy-base-"))
        .collect();
    let nvram_files: Vec<String> = std::fs::read_dir(&nvram)
        .map(|dir| {
            dir.filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();

    println!();
    println!("{:<40} {:>14}   target", "figure", "measured");
    println!(
        "{:<40} {:>14}",
        "cycles, agent restarts",
        format!("{cycles}, {restarts}")
    );
    println!("{:<40} {:>14}   0", "domains left", domains.len());
    println!("{:<40} {:>14}   0", "instance volumes left", volumes.len());
    println!("{:<40} {:>14}   0", "NVRAM files left", nvram_files.len());
    println!(
        "{:<40} {:>10.1} MiB   within {:.0}% of {rss_first:.1} MiB",
        "agent RSS after the last cycle",
        rss_end,
        RSS_WITHIN * 100.0
    );
    println!(
        "{:<40} {:>14}   within {FDS_WITHIN} of {fds_first}",
        "agent open descriptors after the last cycle", fds_end
    );
    anyhow::ensure!(domains.is_empty(), "domains left: {domains:?}");
    anyhow::ensure!(volumes.is_empty(), "volumes left: {volumes:?}");
    anyhow::ensure!(nvram_files.is_empty(), "NVRAM left: {nvram_files:?}");
    anyhow::ensure!(
        rss_end <= rss_first * (1.0 + RSS_WITHIN),
        "RSS grew from {rss_first:.1} MiB to {rss_end:.1} MiB"
    );
    anyhow::ensure!(
        fds_end <= fds_first + FDS_WITHIN,
        "open descriptors grew from {fds_first} to {fds_end}"
    );
    Ok(())
}
