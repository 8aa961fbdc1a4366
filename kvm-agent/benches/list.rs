//! ListInstances over many defined domains: the garbage collector's sweep.
//!
//! Run: `cargo bench -p kvm-agent --bench list` (root; needs
//! `integration/tools/install-system-packages.sh`). Starts a private libvirtd and sshd,
//! defines `BENCH_DOMAINS` (default 1,000) domains with the agent's XML and metadata (UEFI,
//! qcow2 overlay and seed paths, tags; never started), plus 20 foreign domains the agent
//! must skip, and prints the median and worst of 5 `ListInstances` sweeps (every page, at
//! the default page size, as the operator's garbage collector asks) through the agent over
//! SSH and in local mode, against the target (under 1 s), beside one
//! `virsh list --all` on the local socket for scale.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;
use kvm_agent::config::{Attachment, Config, Firmware};
use kvm_agent::contract::pb;
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::xml::domain::{DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, PlacementRecord};
use kvm_agent::provider::instances::Instances;
use kvm_agent::provider::service::KvmProvider;
use kvm_agent::transport::pool::Pool;
use support::{Targets, ssh_and_local_config};
use virt::connect::Connect;

const SWEEPS: usize = 5;
const FOREIGN: usize = 20;

fn main() -> anyhow::Result<()> {
    let domains: usize = std::env::var("BENCH_DOMAINS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    virt::error::clear_error_callback();
    kvm_agent::transport::event_loop::ensure_started().map_err(anyhow::Error::msg)?;
    let libvirtd = Libvirtd::start()?;
    let sshd = Sshd::start()?;

    println!("kvm-agent ListInstances benchmark (loopback, private libvirtd)");
    let defined = define_domains(&libvirtd.uri(), domains)?;
    println!(
        "   defined {domains} agent domains and {FOREIGN} foreign ones in {:.1} s ({:.1} ms each)",
        defined.as_secs_f64(),
        defined.as_secs_f64() * 1000.0 / (domains + FOREIGN) as f64
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let config = Arc::new(ssh_and_local_config(
        &sshd,
        &libvirtd,
        "default",
        Some("default"),
        Duration::from_secs(60),
    ));
    println!();
    println!("   ListInstances, {SWEEPS} sweeps ({domains} domains)      median      worst");
    let mut met = true;
    for host in ["ssh", "local"] {
        let only = Arc::new(Config {
            hosts: config
                .hosts
                .iter()
                .filter(|h| h.name == host)
                .cloned()
                .collect(),
            ..(*config).clone()
        });
        let pool = Arc::new(Pool::new(&only)?);
        let provider = KvmProvider::new(Instances::new(only.clone(), pool));
        let mut took = Vec::new();
        for _ in 0..SWEEPS {
            let provider = provider.clone();
            let (elapsed, found) = runtime.block_on(runtime.spawn(async move {
                let started = Instant::now();
                let found = list_every_page(&provider).await;
                (started.elapsed(), found)
            }))?;
            let found = found.map_err(|e| anyhow::anyhow!("ListInstances: {e:?}"))?;
            anyhow::ensure!(
                found.len() == domains,
                "ListInstances found {} instances, expected {domains}",
                found.len()
            );
            took.push(elapsed);
        }
        took.sort();
        let (median, worst) = (took[SWEEPS / 2], took[SWEEPS - 1]);
        met &= median < Duration::from_secs(1);
        println!(
            "   agent, {:<36} {:>8.0} ms {:>8.0} ms",
            if host == "ssh" {
                "SSH forward"
            } else {
                "local mode"
            },
            median.as_secs_f64() * 1000.0,
            worst.as_secs_f64() * 1000.0
        );
    }
    let started = Instant::now();
    let virsh = Command::new("virsh")
        .args(["-c", &libvirtd.uri(), "list", "--all", "--name"])
        .output()?;
    anyhow::ensure!(virsh.status.success(), "virsh list failed");
    println!(
        "   virsh list --all --name (names only, local)  {:>8.0} ms",
        started.elapsed().as_secs_f64() * 1000.0
    );
    let mut targets = Targets::default();
    targets.check("median sweep, SSH and local mode", "< 1 s", met);
    targets.finish()
}

/// Every page of ListInstances with the default page size, as the operator asks for them.
async fn list_every_page(
    provider: &KvmProvider,
) -> Result<Vec<pb::Instance>, egressproxy_provider::ProviderError> {
    let mut all = Vec::new();
    let mut request = pb::ListInstancesRequest::default();
    loop {
        let page = provider.list_page(&request, deadline()).await?;
        all.extend(page.instances);
        if page.next_page_token.is_empty() {
            return Ok(all);
        }
        request.page_token = page.next_page_token;
    }
}

/// Defines the agent's domains and some foreign ones on one plain connection.
fn define_domains(uri: &str, count: usize) -> anyhow::Result<Duration> {
    let conn = Connect::open(Some(uri))?;
    let started = Instant::now();
    for i in 0..count {
        let key = format!("bench-{i:05}");
        let names = InstanceNames::for_key(&key)?;
        let spec = DomainSpec {
            name: names.domain.clone(),
            virt_type: VirtType::Qemu,
            vcpus: 1,
            memory_mib: 256,
            firmware: Firmware::Uefi,
            overlay_path: format!("/var/lib/libvirt/images/{}", names.overlay_volume).into(),
            seed_path: format!("/var/lib/libvirt/images/{}", names.seed_volume).into(),
            attachment: Attachment::Network("default".into()),
            mac: None,
            metadata: InstanceMetadata {
                address_identity: None,
                static_address: None,
                key: key.clone(),
                name: format!("bench/proxy-{i}"),
                created: "2026-11-30T00:00:00Z".into(),
                proxy_port: 3128,
                spec_sha256: "ab".repeat(32),
                placement: PlacementRecord {
                    zone: None,
                    host: "ssh".into(),
                    machine_type: "small".into(),
                    image: "debian-12".into(),
                    base_volume: format!("egressproxy-base-{}.img", "cd".repeat(32)),
                },
                tags: BTreeMap::from([
                    ("cluster".to_owned(), "bench".to_owned()),
                    ("uid".to_owned(), key),
                ]),
            },
        };
        conn.define_domain_xml(&spec.to_xml()?)?;
    }
    for i in 0..FOREIGN {
        let xml = format!(
            "<domain type='qemu'><name>someone-else-{i}</name><memory unit='MiB'>64</memory>\
             <os><type arch='x86_64' machine='q35'>hvm</type></os></domain>"
        );
        conn.define_domain_xml(&xml)?;
    }
    Ok(started.elapsed())
}

fn deadline() -> tokio::time::Instant {
    tokio::time::Instant::now() + Duration::from_secs(60)
}
