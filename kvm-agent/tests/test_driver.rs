//! The domain XML, its metadata and the classification of libvirt errors against
//! libvirt's own `test:///default` driver (in-process, no daemon).
//!
//! Every connection in the process shares the driver's state, so each test uses its own
//! domain names.

use std::collections::BTreeMap;

use kvm_agent::config::{Attachment, Firmware};
use kvm_agent::error::{ErrorClass, classify_libvirt};
use kvm_agent::libvirt::domains::{
    Deleted, NicKind, delete_instance, list_instances, list_instances_knowing, read_instance,
};
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::xml::domain::{DomainFacts, DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, METADATA_NAMESPACE, PlacementRecord};
use kvm_agent::provider::state::instance_state;
use virt::connect::Connect;
use virt::sys;

fn connect() -> Connect {
    virt::error::clear_error_callback();
    Connect::open(Some("test:///default")).expect("test:///default opens")
}

fn spec(key: &str, firmware: Firmware) -> DomainSpec {
    let names = InstanceNames::for_key(key).unwrap();
    DomainSpec {
        name: names.domain.clone(),
        virt_type: VirtType::Qemu,
        vcpus: 1,
        memory_mib: 512,
        firmware,
        overlay_path: format!("/var/lib/libvirt/images/{}", names.overlay_volume).into(),
        seed_path: format!("/var/lib/libvirt/images/{}", names.seed_volume).into(),
        attachment: Attachment::Network("default".into()),
        mac: None,
        metadata: InstanceMetadata {
            address_identity: None,
            static_address: None,
            key: key.into(),
            name: r#"ns/"quoted" & <angled>"#.into(),
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
            tags: BTreeMap::from([
                ("cluster".to_string(), "dev".to_string()),
                ("uid".to_string(), key.to_string()),
            ]),
        },
    }
}

#[test]
fn defined_domain_returns_its_metadata_bare_and_parseable() {
    let conn = connect();
    for (key, firmware) in [
        ("td-meta-uefi", Firmware::Uefi),
        ("td-meta-bios", Firmware::Bios),
    ] {
        let spec = spec(key, firmware);
        let domain = conn.define_domain_xml(&spec.to_xml().unwrap()).unwrap();
        let element = domain
            .metadata(
                sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
                Some(METADATA_NAMESPACE),
                0,
            )
            .unwrap();
        assert!(
            !element.contains("egressproxy:"),
            "libvirt returns the element without its prefix: {element}"
        );
        assert_eq!(InstanceMetadata::parse(&element).unwrap(), spec.metadata);

        // The full XML keeps the prefix; the facts and the metadata parse from it too.
        let full = domain.xml_desc(0).unwrap();
        let facts = DomainFacts::parse(&full).unwrap();
        assert_eq!(facts.disk_files, [spec.overlay_path, spec.seed_path]);
        assert_eq!(facts.macs.len(), 1, "libvirt assigns a MAC: {full}");

        let (state, _) = domain.state().unwrap();
        assert_eq!(
            instance_state(state.to_raw(), false).0,
            egressproxy_provider::pb::InstanceState::Stopped
        );
        domain.create().unwrap();
        let (state, _) = domain.state().unwrap();
        assert_eq!(
            instance_state(state.to_raw(), true).0,
            egressproxy_provider::pb::InstanceState::Running
        );
        domain.destroy().unwrap();
        domain.undefine().unwrap();
    }
}

#[test]
fn libvirt_errors_are_classified() {
    let conn = connect();
    let not_found = [
        conn.lookup_domain_by_name("td-no-such-domain")
            .map(drop)
            .unwrap_err(),
        conn.lookup_storage_pool_by_name("td-no-such-pool")
            .map(drop)
            .unwrap_err(),
        conn.lookup_network_by_name("td-no-such-network")
            .map(drop)
            .unwrap_err(),
    ];
    for error in &not_found {
        let failure = classify_libvirt(error, true);
        assert_eq!(failure.class, ErrorClass::NotFound, "{failure:?}");
        assert!(!failure.transport);
    }

    let bad_xml = conn.define_domain_xml("<domain").map(drop).unwrap_err();
    let failure = classify_libvirt(&bad_xml, true);
    assert_eq!(failure.class, ErrorClass::Permanent, "{failure:?}");

    let spec = spec("td-no-metadata", Firmware::Uefi);
    let domain = conn.define_domain_xml(&spec.to_xml().unwrap()).unwrap();
    let missing = domain
        .metadata(
            sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
            Some("https://example.org/not-ours"),
            0,
        )
        .unwrap_err();
    let failure = classify_libvirt(&missing, true);
    assert_eq!(failure.class, ErrorClass::NotFound, "{failure:?}");
    assert!(
        failure.code_name.eq_ignore_ascii_case("NoDomainMetadata"),
        "{failure:?}"
    );
    domain.undefine().unwrap();

    // A dead connection is a transport failure whatever the code says.
    let failure = classify_libvirt(&not_found[0], false);
    assert!(failure.transport);
    assert_eq!(failure.class, ErrorClass::Transient);
}

fn define(conn: &Connect, key: &str, tags: &[(&str, &str)]) -> DomainSpec {
    let mut spec = spec(key, Firmware::Uefi);
    spec.metadata.tags = tags
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    conn.define_domain_xml(&spec.to_xml().unwrap()).unwrap();
    spec
}

fn create_volume(conn: &Connect, name: &str) {
    let pool = conn.lookup_storage_pool_by_name(TEST_POOL).unwrap();
    let xml = format!("<volume><name>{name}</name><capacity unit='KiB'>64</capacity></volume>");
    virt::storage_vol::StorageVol::create_xml(&pool, &xml, 0).unwrap();
}

/// The pool test:///default comes with.
const TEST_POOL: &str = "default-pool";

#[test]
fn read_instance_reports_state_metadata_and_addresses() {
    let conn = connect();
    let names = InstanceNames::for_key("td-read").unwrap();
    assert_eq!(
        read_instance(&conn, &names, NicKind::Network).unwrap(),
        None
    );
    let spec = define(&conn, "td-read", &[("cluster", "a")]);
    let stopped = read_instance(&conn, &names, NicKind::Network)
        .unwrap()
        .unwrap();
    assert_eq!(stopped.metadata, spec.metadata);
    assert_eq!(stopped.state, sys::VIR_DOMAIN_SHUTOFF);
    assert!(stopped.addresses.is_empty());

    let domain = conn.lookup_domain_by_name(&names.domain).unwrap();
    domain.create().unwrap();
    let running = read_instance(&conn, &names, NicKind::Network)
        .unwrap()
        .unwrap();
    assert_eq!(running.state, sys::VIR_DOMAIN_RUNNING);
    // The test driver makes up addresses for the NIC (from the lease source).
    assert!(!running.addresses.is_empty(), "{running:?}");
    for address in &running.addresses {
        assert!(
            kvm_agent::libvirt::addresses::is_usable_address(*address),
            "{address}"
        );
    }
    delete_instance(&conn, &names, TEST_POOL).unwrap();
}

#[test]
fn a_domain_with_our_prefix_but_no_metadata_is_not_ours() {
    let conn = connect();
    let names = InstanceNames::for_key("td-foreign").unwrap();
    let xml = format!(
        "<domain type='test'><name>{}</name><memory>65536</memory><os><type>hvm</type></os></domain>",
        names.domain
    );
    conn.define_domain_xml(&xml).unwrap();
    assert_eq!(read_instance(&conn, &names, NicKind::Bridge).unwrap(), None);
    let listed = list_instances(&conn, &[], NicKind::Bridge).unwrap();
    assert!(listed.iter().all(|s| s.domain != names.domain));
    conn.lookup_domain_by_name(&names.domain)
        .unwrap()
        .undefine()
        .unwrap();
}

#[test]
fn list_filters_by_every_tag_of_the_selector() {
    let conn = connect();
    define(&conn, "td-list-1", &[("cluster", "td-list"), ("ns", "a")]);
    define(&conn, "td-list-2", &[("cluster", "td-list"), ("ns", "b")]);
    define(&conn, "td-list-3", &[("cluster", "other"), ("ns", "a")]);
    let select = |pairs: &[(&str, &str)]| -> Vec<String> {
        let selector: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        list_instances(&conn, &selector, NicKind::Network)
            .unwrap()
            .into_iter()
            .map(|s| s.metadata.key)
            .collect()
    };
    assert_eq!(
        select(&[("cluster", "td-list")]),
        ["td-list-1", "td-list-2"]
    );
    assert_eq!(
        select(&[("cluster", "td-list"), ("ns", "a")]),
        ["td-list-1"]
    );
    assert!(select(&[("cluster", "none")]).is_empty());
    for key in ["td-list-1", "td-list-2", "td-list-3"] {
        let names = InstanceNames::for_key(key).unwrap();
        delete_instance(&conn, &names, TEST_POOL).unwrap();
    }
}

#[test]
fn delete_removes_domain_and_volumes_and_is_idempotent() {
    let conn = connect();
    let names = InstanceNames::for_key("td-delete").unwrap();
    define(&conn, "td-delete", &[]);
    conn.lookup_domain_by_name(&names.domain)
        .unwrap()
        .create()
        .unwrap();
    create_volume(&conn, &names.overlay_volume);
    create_volume(&conn, &names.seed_volume);

    let deleted = delete_instance(&conn, &names, TEST_POOL).unwrap();
    assert!(deleted.domain);
    assert_eq!(
        deleted.volumes,
        [names.overlay_volume.clone(), names.seed_volume.clone()]
    );
    assert_eq!(
        delete_instance(&conn, &names, TEST_POOL).unwrap(),
        Deleted::default()
    );
    // A pool that does not exist means nothing to clean.
    assert_eq!(
        delete_instance(&conn, &names, "td-no-such-pool").unwrap(),
        Deleted::default()
    );

    // Half-created: volumes but no domain.
    create_volume(&conn, &names.seed_volume);
    let deleted = delete_instance(&conn, &names, TEST_POOL).unwrap();
    assert!(!deleted.domain);
    assert_eq!(deleted.volumes, std::slice::from_ref(&names.seed_volume));
}

#[test]
fn list_reports_each_domain_with_its_own_metadata_and_state() {
    // More domains than metadata readers, so every reader thread gets a share.
    let conn = connect();
    let keys: Vec<String> = (0..3 * kvm_agent::libvirt::domains::METADATA_READERS + 1)
        .map(|i| format!("td-many-{i:02}"))
        .collect();
    for key in &keys {
        define(&conn, key, &[("cluster", "td-many")]);
    }
    let domain = |key: &str| {
        conn.lookup_domain_by_name(&InstanceNames::for_key(key).unwrap().domain)
            .unwrap()
    };
    domain("td-many-00").create().unwrap();
    let paused = domain("td-many-01");
    paused.create().unwrap();
    paused.suspend().unwrap();

    let listed = list_instances(
        &conn,
        &[("cluster".into(), "td-many".into())],
        NicKind::Network,
    )
    .unwrap();
    let listed_keys: Vec<&str> = listed.iter().map(|s| s.metadata.key.as_str()).collect();
    assert_eq!(listed_keys, keys);
    for snapshot in &listed {
        assert_eq!(
            InstanceNames::for_key(&snapshot.metadata.key)
                .unwrap()
                .domain,
            snapshot.domain,
            "each domain is reported with its own metadata"
        );
        let expected = match snapshot.metadata.key.as_str() {
            "td-many-00" => sys::VIR_DOMAIN_RUNNING,
            "td-many-01" => sys::VIR_DOMAIN_PAUSED,
            _ => sys::VIR_DOMAIN_SHUTOFF,
        };
        assert_eq!(snapshot.state, expected, "{}", snapshot.metadata.key);
    }
    for key in &keys {
        delete_instance(&conn, &InstanceNames::for_key(key).unwrap(), TEST_POOL).unwrap();
    }
}

#[test]
fn delete_leaves_a_domain_without_our_metadata_and_its_volumes_alone() {
    let conn = connect();
    let names = InstanceNames::for_key("td-delete-foreign").unwrap();
    // Someone else's domain that happens to have the agent's name, running, with disks
    // named like the instance's volumes.
    let xml = format!(
        "<domain type='test'><name>{}</name><memory>65536</memory><os><type>hvm</type></os></domain>",
        names.domain
    );
    conn.define_domain_xml(&xml).unwrap().create().unwrap();
    create_volume(&conn, &names.overlay_volume);
    create_volume(&conn, &names.seed_volume);

    let outcome = delete_instance(&conn, &names, TEST_POOL).unwrap();
    assert_eq!(
        outcome,
        Deleted {
            domain: false,
            volumes: Vec::new(),
            foreign_domain_left: true,
        }
    );
    let domain = conn.lookup_domain_by_name(&names.domain).unwrap();
    assert!(domain.is_active().unwrap(), "the foreign domain still runs");
    let pool = conn.lookup_storage_pool_by_name(TEST_POOL).unwrap();
    for volume in [&names.overlay_volume, &names.seed_volume] {
        pool.lookup_storage_vol_by_name(volume)
            .unwrap_or_else(|e| panic!("{volume} was deleted: {e}"));
    }

    domain.destroy().unwrap();
    domain.undefine().unwrap();
    for volume in [&names.overlay_volume, &names.seed_volume] {
        pool.lookup_storage_vol_by_name(volume)
            .unwrap()
            .delete(0)
            .unwrap();
    }
}

/// The watch's sweep asks a running domain's addresses only while it has none: given
/// what it knew, it reports that, and a domain that stopped reports none.
#[test]
fn a_listing_that_knows_a_running_domains_address_does_not_ask_for_it_again() {
    let conn = connect();
    let names = InstanceNames::for_key("td-knowing").unwrap();
    define(&conn, "td-knowing", &[("watch", "knowing")]);
    let domain = conn.lookup_domain_by_name(&names.domain).unwrap();
    domain.create().unwrap();
    let selector = [("watch".to_owned(), "knowing".to_owned())];
    let asked = list_instances(&conn, &selector, NicKind::Network).unwrap();
    let made_up = asked[0].addresses.clone();
    assert!(!made_up.is_empty(), "the test driver makes up addresses");
    let known: std::net::IpAddr = "192.0.2.77".parse().unwrap();
    assert!(!made_up.contains(&known));
    let knowing = std::collections::HashMap::from([(names.domain.clone(), vec![known])]);
    let listed = list_instances_knowing(&conn, &selector, NicKind::Network, &knowing).unwrap();
    assert_eq!(
        listed[0].addresses,
        [known],
        "taken from what the sweep knew"
    );
    domain.destroy().unwrap();
    let stopped = list_instances_knowing(&conn, &selector, NicKind::Network, &knowing).unwrap();
    assert_eq!(stopped[0].state, sys::VIR_DOMAIN_SHUTOFF);
    assert!(
        stopped[0].addresses.is_empty(),
        "a stopped domain has no address"
    );
    delete_instance(&conn, &names, TEST_POOL).unwrap();
}
