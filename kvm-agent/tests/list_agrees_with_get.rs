//! ListInstances and GetInstance give the same answer for the same instance: the same
//! state, message and addresses. (A running VM with an address used to be listed as
//! PROVISIONING, "booting: waiting for an address", because the list path never read
//! addresses, while Get said RUNNING.)
//!
//! Against libvirt's `test:///default` driver, which makes up a lease address for a
//! running domain's NIC. Every connection in the process shares the driver's state, so
//! the names here are unique to this file.

use std::collections::BTreeMap;

use egressproxy_provider::pb;
use kvm_agent::config::{Attachment, Firmware};
use kvm_agent::libvirt::domains::{NicKind, delete_instance, list_instances, read_instance};
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::xml::domain::{DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, PlacementRecord};
use kvm_agent::provider::state::to_contract_instance;
use virt::connect::Connect;

const CLUSTER: &str = "list-agrees-with-get";

fn define(conn: &Connect, key: &str) -> InstanceNames {
    let names = InstanceNames::for_key(key).unwrap();
    let spec = DomainSpec {
        name: names.domain.clone(),
        virt_type: VirtType::Qemu,
        vcpus: 1,
        memory_mib: 512,
        firmware: Firmware::Uefi,
        overlay_path: format!("/var/lib/libvirt/images/{}", names.overlay_volume).into(),
        seed_path: format!("/var/lib/libvirt/images/{}", names.seed_volume).into(),
        attachment: Attachment::Network("default".into()),
        mac: None,
        metadata: InstanceMetadata {
            address_identity: None,
            static_address: None,
            key: key.into(),
            name: format!("default/{key}"),
            created: "2026-11-30T01:02:03Z".into(),
            proxy_port: 3128,
            spec_sha256: "ab".repeat(32),
            placement: PlacementRecord {
                zone: None,
                host: "test".into(),
                machine_type: "small".into(),
                image: "debian-12".into(),
                base_volume: format!("egressproxy-base-{}.img", "cd".repeat(32)),
            },
            tags: BTreeMap::from([("cluster".to_string(), CLUSTER.to_string())]),
        },
    };
    conn.define_domain_xml(&spec.to_xml().unwrap()).unwrap();
    names
}

#[test]
fn every_listed_instance_reads_as_get_reads_it() {
    virt::error::clear_error_callback();
    let conn = Connect::open(Some("test:///default")).expect("test:///default opens");
    let running = define(&conn, "lag-running");
    let stopped = define(&conn, "lag-stopped");
    conn.lookup_domain_by_name(&running.domain)
        .unwrap()
        .create()
        .unwrap();

    let selector = [("cluster".to_string(), CLUSTER.to_string())];
    let listed: Vec<pb::Instance> = list_instances(&conn, &selector, NicKind::Network)
        .unwrap()
        .into_iter()
        .map(|snapshot| to_contract_instance("test", snapshot))
        .collect();
    let got: Vec<pb::Instance> = [&running, &stopped]
        .into_iter()
        .map(|names| {
            let snapshot = read_instance(&conn, names, NicKind::Network)
                .unwrap()
                .expect("the instance exists");
            to_contract_instance("test", snapshot)
        })
        .collect();

    // The running VM has an address, so Get calls it RUNNING; the comparison below is
    // only meaningful because of that.
    assert_eq!(got[0].state(), pb::InstanceState::Running, "{:?}", got[0]);
    assert!(!got[0].addresses.is_empty(), "{:?}", got[0]);
    assert_eq!(got[1].state(), pb::InstanceState::Stopped, "{:?}", got[1]);
    assert_eq!(listed, got, "List and Get disagree");

    for names in [&running, &stopped] {
        delete_instance(&conn, names, "default-pool").unwrap();
    }
}
