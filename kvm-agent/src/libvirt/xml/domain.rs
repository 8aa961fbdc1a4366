//! The libvirt domain XML of an instance, built from serde structs (never by string
//! concatenation), and the facts the agent reads back from a defined domain.
//!
//! What [`DomainSpec::to_xml`] produces:
//! - `<domain type='kvm|qemu'>`, machine `q35`, x86_64;
//! - UEFI by default (`<os firmware='efi'>` with secure boot and enrolled keys off:
//!   Debian 13 cloud images hang in GRUB on BIOS with a serial port and no video) or BIOS
//!   per image; a BIOS guest whose boot fails boots again after
//!   [`BIOS_REBOOT_TIMEOUT_MS`] (SeaBIOS otherwise halts at "No bootable device" for
//!   good: a network-booted image whose one DHCP attempt timed out on a loaded host would
//!   stay PROVISIONING until the operator replaced it);
//! - the root disk as a **file** disk (libvirt's AppArmor helper only writes rules for
//!   file sources with a path; volume disks are denied on stock Debian and Ubuntu hosts)
//!   on virtio, qcow2;
//! - the NoCloud seed as a read-only cdrom on a **virtio-scsi** controller (Debian's
//!   cloud kernel has no SATA driver: a seed on a SATA cdrom is invisible and cloud-init
//!   runs without user-data);
//! - a virtio NIC on the configured libvirt network or host bridge;
//! - a serial console (`virsh console`), the `org.qemu.guest_agent.0` channel and a
//!   virtio RNG (cloud-init and sshd block on entropy without it);
//! - the agent's `<metadata>` element under [`METADATA_NAMESPACE`] with the key, name,
//!   tags, creation time, placement, proxy port and the digest of the spec.
//!
//! Every user-supplied string ends up in an attribute, escaped by the serializer.
//! Attribute values survive libvirt's re-serialization exactly, except control
//! characters (XML normalises tabs and newlines in attributes and cannot carry most
//! others), which [`check_xml_safe`](super::metadata::check_xml_safe) refuses up front.

use std::path::PathBuf;

use serde::Serialize;

use super::XmlError;
use super::metadata::{InstanceMetadata, METADATA_NAMESPACE, MetadataElement};

mod facts;
pub use facts::DomainFacts;

/// The virtio serial channel qemu-guest-agent listens on.
pub(crate) const GUEST_AGENT_CHANNEL: &str = "org.qemu.guest_agent.0";

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

/// How long SeaBIOS waits before booting again after a failed boot (libvirt's
/// `<bios rebootTimeout>`, milliseconds).
pub const BIOS_REBOOT_TIMEOUT_MS: u32 = 5_000;

/// Where the NIC attaches.
pub use crate::config::Attachment;

/// Everything the domain XML is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct DomainSpec {
    /// The domain name (from [`crate::libvirt::naming`]).
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
    /// The NIC's MAC; libvirt picks one when `None`.
    pub mac: Option<String>,
    /// The metadata element.
    pub metadata: InstanceMetadata,
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
                mac: self.mac.clone().map(|address| Mac { address }),
                model: Model { kind: "virtio" },
            },
            Attachment::Bridge(bridge) => Interface {
                kind: "bridge",
                source: InterfaceSource {
                    network: None,
                    bridge: Some(bridge.clone()),
                },
                mac: self.mac.clone().map(|address| Mac { address }),
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
                bios: (!efi).then_some(Bios {
                    reboot_timeout: BIOS_REBOOT_TIMEOUT_MS,
                }),
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
    #[serde(skip_serializing_if = "Option::is_none")]
    bios: Option<Bios>,
}

/// `<bios rebootTimeout=..>`: SeaBIOS retries a failed boot instead of halting.
#[derive(Serialize)]
struct Bios {
    #[serde(rename = "@rebootTimeout")]
    reboot_timeout: u32,
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
    #[serde(skip_serializing_if = "Option::is_none")]
    mac: Option<Mac>,
    source: InterfaceSource,
    model: Model,
}

#[derive(Serialize)]
struct Mac {
    #[serde(rename = "@address")]
    address: String,
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

#[cfg(test)]
mod tests;
