use super::*;
use crate::libvirt::xml::metadata::{NotXmlSafe, PlacementRecord, check_xml_safe};

fn metadata() -> InstanceMetadata {
    InstanceMetadata {
        address_identity: None,
        static_address: None,
        key: "uid-1".into(),
        name: "default/egress".into(),
        created: "2026-11-30T01:02:03Z".into(),
        proxy_port: 3128,
        spec_sha256: "ab".repeat(32),
        placement: PlacementRecord {
            zone: None,
            host: "hv1".into(),
            machine_type: "small".into(),
            image: "debian-12".into(),
            base_volume: format!("egressproxy-base-{}.img", "cd".repeat(32)),
        },
        tags: [
            ("cluster".to_string(), "dev".to_string()),
            ("uid".to_string(), "uid-1".to_string()),
        ]
        .into(),
    }
}

fn spec() -> DomainSpec {
    DomainSpec {
        name: "egressproxy-uid-1".into(),
        virt_type: VirtType::Qemu,
        vcpus: 2,
        memory_mib: 1024,
        firmware: Firmware::Uefi,
        overlay_path: "/var/lib/libvirt/images/egressproxy-uid-1.root.qcow2".into(),
        seed_path: "/var/lib/libvirt/images/egressproxy-uid-1.seed.iso".into(),
        attachment: Attachment::Network("default".into()),
        mac: None,
        metadata: metadata(),
    }
}

#[test]
fn domain_xml_has_every_required_part() {
    let xml = spec().to_xml().unwrap();
    for part in [
        r#"<domain type="qemu">"#,
        "<name>egressproxy-uid-1</name>",
        r#"<memory unit="MiB">1024</memory>"#,
        "<vcpu>2</vcpu>",
        r#"<os firmware="efi"><type arch="x86_64" machine="q35">hvm</type>"#,
        r#"<feature enabled="no" name="secure-boot"/>"#,
        r#"<disk type="file" device="disk"><driver name="qemu" type="qcow2" discard="unmap"/><source file="/var/lib/libvirt/images/egressproxy-uid-1.root.qcow2"/><target dev="vda" bus="virtio"/></disk>"#,
        r#"<disk type="file" device="cdrom"><driver name="qemu" type="raw"/><source file="/var/lib/libvirt/images/egressproxy-uid-1.seed.iso"/><target dev="sda" bus="scsi"/><readonly/></disk>"#,
        r#"<controller type="scsi" index="0" model="virtio-scsi"/>"#,
        r#"<interface type="network"><source network="default"/><model type="virtio"/></interface>"#,
        r#"<serial type="pty"><target port="0"/></serial>"#,
        r#"<console type="pty"><target type="serial" port="0"/></console>"#,
        r#"<channel type="unix"><target type="virtio" name="org.qemu.guest_agent.0"/></channel>"#,
        r#"<egressproxy:instance xmlns:egressproxy="https://egressproxy.dev/xmlns/kvm-agent/v1" key="uid-1""#,
    ] {
        assert!(xml.contains(part), "missing {part}\nin {xml}");
    }
    assert!(
        !xml.contains("<cpu"),
        "TCG gets the default CPU model: {xml}"
    );
    assert!(!xml.contains("type=\"volume\""), "{xml}");
    assert!(!xml.contains("<bios"), "OVMF has no reboot timeout: {xml}");
}

#[test]
fn bios_kvm_and_bridge_variants() {
    let mut spec = spec();
    spec.firmware = Firmware::Bios;
    spec.virt_type = VirtType::Kvm;
    spec.attachment = Attachment::Bridge("br0".into());
    let xml = spec.to_xml().unwrap();
    assert!(xml.contains(r#"<domain type="kvm">"#), "{xml}");
    assert!(
        xml.contains(
            r#"<os><type arch="x86_64" machine="q35">hvm</type><boot dev="hd"/><bios rebootTimeout="5000"/></os>"#
        ),
        "{xml}"
    );
    assert!(!xml.contains("secure-boot"), "{xml}");
    assert!(xml.contains(r#"<cpu mode="host-passthrough"/>"#), "{xml}");
    assert!(
        xml.contains(r#"<interface type="bridge"><source bridge="br0"/>"#),
        "{xml}"
    );
}

#[test]
fn user_strings_are_escaped_and_round_trip() {
    let mut spec = spec();
    let nasty = r#"a"b'c<d>e&f </metadata><devices>"#;
    spec.metadata.name = nasty.into();
    spec.metadata.tags.insert(nasty.into(), nasty.into());
    spec.metadata.tags.insert("empty".into(), String::new());
    spec.seed_path = "/pool dir/&<'\"/seed.iso".into();
    let xml = spec.to_xml().unwrap();
    assert!(!xml.contains("</metadata><devices>\""), "{xml}");
    assert_eq!(xml.matches("<devices>").count(), 1, "{xml}");
    let facts = DomainFacts::parse(&xml).unwrap();
    assert_eq!(facts.disk_files[1], spec.seed_path);
    let element = spec.metadata.to_xml().unwrap();
    assert_eq!(InstanceMetadata::parse(&element).unwrap(), spec.metadata);
}

/// UpdateInstanceTags hands libvirt the element bare: no prefix, no namespace
/// declaration, every value as it was, however hostile (a value that looks like a
/// prefixed element or a declaration stays a value).
#[test]
fn the_bare_element_keeps_every_value_and_drops_only_prefix_and_declaration() {
    let mut metadata = metadata();
    let nasty = r#"a"b'c<d>e&f </egressproxy:tags><egressproxy:x xmlns:egressproxy="u">"#;
    metadata.name = nasty.into();
    metadata.tags.insert(nasty.into(), nasty.into());
    metadata
        .tags
        .insert("xmlns:egressproxy".into(), "egressproxy:".into());
    metadata.address_identity = Some("id".into());
    let bare = metadata.to_bare_xml().unwrap();
    assert!(bare.starts_with("<instance "), "{bare}");
    assert!(!bare.contains("<egressproxy:"), "{bare}");
    assert!(!bare.contains(METADATA_NAMESPACE), "{bare}");
    assert_eq!(InstanceMetadata::parse(&bare).unwrap(), metadata);
}

#[test]
fn metadata_parses_by_local_name_as_libvirt_returns_it() {
    // virDomainGetMetadata: no prefix, no namespace declaration, re-indented.
    let bare = r#"<instance key="uid-1" name="default/egress" created="2026-11-30T01:02:03Z" proxyPort="3128" specSha256="abababababababababababababababababababababababababababababababab">
  <placement host="hv1" machineType="small" image="debian-12" baseVolume="egressproxy-base-cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd.img"/>
  <tags>
<tag key="cluster" value="dev"/>
<tag key="uid" value="uid-1"/>
  </tags>
</instance>
"#;
    assert_eq!(InstanceMetadata::parse(bare).unwrap(), metadata());
    let written = metadata().to_xml().unwrap();
    assert!(
        written.starts_with("<egressproxy:instance xmlns:egressproxy="),
        "{written}"
    );
    assert_eq!(InstanceMetadata::parse(&written).unwrap(), metadata());
}

#[test]
fn metadata_without_tags_parses() {
    let mut m = metadata();
    m.tags.clear();
    assert_eq!(InstanceMetadata::parse(&m.to_xml().unwrap()).unwrap(), m);
    let err = InstanceMetadata::parse("<instance/>").unwrap_err();
    assert!(err.to_string().contains("instance metadata"), "{err}");
}

#[test]
fn control_characters_are_refused() {
    assert_eq!(check_xml_safe("a\nb"), Err(NotXmlSafe { code: 10 }));
    assert_eq!(check_xml_safe("a\u{1}"), Err(NotXmlSafe { code: 1 }));
    assert!(check_xml_safe("\u{FFFF}").is_err());
    check_xml_safe("namespace/name <ok> & ünïcode ✓").unwrap();
}

#[test]
fn facts_come_from_full_domain_xml() {
    let xml = r#"<domain type='qemu' id='3'>
  <name>egressproxy-uid-1</name>
  <metadata><egressproxy:instance xmlns:egressproxy="https://egressproxy.dev/xmlns/kvm-agent/v1" key="k"/></metadata>
  <devices>
<emulator>/usr/bin/qemu-system-x86_64</emulator>
<disk type='file' device='disk'><source file='/p/a.qcow2'/><target dev='vda' bus='virtio'/></disk>
<disk type='network' device='disk'><source protocol='nbd' name='x'/></disk>
<interface type='network'><mac address='52:54:00:12:34:56'/><source network='default'/></interface>
<interface type='bridge'><source bridge='br0'/></interface>
  </devices>
</domain>"#;
    let facts = DomainFacts::parse(xml).unwrap();
    assert_eq!(facts.macs, ["52:54:00:12:34:56"]);
    assert_eq!(facts.disk_files, [PathBuf::from("/p/a.qcow2")]);
}

/// libvirt's own schema (`virt-xml-validate`, from libvirt-clients) accepts the XML.
#[test]
fn libvirt_schema_accepts_the_domain() {
    let dir = tempfile::tempdir().unwrap();
    for (i, firmware) in [Firmware::Uefi, Firmware::Bios].into_iter().enumerate() {
        let mut spec = spec();
        spec.firmware = firmware;
        spec.metadata.name = r#"<&"'>"#.into();
        let path = dir.path().join(format!("domain{i}.xml"));
        std::fs::write(&path, spec.to_xml().unwrap()).unwrap();
        let out = std::process::Command::new("virt-xml-validate")
            .arg(&path)
            .arg("domain")
            .output()
            .expect("virt-xml-validate (libvirt-clients) is installed");
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
