//! Benchmark (a): CreateInstance with a warm image cache through the agent, versus the
//! same libvirt calls issued directly with `virt` on a plain connection.
//!
//! Run: `cargo bench -p kvm-agent --bench create` (root; needs
//! `integration/tools/install-system-packages.sh`). It:
//! 1. starts a private libvirtd in a network namespace of its own (dir pool and DHCP
//!    network `default`) and an sshd, and serves Debian's iPXE image as qcow2 over HTTP on
//!    127.0.0.1 (the tests' guest, `tests/guest_env`);
//! 2. warms the agent's image cache with one untimed Create (the base is downloaded once);
//! 3. times, `BENCH_RUNS` times each (default 20), interleaved:
//!    - **agent**: `Instances::create` over SSH (plan, key lock, domain lookup, cached
//!      base check, overlay, seed volume and upload on a bulk connection, define, start,
//!      read back), domain type `qemu`;
//!    - **direct**: on one `virt::Connect` to the daemon's own socket, the same calls:
//!      domain lookup, overlay `virStorageVolCreateXML`, seed `virStorageVolCreateXML` and
//!      `virStorageVolUpload`, `virDomainDefineXML`, `virDomainCreate`, with the same XML
//!      and the same in-memory seed;
//! 4. deletes each instance between runs (not timed) and prints the medians side by side
//!    with the ratio (target ≤ 1.2x).

#[path = "../tests/guest_env/mod.rs"]
mod guest_env;
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use egressproxy_integration::http_server::HttpServer;
use egressproxy_provider::pb;
use guest_env::{GuestHost, ipxe_qcow2, sha256_file};
use kvm_agent::config::{Attachment, Config, Firmware, ImageFormat};
use kvm_agent::guest::cloud_init::{GuestAgent, seed_documents};
use kvm_agent::guest::seed::build_seed;
use kvm_agent::libvirt::naming::{InstanceNames, base_volume};
use kvm_agent::libvirt::xml::domain::{DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, PlacementRecord};
use kvm_agent::libvirt::xml::volume::{overlay_volume, raw_volume};
use kvm_agent::provider::instances::Instances;
use kvm_agent::transport::pool::Pool;
use support::{Targets, median, percentile};
use virt::connect::Connect;
use virt::stream::Stream;

fn main() -> anyhow::Result<()> {
    virt::error::clear_error_callback();
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    let host = GuestHost::start();
    let work = tempfile::Builder::new().prefix("bench-create-").tempdir()?;
    let image = ipxe_qcow2(work.path());
    let sha = sha256_file(&image);
    let server = HttpServer::serving_dir(work.path());
    let config =
        Config::parse(&host.config_yaml(&format!("{}/ipxe.qcow2", server.base_url()), &sha))?;
    config.validate()?;
    let config = Arc::new(config);
    let pool = Arc::new(Pool::new(&config)?);
    let instances = Instances::new(config.clone(), pool);
    let deadline = || tokio::time::Instant::now() + Duration::from_secs(120);

    // Warm: the base image is downloaded once, and every connection is open.
    runtime.block_on(async {
        let warm = instances.create(&request("bench-warm"), deadline()).await?;
        instances.delete(&warm.id, deadline()).await
    })?;
    let base_path = host.images.join(base_volume(&sha)?);
    let direct = Connect::open(Some(&host.libvirtd.uri()))?;
    let vol_pool = direct.lookup_storage_pool_by_name("default")?;

    let mut agent_times = Vec::new();
    let mut direct_times = Vec::new();
    for run in 0..runs {
        let key = format!("bench-agent-{run}");
        let started = Instant::now();
        let instance = runtime.block_on(instances.create(&request(&key), deadline()))?;
        agent_times.push(started.elapsed());
        runtime.block_on(instances.delete(&instance.id, deadline()))?;

        let key = format!("bench-direct-{run}");
        let names = InstanceNames::for_key(&key)?;
        let started = Instant::now();
        create_directly(&direct, &vol_pool, &names, &key, &base_path, &sha)?;
        direct_times.push(started.elapsed());
        delete_directly(&direct, &vol_pool, &names)?;
    }

    let (agent, direct) = (median(&agent_times), median(&direct_times));
    let ratio = agent.as_secs_f64() / direct.as_secs_f64();
    println!();
    println!("Create with a warm image cache, {runs} runs each, median (p90):");
    println!(
        "   agent (Instances::create over SSH)        {:>9.1} ms ({:.1} ms)",
        ms(agent),
        ms(percentile(&agent_times, 0.9))
    );
    println!(
        "   direct virt calls on the local socket     {:>9.1} ms ({:.1} ms)",
        ms(direct),
        ms(percentile(&direct_times, 0.9))
    );
    let mut targets = Targets::default();
    targets.check(
        &format!("agent / direct = {ratio:.2}x"),
        "<= 1.2x",
        ratio <= 1.2,
    );
    targets.finish()
}

fn request(key: &str) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.into(),
        name: format!("bench/{key}"),
        tags: [("bench".to_string(), "create".to_string())].into(),
        placement: Some(pb::Placement {
            location: None,
            machine_type: "tiny".into(),
            image: "ipxe".into(),
        }),
        cloud_init: Some(pb::CloudInit {
            user_data: b"#cloud-config\npackages: [squid]\n".to_vec(),
            vendor_data: None,
        }),
        proxy_port: 3128,
        ..Default::default()
    }
}

/// What Create does on the hypervisor, as plain libvirt calls on one connection.
fn create_directly(
    conn: &Connect,
    pool: &virt::storage_pool::StoragePool,
    names: &InstanceNames,
    key: &str,
    base_path: &std::path::Path,
    sha: &str,
) -> anyhow::Result<()> {
    let verbose = std::env::var_os("BENCH_VERBOSE").is_some();
    let mut step = Instant::now();
    let mut lap = |what: &str| {
        if verbose {
            eprintln!("   direct: {what} took {:?}", step.elapsed());
        }
        step = Instant::now();
    };
    assert!(conn.lookup_domain_by_name(&names.domain).is_err());
    lap("virDomainLookupByName");
    let overlay = virt::storage_vol::StorageVol::create_xml(
        pool,
        &overlay_volume(
            &names.overlay_volume,
            1 << 30,
            base_path,
            ImageFormat::Qcow2,
        )?,
        0,
    )?;
    lap("overlay virStorageVolCreateXML");
    let documents = seed_documents(
        b"#cloud-config\npackages: [squid]\n",
        None,
        GuestAgent::Install,
    )?;
    let seed = build_seed(&documents, key, &names.domain, None);
    let seed_vol = virt::storage_vol::StorageVol::create_xml(
        pool,
        &raw_volume(&names.seed_volume, seed.len() as u64)?,
        0,
    )?;
    lap("seed virStorageVolCreateXML");
    let stream = Stream::new(conn, 0)?;
    seed_vol.upload(&stream, 0, seed.len() as u64, 0)?;
    let mut rest = &seed[..];
    while !rest.is_empty() {
        let sent = usize::try_from(stream.send(rest)?).unwrap_or(0);
        rest = &rest[sent.min(rest.len())..];
    }
    stream.finish()?;
    lap("virStorageVolUpload");
    let spec = DomainSpec {
        name: names.domain.clone(),
        virt_type: VirtType::Qemu,
        vcpus: 1,
        memory_mib: 128,
        firmware: Firmware::Bios,
        overlay_path: overlay.path()?.into(),
        seed_path: seed_vol.path()?.into(),
        attachment: Attachment::Network("default".into()),
        mac: None,
        metadata: InstanceMetadata {
            address_identity: None,
            static_address: None,
            key: key.into(),
            name: format!("bench/{key}"),
            created: "2026-11-30T00:00:00Z".into(),
            proxy_port: 3128,
            spec_sha256: "00".repeat(32),
            placement: PlacementRecord {
                zone: None,
                host: "hv1".into(),
                machine_type: "tiny".into(),
                image: "ipxe".into(),
                base_volume: base_volume(sha)?,
            },
            tags: [("bench".to_string(), "create".to_string())].into(),
        },
    };
    let domain = conn.define_domain_xml(&spec.to_xml()?)?;
    lap("virDomainDefineXML");
    domain.create()?;
    lap("virDomainCreate");
    Ok(())
}

fn delete_directly(
    conn: &Connect,
    pool: &virt::storage_pool::StoragePool,
    names: &InstanceNames,
) -> anyhow::Result<()> {
    let domain = conn.lookup_domain_by_name(&names.domain)?;
    domain.destroy()?;
    domain.undefine()?;
    for volume in [&names.overlay_volume, &names.seed_volume] {
        pool.lookup_storage_vol_by_name(volume)?.delete(0)?;
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
