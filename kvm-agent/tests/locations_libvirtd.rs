//! ListLocations and placement by room on a private libvirtd reached over real SSH:
//! the figures are the ones `virsh` reads from the same daemon (its CPUs, its memory,
//! what its running domains were given, another's domain included), a Create in a zone
//! goes to the zone's host that has room and answers the zone, a host at its instance
//! limit refuses a Create with CAPACITY_EXHAUSTED, and a new instance takes its room.
//!
//! Both configured hosts reach the same libvirtd: `hv1` with `maxInstances: 0` (never
//! any room), `hv2` without a limit, both in zone `z1`.

mod common;
mod guest_env;

use std::sync::Arc;
use std::time::Duration;

use common::deadline_in;
use egressproxy_integration::http_server::HttpServer;
use egressproxy_provider::pb::location::Name;
use egressproxy_provider::pb::placement::Location;
use egressproxy_provider::{ErrorClass, pb};
use guest_env::{GuestHost, ipxe_qcow2, sha256_file};
use kvm_agent::config::Config;
use kvm_agent::provider::instances::Instances;
use kvm_agent::provider::locations::list_locations;
use kvm_agent::transport::pool::Pool;

const GENEROUS: Duration = Duration::from_secs(120);
const MIB: u64 = 1 << 20;

/// A `Name: value` line of virsh's output, its first word parsed.
fn field(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.trim_start_matches(':').split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

/// The host's free memory for VMs as virsh sees it: memory less what each running
/// domain was given, less the default 512 MiB reserve; and its CPUs.
fn virsh_figures(host: &GuestHost) -> (u64, u32) {
    let node = host.virsh(&["nodeinfo"]);
    let memory = field(&node, "Memory size") * 1024;
    let cpus = u32::try_from(field(&node, "CPU(s)")).unwrap();
    let committed: u64 = host
        .virsh(&["list", "--name"])
        .lines()
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(|name| field(&host.virsh(&["dominfo", name]), "Used memory") * 1024)
        .sum();
    (memory - committed - 512 * MIB, cpus)
}

fn tiny_request(key: &str, location: Option<Location>) -> pb::CreateInstanceRequest {
    pb::CreateInstanceRequest {
        key: key.into(),
        name: format!("test/{key}"),
        tags: Default::default(),
        placement: Some(pb::Placement {
            location,
            machine_type: "tiny".into(),
            image: "ipxe".into(),
        }),
        cloud_init: None,
        proxy_port: 3128,
        ..Default::default()
    }
}

fn location(all: &[pb::Location], name: Name) -> &pb::Location {
    all.iter()
        .find(|l| l.name.as_ref() == Some(&name))
        .unwrap_or_else(|| panic!("{name:?} not listed"))
}

fn tiny_room(location: &pb::Location) -> Option<u32> {
    location
        .machine_types
        .iter()
        .find(|m| m.name == "tiny")
        .and_then(|m| m.room)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locations_report_what_libvirt_holds_and_creates_go_where_there_is_room() {
    let guest_host = GuestHost::start();
    let work = tempfile::tempdir().unwrap();
    let image = ipxe_qcow2(work.path());
    let sha = sha256_file(&image);
    let server = HttpServer::serving_dir(work.path());
    let one_host = guest_host.config_yaml(&format!("{}/ipxe.qcow2", server.base_url()), &sha);
    let (hosts, rest) = one_host.split_once("machineTypes:").unwrap();
    let hv1 = format!("{hosts}  zone: z1\n  capacity: {{maxInstances: 0}}\n");
    let hv2 = hosts
        .trim_start_matches("hosts:\n")
        .replace("name: hv1", "name: hv2");
    let yaml = format!("{hv1}{hv2}  zone: z1\nmachineTypes:{rest}");
    let config = Config::parse(&yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    config.validate().unwrap();
    let config = Arc::new(config);
    let pool = Arc::new(Pool::new(&config).unwrap());
    let instances = Instances::new(config.clone(), pool.clone());

    // Someone else's running domain holds memory too.
    let other = work.path().join("other.xml");
    std::fs::write(
        &other,
        "<domain type='qemu'><name>someone-else</name><memory unit='MiB'>64</memory>\
         <os><type arch='x86_64'>hvm</type></os></domain>",
    )
    .unwrap();
    guest_host.virsh(&["define", &other.display().to_string()]);
    guest_host.virsh(&["start", "someone-else"]);

    let list = || async {
        list_locations(
            &config,
            &pool,
            &pb::ListLocationsRequest::default(),
            deadline_in(GENEROUS),
        )
        .await
        .unwrap()
        .locations
    };
    let before = list().await;
    let names: Vec<String> = before
        .iter()
        .map(egressproxy_provider::locations::position)
        .collect();
    assert_eq!(names, ["host/hv1", "host/hv2", "zone/z1"]);
    let (free, cpus) = virsh_figures(&guest_host);
    let hv2 = location(&before, Name::Host("hv2".into()));
    let capacity = hv2.capacity.unwrap();
    assert_eq!(capacity.free_memory_bytes, Some(free), "{hv2:?}");
    assert_eq!(capacity.cpus, Some(cpus));
    assert_eq!(capacity.instances, Some(0));
    assert_eq!(
        tiny_room(hv2),
        Some(u32::try_from(free / (128 * MIB)).unwrap())
    );
    assert_eq!(hv2.in_zone, "z1");
    let hv1 = location(&before, Name::Host("hv1".into()));
    assert_eq!(tiny_room(hv1), Some(0), "{hv1:?}");
    assert_eq!(hv1.message, "no room for any machine type");
    let zone = location(&before, Name::Zone("z1".into()));
    assert_eq!(tiny_room(zone), tiny_room(hv2));

    // A named host without room refuses; the zone places on the host that has room.
    let refused = instances
        .create(
            &tiny_request("full", Some(Location::Host("hv1".into()))),
            deadline_in(GENEROUS),
        )
        .await
        .map_err(egressproxy_provider::ProviderError::from)
        .unwrap_err();
    assert_eq!(refused.class, ErrorClass::QuotaExhausted, "{refused}");
    assert_eq!(refused.reason, "CAPACITY_EXHAUSTED");
    assert!(
        refused.message.contains("hv1: 0 of 0 instances"),
        "{refused}"
    );
    assert!(refused.retry_after.is_some());

    let zoned = instances
        .create(
            &tiny_request("zoned", Some(Location::Zone("z1".into()))),
            deadline_in(GENEROUS),
        )
        .await
        .unwrap();
    assert_eq!(zoned.id, "hv2/zoned");
    let asked = Some(Location::Zone("z1".into()));
    assert_eq!(zoned.placement.as_ref().unwrap().location, asked);
    let got = instances
        .get(&zoned.id, deadline_in(GENEROUS))
        .await
        .unwrap();
    assert_eq!(
        got.placement.unwrap().location,
        asked,
        "Get answers the zone too"
    );

    // The new domain holds its memory and counts as the agent's.
    let after = list().await;
    let hv2_after = location(&after, Name::Host("hv2".into())).capacity.unwrap();
    assert_eq!(hv2_after.instances, Some(1));
    assert_eq!(hv2_after.free_memory_bytes, Some(free - 128 * MIB));
    assert_eq!(virsh_figures(&guest_host).0, free - 128 * MIB);

    instances
        .delete(&zoned.id, deadline_in(GENEROUS))
        .await
        .unwrap();
}
