//! UpdateInstanceTags' libvirt work (`libvirt::tags::compare_and_set_tags`) against
//! libvirt's own `test:///default` driver (in-process, no daemon): the tags land in the
//! running and the persistent definition, a stale expectation writes nothing, a repeat
//! writes nothing, and what is not the agent's is not touched.
//!
//! Every connection in the process shares the driver's state, so each test uses its own
//! domain names.

use std::collections::BTreeMap;

use kvm_agent::config::{Attachment, Firmware};
use kvm_agent::libvirt::domains::{NicKind, read_instance};
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::tags::{TagsUpdate, compare_and_set_tags};
use kvm_agent::libvirt::xml::domain::{DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{InstanceMetadata, METADATA_NAMESPACE, PlacementRecord};
use virt::connect::Connect;
use virt::domain::Domain;
use virt::sys;

fn connect() -> Connect {
    virt::error::clear_error_callback();
    Connect::open(Some("test:///default")).expect("test:///default opens")
}

fn tags(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Defines the agent's domain of `key` with `initial` tags.
fn define(
    conn: &Connect,
    key: &str,
    initial: &BTreeMap<String, String>,
) -> (InstanceNames, Domain) {
    let names = InstanceNames::for_key(key).unwrap();
    let spec = DomainSpec {
        name: names.domain.clone(),
        virt_type: VirtType::Qemu,
        vcpus: 1,
        memory_mib: 256,
        firmware: Firmware::Bios,
        overlay_path: format!("/var/lib/libvirt/images/{}", names.overlay_volume).into(),
        seed_path: format!("/var/lib/libvirt/images/{}", names.seed_volume).into(),
        attachment: Attachment::Network("default".into()),
        mac: None,
        metadata: InstanceMetadata {
            address_identity: Some("identity".into()),
            static_address: None,
            key: key.into(),
            name: "ns/proxy".into(),
            created: "2026-11-30T01:02:03Z".into(),
            proxy_port: 3128,
            spec_sha256: "ab".repeat(32),
            placement: PlacementRecord {
                zone: Some("z1".into()),
                host: "test".into(),
                machine_type: "small".into(),
                image: "debian-12".into(),
                base_volume: format!("egressproxy-base-{}.img", "cd".repeat(32)),
            },
            tags: initial.clone(),
        },
    };
    let domain = conn.define_domain_xml(&spec.to_xml().unwrap()).unwrap();
    (names, domain)
}

/// The tags of the metadata in the running (`live`) or the persistent definition.
fn stored_tags(domain: &Domain, live: bool) -> BTreeMap<String, String> {
    let flags = if live {
        sys::VIR_DOMAIN_AFFECT_LIVE
    } else {
        sys::VIR_DOMAIN_AFFECT_CONFIG
    };
    let element = domain
        .metadata(
            sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
            Some(METADATA_NAMESPACE),
            flags,
        )
        .unwrap();
    InstanceMetadata::parse(&element).unwrap().tags
}

fn metadata(domain: &Domain) -> InstanceMetadata {
    let element = domain
        .metadata(
            sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
            Some(METADATA_NAMESPACE),
            0,
        )
        .unwrap();
    InstanceMetadata::parse(&element).unwrap()
}

#[test]
fn a_running_domain_gets_the_new_tags_live_and_in_its_persistent_definition() {
    let conn = connect();
    let spare = tags(&[("pool", "spares"), ("uid", "")]);
    let adopted = tags(&[("proxy", "ns/p"), ("uid", "1234")]);
    let (names, domain) = define(&conn, "tt-running", &spare);
    domain.create().unwrap();
    let before = metadata(&domain);

    let outcome = compare_and_set_tags(&conn, &names, &spare, &adopted, NicKind::Network).unwrap();
    let TagsUpdate::Done { written, snapshot } = outcome else {
        panic!("the expected tags were there: {outcome:?}");
    };
    assert!(written);
    assert_eq!(snapshot.metadata.tags, adopted);
    assert_eq!(
        snapshot.state,
        sys::VIR_DOMAIN_RUNNING,
        "the update leaves the domain running"
    );
    // Only the tags changed.
    assert_eq!(
        InstanceMetadata {
            tags: spare.clone(),
            ..snapshot.metadata.clone()
        },
        before
    );
    assert_eq!(stored_tags(&domain, true), adopted, "running definition");
    assert_eq!(
        stored_tags(&domain, false),
        adopted,
        "persistent definition"
    );
    // `virsh dumpxml --inactive` shows them in the form Create writes: the agent's
    // prefix on every element.
    let inactive = domain.xml_desc(sys::VIR_DOMAIN_XML_INACTIVE).unwrap();
    assert!(
        inactive.contains(r#"<egressproxy:tag key="proxy" value="ns/p"/>"#),
        "{inactive}"
    );
    assert!(inactive.contains(METADATA_NAMESPACE), "{inactive}");

    // A stop and start boots from the persistent definition: the tags stay.
    domain.destroy().unwrap();
    domain.create().unwrap();
    assert_eq!(metadata(&domain).tags, adopted);
    domain.destroy().unwrap();
    domain.undefine().unwrap();
}

#[test]
fn a_shut_off_domain_gets_them_in_its_persistent_definition() {
    let conn = connect();
    let old = tags(&[("owner", "a")]);
    let new = tags(&[("owner", "b")]);
    let (names, domain) = define(&conn, "tt-shutoff", &old);
    let outcome = compare_and_set_tags(&conn, &names, &old, &new, NicKind::Network).unwrap();
    assert!(
        matches!(outcome, TagsUpdate::Done { written: true, .. }),
        "{outcome:?}"
    );
    assert_eq!(stored_tags(&domain, false), new);
    domain.create().unwrap();
    assert_eq!(
        stored_tags(&domain, true),
        new,
        "started from the new definition"
    );
    domain.destroy().unwrap();
    domain.undefine().unwrap();
}

#[test]
fn a_stale_expectation_writes_nothing_and_a_repeat_writes_nothing() {
    let conn = connect();
    let current = tags(&[("owner", "b")]);
    let (names, domain) = define(&conn, "tt-stale", &current);
    domain.create().unwrap();
    let xml_before = domain.xml_desc(sys::VIR_DOMAIN_XML_INACTIVE).unwrap();

    // Expected tags that differ in a value, in a key, or by one tag too few or too many.
    for expected in [
        tags(&[("owner", "a")]),
        tags(&[("Owner", "b")]),
        tags(&[]),
        tags(&[("owner", "b"), ("extra", "")]),
    ] {
        let outcome = compare_and_set_tags(
            &conn,
            &names,
            &expected,
            &tags(&[("owner", "c")]),
            NicKind::Network,
        )
        .unwrap();
        assert_eq!(outcome, TagsUpdate::TagsDiffer, "expected {expected:?}");
    }
    assert_eq!(stored_tags(&domain, true), current);
    assert_eq!(
        domain.xml_desc(sys::VIR_DOMAIN_XML_INACTIVE).unwrap(),
        xml_before
    );

    // The tags already are the new ones (a retry of a call that succeeded): OK, with
    // nothing written, whatever was expected.
    let outcome = compare_and_set_tags(
        &conn,
        &names,
        &tags(&[("owner", "a")]),
        &current,
        NicKind::Network,
    )
    .unwrap();
    assert!(
        matches!(outcome, TagsUpdate::Done { written: false, .. }),
        "{outcome:?}"
    );
    domain.destroy().unwrap();
    domain.undefine().unwrap();
}

#[test]
fn what_is_not_the_agents_is_no_instance_and_stays_untouched() {
    let conn = connect();
    let none = tags(&[]);
    let missing = InstanceNames::for_key("tt-never-defined").unwrap();
    assert_eq!(
        compare_and_set_tags(&conn, &missing, &none, &none, NicKind::Network).unwrap(),
        TagsUpdate::NoInstance
    );
    // A domain with the instance's name but without the agent's metadata.
    let names = InstanceNames::for_key("tt-foreign").unwrap();
    let domain = conn
        .define_domain_xml(&format!(
            "<domain type='test'><name>{}</name><memory>65536</memory><os><type>hvm</type></os></domain>",
            names.domain
        ))
        .unwrap();
    let xml_before = domain.xml_desc(0).unwrap();
    assert_eq!(
        compare_and_set_tags(&conn, &names, &none, &tags(&[("a", "b")]), NicKind::Network).unwrap(),
        TagsUpdate::NoInstance
    );
    assert_eq!(domain.xml_desc(0).unwrap(), xml_before);
    assert_eq!(
        read_instance(&conn, &names, NicKind::Network).unwrap(),
        None
    );
    domain.undefine().unwrap();
}
