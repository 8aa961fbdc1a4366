//! The libvirt domain XML of an instance, built from serde structs (never by string
//! concatenation), and the agent's metadata element parsed back.
//!
//! What [`DomainSpec::to_xml`] produces:
//! - `<domain type='kvm|qemu'>`, machine `q35`, x86_64;
//! - UEFI by default (`<os firmware='efi'>` with secure boot and enrolled keys off, lesson
//!   3) or BIOS per image;
//! - the root disk as a **file** disk (lesson 1: libvirt's AppArmor helper only writes
//!   rules for file sources) on virtio, qcow2;
//! - the NoCloud seed as a read-only cdrom on a **virtio-scsi** controller (lesson 13:
//!   cloud kernels have no SATA driver);
//! - a virtio NIC on the configured libvirt network or host bridge;
//! - a serial console (`virsh console`), the `org.qemu.guest_agent.0` channel and a
//!   virtio RNG (cloud-init and sshd block on entropy without it);
//! - the agent's `<metadata>` element under [`METADATA_NAMESPACE`] with the key, name,
//!   tags, creation time, placement, proxy port and the digest of the spec.
//!
//! Every user-supplied string ends up in an attribute, escaped by the serializer.
//! Attribute values survive libvirt's re-serialization exactly, except control
//! characters (XML normalises tabs and newlines in attributes and cannot carry most
//! others), which [`check_xml_safe`] refuses up front.
//!
//! libvirt returns the metadata element re-indented and without its namespace prefix
//! (lesson 2), so [`InstanceMetadata::parse`] matches elements by local name and accepts
//! both forms.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The namespace URI of the agent's metadata element.
pub const METADATA_NAMESPACE: &str = "https://egressproxy.dev/xmlns/kvm-agent/v1";
/// The prefix the agent writes the metadata element with (`virDomainSetMetadata`'s key).
pub const METADATA_PREFIX: &str = "egressproxy";
/// The virtio serial channel qemu-guest-agent listens on.
pub const GUEST_AGENT_CHANNEL: &str = "org.qemu.guest_agent.0";

/// The virtualisation a domain uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VirtType {
    /// Hardware virtualisation.
    Kvm,
    /// Software emulation (TCG).
    Qemu,
}

/// Boot firmware.
pub use crate::config::Firmware;

/// Where the NIC attaches.
pub use crate::config::Attachment;

/// Everything the domain XML is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct DomainSpec {
    /// The domain name (from [`crate::naming`]).
    pub name: String,
    /// Domain type.
    pub virt_type: VirtType,
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    pub memory_mib: u64,
    /// UEFI or BIOS.
    pub firmware: Firmware,
    /// Path of the qcow2 root overlay on the hypervisor.
    pub overlay_path: PathBuf,
    /// Path of the NoCloud seed ISO on the hypervisor.
    pub seed_path: PathBuf,
    /// The NIC's network or bridge.
    pub attachment: Attachment,
    /// The metadata element.
    pub metadata: InstanceMetadata,
}

/// The agent's record of an instance, stored in the domain's metadata element.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename = "egressproxy:instance")]
pub struct InstanceMetadata {
    /// The idempotency key.
    #[serde(rename = "@key")]
    pub key: String,
    /// The caller's human-readable name.
    #[serde(rename = "@name", default)]
    pub name: String,
    /// Creation time, RFC 3339.
    #[serde(rename = "@created")]
    pub created: String,
    /// TCP port of the proxy in the guest.
    #[serde(rename = "@proxyPort")]
    pub proxy_port: u32,
    /// SHA-256 (hex) of the create request's placement, cloud-init and proxy port: a
    /// repeated Create with another spec is ALREADY_EXISTS.
    #[serde(rename = "@specSha256")]
    pub spec_sha256: String,
    /// Where and on what the instance runs.
    #[serde(rename(serialize = "egressproxy:placement", deserialize = "placement"))]
    pub placement: PlacementRecord,
    /// The instance's tags.
    #[serde(
        rename(serialize = "egressproxy:tags", deserialize = "tags"),
        default,
        with = "tag_list"
    )]
    pub tags: BTreeMap<String, String>,
}

/// The resolved placement of an instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacementRecord {
    /// The host's name in the configuration.
    #[serde(rename = "@host")]
    pub host: String,
    /// The machine type's name.
    #[serde(rename = "@machineType")]
    pub machine_type: String,
    /// The image's name.
    #[serde(rename = "@image")]
    pub image: String,
    /// The base volume the overlay is backed by.
    #[serde(rename = "@baseVolume")]
    pub base_volume: String,
}

mod tag_list {
    use super::*;

    #[derive(Serialize, Deserialize)]
    struct Tags {
        #[serde(rename(serialize = "egressproxy:tag", deserialize = "tag"), default)]
        tag: Vec<Tag>,
    }

    #[derive(Serialize, Deserialize)]
    struct Tag {
        #[serde(rename = "@key")]
        key: String,
        #[serde(rename = "@value", default)]
        value: String,
    }

    pub(super) fn serialize<S: serde::Serializer>(
        tags: &BTreeMap<String, String>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        Tags {
            tag: tags
                .iter()
                .map(|(key, value)| Tag {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
        }
        .serialize(s)
    }

    pub(super) fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<BTreeMap<String, String>, D::Error> {
        Ok(Tags::deserialize(d)?
            .tag
            .into_iter()
            .map(|t| (t.key, t.value))
            .collect())
    }
}

/// A value that cannot be stored in the domain XML unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("contains a control character (U+{code:04X}), which libvirt's XML cannot keep")]
pub struct NotXmlSafe {
    /// The offending character's code point.
    pub code: u32,
}

/// Refuses strings that would not survive a trip through libvirt's XML unchanged.
pub fn check_xml_safe(value: &str) -> Result<(), NotXmlSafe> {
    match value
        .chars()
        .find(|c| c.is_control() || matches!(c, '\u{FFFE}' | '\u{FFFF}'))
    {
        Some(c) => Err(NotXmlSafe { code: u32::from(c) }),
        None => Ok(()),
    }
}

/// XML (de)serialization failed.
#[derive(Debug, thiserror::Error)]
pub enum XmlError {
    /// Building the XML failed.
    #[error("cannot build domain XML: {0}")]
    Serialize(#[from] quick_xml::SeError),
    /// The XML libvirt returned does not parse as expected.
    #[error("cannot parse {what}: {source}")]
    Parse {
        /// What was being parsed.
        what: &'static str,
        /// The parser's error.
        #[source]
        source: quick_xml::DeError,
    },
}

impl InstanceMetadata {
    /// The element as `virDomainSetMetadata` or a domain definition takes it: prefixed,
    /// with the namespace declared.
    pub fn to_xml(&self) -> Result<String, XmlError> {
        let element = MetadataElement {
            xmlns: METADATA_NAMESPACE,
            inner: self,
        };
        Ok(quick_xml::se::to_string_with_root(
            "egressproxy:instance",
            &element,
        )?)
    }

    /// Parses the element as libvirt returns it (bare, re-indented) or as written.
    pub fn parse(xml: &str) -> Result<Self, XmlError> {
        quick_xml::de::from_str(xml).map_err(|source| XmlError::Parse {
            what: "instance metadata",
            source,
        })
    }
}

#[derive(Serialize)]
struct MetadataElement<'a> {
    #[serde(rename = "@xmlns:egressproxy")]
    xmlns: &'static str,
    #[serde(flatten)]
    inner: &'a InstanceMetadata,
}

impl DomainSpec {
    /// The domain definition for `virDomainDefineXML`.
    pub fn to_xml(&self) -> Result<String, XmlError> {
        let efi = self.firmware == Firmware::Uefi;
        let interface = match &self.attachment {
            Attachment::Network(network) => Interface {
                kind: "network",
                source: InterfaceSource {
                    network: Some(network.clone()),
                    bridge: None,
                },
                model: Model { kind: "virtio" },
            },
            Attachment::Bridge(bridge) => Interface {
                kind: "bridge",
                source: InterfaceSource {
                    network: None,
                    bridge: Some(bridge.clone()),
                },
                model: Model { kind: "virtio" },
            },
        };
        let domain = Domain {
            kind: match self.virt_type {
                VirtType::Kvm => "kvm",
                VirtType::Qemu => "qemu",
            },
            name: self.name.clone(),
            metadata: Metadata {
                instance: MetadataElement {
                    xmlns: METADATA_NAMESPACE,
                    inner: &self.metadata,
                },
            },
            memory: Sized {
                unit: "MiB",
                value: self.memory_mib,
            },
            vcpu: self.vcpus,
            os: Os {
                firmware: efi.then_some("efi"),
                os_type: OsType {
                    arch: "x86_64",
                    machine: "q35",
                    value: "hvm",
                },
                firmware_features: efi.then(|| FirmwareFeatures {
                    feature: vec![
                        Feature {
                            enabled: "no",
                            name: "secure-boot",
                        },
                        Feature {
                            enabled: "no",
                            name: "enrolled-keys",
                        },
                    ],
                }),
                boot: Boot { dev: "hd" },
            },
            features: Features { acpi: (), apic: () },
            cpu: (self.virt_type == VirtType::Kvm).then_some(Cpu {
                mode: "host-passthrough",
            }),
            clock: Clock { offset: "utc" },
            on_poweroff: "destroy",
            on_reboot: "restart",
            on_crash: "destroy",
            devices: Devices {
                disk: vec![
                    Disk {
                        kind: "file",
                        device: "disk",
                        driver: Driver {
                            name: "qemu",
                            kind: "qcow2",
                            discard: Some("unmap"),
                        },
                        source: FileSource {
                            file: self.overlay_path.display().to_string(),
                        },
                        target: Target {
                            dev: "vda",
                            bus: "virtio",
                        },
                        readonly: None,
                    },
                    Disk {
                        kind: "file",
                        device: "cdrom",
                        driver: Driver {
                            name: "qemu",
                            kind: "raw",
                            discard: None,
                        },
                        source: FileSource {
                            file: self.seed_path.display().to_string(),
                        },
                        target: Target {
                            dev: "sda",
                            bus: "scsi",
                        },
                        readonly: Some(()),
                    },
                ],
                controller: vec![Controller {
                    kind: "scsi",
                    index: 0,
                    model: "virtio-scsi",
                }],
                interface,
                serial: Serial {
                    kind: "pty",
                    target: SerialTarget { port: 0 },
                },
                console: Console {
                    kind: "pty",
                    target: ConsoleTarget {
                        kind: "serial",
                        port: 0,
                    },
                },
                channel: Channel {
                    kind: "unix",
                    target: ChannelTarget {
                        kind: "virtio",
                        name: GUEST_AGENT_CHANNEL,
                    },
                },
                rng: Rng {
                    model: "virtio",
                    backend: RngBackend {
                        model: "random",
                        value: "/dev/urandom",
                    },
                },
            },
        };
        Ok(quick_xml::se::to_string(&domain)?)
    }
}

#[derive(Serialize)]
#[serde(rename = "domain")]
struct Domain<'a> {
    #[serde(rename = "@type")]
    kind: &'static str,
    name: String,
    metadata: Metadata<'a>,
    memory: Sized,
    vcpu: u32,
    os: Os,
    features: Features,
    #[serde(skip_serializing_if = "Option::is_none")]
    cpu: Option<Cpu>,
    clock: Clock,
    on_poweroff: &'static str,
    on_reboot: &'static str,
    on_crash: &'static str,
    devices: Devices,
}

#[derive(Serialize)]
struct Metadata<'a> {
    #[serde(rename = "egressproxy:instance")]
    instance: MetadataElement<'a>,
}

#[derive(Serialize)]
struct Sized {
    #[serde(rename = "@unit")]
    unit: &'static str,
    #[serde(rename = "$text")]
    value: u64,
}

#[derive(Serialize)]
struct Os {
    #[serde(rename = "@firmware", skip_serializing_if = "Option::is_none")]
    firmware: Option<&'static str>,
    #[serde(rename = "type")]
    os_type: OsType,
    #[serde(rename = "firmware", skip_serializing_if = "Option::is_none")]
    firmware_features: Option<FirmwareFeatures>,
    boot: Boot,
}

/// `<os><type arch=.. machine=..>hvm</type>`, shared with the KVM probe guest.
#[derive(Serialize)]
pub(crate) struct OsType {
    #[serde(rename = "@arch")]
    pub(crate) arch: &'static str,
    #[serde(rename = "@machine")]
    pub(crate) machine: &'static str,
    #[serde(rename = "$text")]
    pub(crate) value: &'static str,
}

#[derive(Serialize)]
struct FirmwareFeatures {
    feature: Vec<Feature>,
}

#[derive(Serialize)]
struct Feature {
    #[serde(rename = "@enabled")]
    enabled: &'static str,
    #[serde(rename = "@name")]
    name: &'static str,
}

#[derive(Serialize)]
struct Boot {
    #[serde(rename = "@dev")]
    dev: &'static str,
}

#[derive(Serialize)]
struct Features {
    acpi: (),
    apic: (),
}

#[derive(Serialize)]
struct Cpu {
    #[serde(rename = "@mode")]
    mode: &'static str,
}

#[derive(Serialize)]
struct Clock {
    #[serde(rename = "@offset")]
    offset: &'static str,
}

#[derive(Serialize)]
struct Devices {
    disk: Vec<Disk>,
    controller: Vec<Controller>,
    interface: Interface,
    serial: Serial,
    console: Console,
    channel: Channel,
    rng: Rng,
}

#[derive(Serialize)]
struct Disk {
    #[serde(rename = "@type")]
    kind: &'static str,
    #[serde(rename = "@device")]
    device: &'static str,
    driver: Driver,
    source: FileSource,
    target: Target,
    #[serde(skip_serializing_if = "Option::is_none")]
    readonly: Option<()>,
}

#[derive(Serialize)]
struct Driver {
    #[serde(rename = "@name")]
    name: &'static str,
    #[serde(rename = "@type")]
    kind: &'static str,
    #[serde(rename = "@discard", skip_serializing_if = "Option::is_none")]
    discard: Option<&'static str>,
}

#[derive(Serialize)]
struct FileSource {
    #[serde(rename = "@file")]
    file: String,
}

#[derive(Serialize)]
struct Target {
    #[serde(rename = "@dev")]
    dev: &'static str,
    #[serde(rename = "@bus")]
    bus: &'static str,
}

#[derive(Serialize)]
struct Controller {
    #[serde(rename = "@type")]
    kind: &'static str,
    #[serde(rename = "@index")]
    index: u32,
    #[serde(rename = "@model")]
    model: &'static str,
}

#[derive(Serialize)]
struct Interface {
    #[serde(rename = "@type")]
    kind: &'static str,
    source: InterfaceSource,
    model: Model,
}

#[derive(Serialize)]
struct InterfaceSource {
    #[serde(rename = "@network", skip_serializing_if = "Option::is_none")]
    network: Option<String>,
    #[serde(rename = "@bridge", skip_serializing_if = "Option::is_none")]
    bridge: Option<String>,
}

#[derive(Serialize)]
struct Model {
    #[serde(rename = "@type")]
    kind: &'static str,
}

#[derive(Serialize)]
struct Serial {
    #[serde(rename = "@type")]
    kind: &'static str,
    target: SerialTarget,
}

#[derive(Serialize)]
struct SerialTarget {
    #[serde(rename = "@port")]
    port: u32,
}

#[derive(Serialize)]
struct Console {
    #[serde(rename = "@type")]
    kind: &'static str,
    target: ConsoleTarget,
}

#[derive(Serialize)]
struct ConsoleTarget {
    #[serde(rename = "@type")]
    kind: &'static str,
    #[serde(rename = "@port")]
    port: u32,
}

#[derive(Serialize)]
struct Channel {
    #[serde(rename = "@type")]
    kind: &'static str,
    target: ChannelTarget,
}

#[derive(Serialize)]
struct ChannelTarget {
    #[serde(rename = "@type")]
    kind: &'static str,
    #[serde(rename = "@name")]
    name: &'static str,
}

#[derive(Serialize)]
struct Rng {
    #[serde(rename = "@model")]
    model: &'static str,
    backend: RngBackend,
}

#[derive(Serialize)]
struct RngBackend {
    #[serde(rename = "@model")]
    model: &'static str,
    #[serde(rename = "$text")]
    value: &'static str,
}

/// What the agent reads back from a domain's full XML (`virDomainGetXMLDesc`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DomainFacts {
    /// MAC addresses of the domain's NICs, as libvirt assigned them.
    pub macs: Vec<String>,
    /// Source paths of the domain's file disks.
    pub disk_files: Vec<PathBuf>,
}

impl DomainFacts {
    /// Parses the parts of a full domain XML the agent needs; everything else is ignored.
    pub fn parse(xml: &str) -> Result<Self, XmlError> {
        #[derive(Deserialize)]
        struct Domain {
            #[serde(default)]
            devices: Devices,
        }
        #[derive(Deserialize, Default)]
        struct Devices {
            #[serde(default)]
            interface: Vec<Nic>,
            #[serde(default)]
            disk: Vec<DiskView>,
        }
        #[derive(Deserialize)]
        struct Nic {
            mac: Option<Mac>,
        }
        #[derive(Deserialize)]
        struct Mac {
            #[serde(rename = "@address")]
            address: String,
        }
        #[derive(Deserialize)]
        struct DiskView {
            source: Option<SourceView>,
        }
        #[derive(Deserialize)]
        struct SourceView {
            #[serde(rename = "@file")]
            file: Option<PathBuf>,
        }
        let domain: Domain = quick_xml::de::from_str(xml).map_err(|source| XmlError::Parse {
            what: "domain XML",
            source,
        })?;
        Ok(Self {
            macs: domain
                .devices
                .interface
                .into_iter()
                .filter_map(|nic| nic.mac.map(|m| m.address))
                .collect(),
            disk_files: domain
                .devices
                .disk
                .into_iter()
                .filter_map(|d| d.source.and_then(|s| s.file))
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata() -> InstanceMetadata {
        InstanceMetadata {
            key: "uid-1".into(),
            name: "default/egress".into(),
            created: "2026-11-30T01:02:03Z".into(),
            proxy_port: 3128,
            spec_sha256: "ab".repeat(32),
            placement: PlacementRecord {
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
                r#"<os><type arch="x86_64" machine="q35">hvm</type><boot dev="hd"/></os>"#
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
}
