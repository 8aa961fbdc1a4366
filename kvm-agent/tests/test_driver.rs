//! The domain XML, its metadata and the classification of libvirt errors against
//! libvirt's own `test:///default` driver (in-process, no daemon).
//!
//! Every connection in the process shares the driver's state, so each test uses its own
//! domain names.

use std::collections::BTreeMap;

use kvm_agent::config::{Attachment, Firmware};
use kvm_agent::domain_xml::{
    DomainFacts, DomainSpec, InstanceMetadata, METADATA_NAMESPACE, PlacementRecord, VirtType,
};
use kvm_agent::error::{ErrorClass, classify_libvirt};
use kvm_agent::instance_state::instance_state;
use kvm_agent::naming::InstanceNames;
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
        metadata: InstanceMetadata {
            key: key.into(),
            name: r#"ns/"quoted" & <angled>"#.into(),
            created: "2026-11-30T01:02:03Z".into(),
            proxy_port: 3128,
            spec_sha256: "ab".repeat(32),
            placement: PlacementRecord {
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
