//! Property tests of the libvirt XML the agent builds and parses, with hostile values in
//! every string a user (or an administrator's configuration) controls:
//! - building never panics;
//! - a value [`check_xml_safe`] accepts comes back unchanged: from the agent's own
//!   parsers, from libvirt's `test:///default` driver after a define, and the document
//!   passes `virt-xml-validate` (a few samples a run: a process per sample);
//! - a key is either refused or gives names of `[A-Za-z0-9._-]` behind a fixed prefix,
//!   so no value reaches a libvirt name or a file path unchecked;
//! - the parsers of what libvirt returns never panic on arbitrary text.

mod hostile;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use kvm_agent::config::{Attachment, Firmware, ImageFormat};
use kvm_agent::libvirt::naming::InstanceNames;
use kvm_agent::libvirt::xml::domain::{DomainFacts, DomainSpec, VirtType};
use kvm_agent::libvirt::xml::metadata::{
    InstanceMetadata, METADATA_NAMESPACE, PlacementRecord, check_xml_safe,
};
use kvm_agent::libvirt::xml::volume::{overlay_volume, raw_volume};
use proptest::prelude::*;
use virt::connect::Connect;
use virt::storage_vol::StorageVol;
use virt::sys;

use hostile::hostile_text;

/// Text whose characters all survive XML: what the agent lets through to libvirt.
fn xml_safe_text(max_len: usize) -> BoxedStrategy<String> {
    hostile_text(max_len)
        .prop_map(|s| {
            s.chars()
                .filter(|&c| check_xml_safe(&c.to_string()).is_ok())
                .collect()
        })
        .boxed()
}

fn metadata(
    text: impl Strategy<Value = String> + Clone,
) -> impl Strategy<Value = InstanceMetadata> {
    (
        "[A-Za-z0-9._-]{1,128}",
        text.clone(),
        (text.clone(), text.clone(), text.clone(), text.clone()),
        proptest::collection::btree_map(text.clone(), text, 0..8),
        any::<u32>(),
        proptest::option::of(any::<std::net::IpAddr>()),
    )
        .prop_map(
            |(key, name, (host, machine_type, image, base_volume), tags, proxy_port, address)| {
                InstanceMetadata {
                    address_identity: Some(key.clone()),
                    static_address: address,
                    key,
                    name,
                    created: "2026-11-30T01:02:03Z".into(),
                    proxy_port,
                    spec_sha256: "ab".repeat(32),
                    placement: PlacementRecord {
                        zone: None,
                        host,
                        machine_type,
                        image,
                        base_volume,
                    },
                    tags,
                }
            },
        )
}

/// A domain spec with `text` in the user's strings (name, tags, placement), `dir` as
/// the pool directory and `device` as the network or bridge name (both from the
/// administrator's configuration and libvirt's answers).
fn domain_spec(
    text: BoxedStrategy<String>,
    dir: BoxedStrategy<String>,
    device: BoxedStrategy<String>,
) -> impl Strategy<Value = DomainSpec> {
    (
        metadata(text),
        (any::<bool>(), any::<bool>(), any::<bool>()),
        (1u32..=512, 1u64..=(1 << 20)),
        (dir, device),
    )
        .prop_map(
            |(metadata, (kvm, uefi, bridge), (vcpus, memory_mib), (dir, device))| {
                let names =
                    InstanceNames::for_key(&metadata.key).expect("the strategy makes valid keys");
                let dir = Path::new("/").join(dir);
                DomainSpec {
                    mac: metadata
                        .address_identity
                        .as_deref()
                        .map(kvm_agent::libvirt::identity_mac::mac_for_identity),
                    name: names.domain,
                    virt_type: if kvm { VirtType::Kvm } else { VirtType::Qemu },
                    vcpus,
                    memory_mib,
                    firmware: if uefi { Firmware::Uefi } else { Firmware::Bios },
                    overlay_path: dir.join(&names.overlay_volume),
                    seed_path: dir.join(&names.seed_volume),
                    attachment: if bridge {
                        Attachment::Bridge(device)
                    } else {
                        Attachment::Network(device)
                    },
                    metadata,
                }
            },
        )
}

/// Hostile values everywhere, configuration included.
fn hostile_spec() -> impl Strategy<Value = DomainSpec> {
    domain_spec(hostile_text(24), hostile_text(8), hostile_text(8))
}

/// Hostile but storable values where a user reaches; configuration values as libvirt's
/// schema allows them.
fn storable_spec() -> impl Strategy<Value = DomainSpec> {
    domain_spec(
        xml_safe_text(16),
        xml_safe_text(8),
        "[A-Za-z0-9_.-]{1,15}".boxed(),
    )
}

/// Whether every string of `spec` passes [`check_xml_safe`].
fn all_xml_safe(spec: &DomainSpec) -> bool {
    let m = &spec.metadata;
    let net = match &spec.attachment {
        Attachment::Network(n) | Attachment::Bridge(n) => n,
    };
    [
        &m.name,
        &m.placement.host,
        &m.placement.machine_type,
        &m.placement.image,
        &m.placement.base_volume,
        net,
        &spec.overlay_path.display().to_string(),
        &spec.seed_path.display().to_string(),
    ]
    .into_iter()
    .chain(m.tags.iter().flat_map(|(k, v)| [k, v]))
    .all(|s| check_xml_safe(s).is_ok())
}

fn virt_xml_validate(xml: &str, schema: &str) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("doc.xml");
    std::fs::write(&path, xml).unwrap();
    let out = Command::new("virt-xml-validate")
        .arg(&path)
        .arg(schema)
        .output()
        .expect("virt-xml-validate (libvirt-clients) is installed");
    assert!(
        out.status.success(),
        "{xml}\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn test_driver() -> Connect {
    virt::error::clear_error_callback();
    Connect::open(Some("test:///default")).expect("test:///default opens")
}

proptest! {
    #![proptest_config(hostile::config(file!()))]

    #[test]
    fn building_any_domain_never_panics(spec in hostile_spec()) {
        let _ = spec.to_xml();
        let _ = spec.metadata.to_xml();
    }

    #[test]
    fn xml_safe_values_come_back_from_the_agents_parsers(spec in storable_spec()) {
        prop_assume!(all_xml_safe(&spec));
        let xml = spec.to_xml().unwrap();
        let facts = DomainFacts::parse(&xml).unwrap();
        prop_assert_eq!(facts.disk_files, vec![spec.overlay_path.clone(), spec.seed_path.clone()]);
        let element = spec.metadata.to_xml().unwrap();
        prop_assert_eq!(InstanceMetadata::parse(&element).unwrap(), spec.metadata);
    }

    #[test]
    fn keys_are_refused_or_name_objects_safely(key in prop_oneof![
        hostile_text(16),
        "[A-Za-z0-9._-]{0,140}",
    ]) {
        match InstanceNames::for_key(&key) {
            Err(_) => {}
            Ok(names) => {
                for name in [&names.domain, &names.overlay_volume, &names.seed_volume] {
                    prop_assert!(name.starts_with("egressproxy-"), "{name}");
                    prop_assert!(name.len() <= 255, "{name}");
                    prop_assert!(
                        name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)),
                        "{name}"
                    );
                }
            }
        }
    }

    #[test]
    fn volume_xml_escapes_names_and_paths(
        name in hostile_text(24),
        path in hostile_text(24),
        capacity in any::<u64>(),
        qcow2 in any::<bool>(),
    ) {
        let format = if qcow2 { ImageFormat::Qcow2 } else { ImageFormat::Raw };
        let raw = raw_volume(&name, capacity);
        let overlay = overlay_volume(&name, capacity, Path::new(&path), format);
        if check_xml_safe(&name).is_ok() && check_xml_safe(&path).is_ok() {
            let overlay = overlay.unwrap();
            prop_assert_eq!(volume_facts(&overlay), (name.clone(), capacity, Some(path.clone())));
            prop_assert_eq!(volume_facts(&raw.unwrap()), (name, capacity, None));
        }
    }

    #[test]
    fn parsers_of_libvirts_answers_never_panic(text in prop_oneof![
        hostile_text(64),
        "<(domain|volume|instance)>([<>/a-z =\"'@:]|devices|disk|source|file|interface|mac|address|tags|tag|key|value|placement|capacity|unit|backingStore|path|target|format|timestamps|mtime|[0-9.]){0,80}",
    ]) {
        let _ = DomainFacts::parse(&text);
        let _ = InstanceMetadata::parse(&text);
    }
}

/// The name, capacity and backing path of a volume's XML, read with structs of this
/// test's own rather than the agent's.
fn volume_facts(xml: &str) -> (String, u64, Option<String>) {
    #[derive(serde::Deserialize)]
    struct Volume {
        name: String,
        capacity: u64,
        #[serde(rename = "backingStore")]
        backing_store: Option<BackingStore>,
    }
    #[derive(serde::Deserialize)]
    struct BackingStore {
        #[serde(default)]
        path: String,
    }
    let volume: Volume = quick_xml::de::from_str(xml).expect("the volume XML parses");
    (
        volume.name,
        volume.capacity,
        volume.backing_store.map(|b| b.path),
    )
}

proptest! {
    #![proptest_config(hostile::sampled_config(file!()))]

    /// libvirt's own schema accepts what the agent builds, and its test driver keeps every
    /// value: the metadata read back equals what was written, the disks are where the
    /// agent put them, and the domain has exactly the agent's name.
    #[test]
    fn libvirt_validates_and_keeps_every_xml_safe_value(spec in storable_spec()) {
        prop_assume!(all_xml_safe(&spec));
        let xml = spec.to_xml().unwrap();
        virt_xml_validate(&xml, "domain");
        let conn = test_driver();
        let domain = conn.define_domain_xml(&xml).unwrap();
        let result = (|| {
            prop_assert_eq!(domain.name().unwrap(), spec.name.clone());
            let element = domain
                .metadata(sys::VIR_DOMAIN_METADATA_ELEMENT as i32, Some(METADATA_NAMESPACE), 0)
                .unwrap();
            prop_assert_eq!(InstanceMetadata::parse(&element).unwrap(), spec.metadata.clone());
            let facts = DomainFacts::parse(&domain.xml_desc(0).unwrap()).unwrap();
            prop_assert_eq!(facts.disk_files, vec![spec.overlay_path.clone(), spec.seed_path.clone()]);
            Ok(())
        })();
        domain.undefine().unwrap();
        result?;
    }

    /// Volume names come from the key; the backing path is the pool's (configuration).
    /// libvirt's schema accepts both volumes, and its test driver keeps the name.
    #[test]
    fn libvirt_validates_and_keeps_every_volume(
        key in "[A-Za-z0-9._-]{1,128}",
        path in xml_safe_text(16),
        // The test driver's pool has about 100 GB free.
        capacity in 1u64..(1 << 30),
    ) {
        prop_assume!(check_xml_safe(&path).is_ok());
        let names = InstanceNames::for_key(&key).unwrap();
        let raw = raw_volume(&names.seed_volume, capacity).unwrap();
        virt_xml_validate(&raw, "storagevol");
        // Under the pool's directory, as libvirt reports a base volume's path.
        let base = PathBuf::from(format!("/p/{path}"));
        let overlay = overlay_volume(&names.overlay_volume, capacity, &base, ImageFormat::Qcow2).unwrap();
        virt_xml_validate(&overlay, "storagevol");

        let conn = test_driver();
        let pool = conn.lookup_storage_pool_by_name("default-pool").unwrap();
        let volume = StorageVol::create_xml(&pool, &raw, 0).unwrap();
        let read_back = (volume.name().unwrap(), volume_facts(&volume.xml_desc(0).unwrap()).1);
        volume.delete(0).unwrap();
        prop_assert_eq!(read_back, (names.seed_volume, capacity));
    }
}

/// A fixed sample of the hostile values, so a run that draws few cases still covers each.
#[test]
fn every_hostile_character_is_refused_or_kept() {
    let conn = test_driver();
    for (i, c) in hostile::HOSTILE_CHARS.iter().enumerate() {
        let value = format!("v{c}{c}v");
        let mut spec = DomainSpec {
            name: format!("egressproxy-hostile-char-{i}"),
            virt_type: VirtType::Qemu,
            vcpus: 1,
            memory_mib: 64,
            firmware: Firmware::Bios,
            overlay_path: "/p/o".into(),
            seed_path: "/p/s".into(),
            attachment: Attachment::Network("default".into()),
            mac: None,
            metadata: InstanceMetadata {
                address_identity: None,
                static_address: None,
                key: format!("hostile-char-{i}"),
                name: value.clone(),
                created: "2026-11-30T01:02:03Z".into(),
                proxy_port: 3128,
                spec_sha256: "ab".repeat(32),
                placement: PlacementRecord {
                    zone: None,
                    host: "h".into(),
                    machine_type: "m".into(),
                    image: "i".into(),
                    base_volume: "b".into(),
                },
                tags: BTreeMap::from([(value.clone(), value.clone())]),
            },
        };
        if check_xml_safe(&value).is_err() {
            assert!(
                c.is_control() || matches!(c, '\u{fffe}' | '\u{ffff}'),
                "{c:?}"
            );
            continue;
        }
        spec.overlay_path = PathBuf::from(format!("/p/{value}"));
        let xml = spec.to_xml().unwrap();
        let domain = conn.define_domain_xml(&xml).unwrap();
        let element = domain
            .metadata(
                sys::VIR_DOMAIN_METADATA_ELEMENT as i32,
                Some(METADATA_NAMESPACE),
                0,
            )
            .unwrap();
        let facts = DomainFacts::parse(&domain.xml_desc(0).unwrap()).unwrap();
        domain.undefine().unwrap();
        assert_eq!(
            InstanceMetadata::parse(&element).unwrap(),
            spec.metadata,
            "{c:?}"
        );
        assert_eq!(facts.disk_files[0], spec.overlay_path, "{c:?}");
    }
}
