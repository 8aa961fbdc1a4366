//! The agent's YAML configuration: hosts, machine types, images, transport tuning.
//!
//! Reading the file is two steps here, neither of which touches anything but the text:
//! 1. [`Config::parse`]: serde with unknown fields rejected, so a typo is an error with
//!    its line and column instead of a silently ignored setting;
//! 2. [`Config::validate`]: every semantic check of the file itself, collected (not
//!    first-only), each naming the field at fault and what to do.
//!
//! The checks that read the machine (the SSH private keys, `known_hosts`, the spool
//! directory) belong to start-up, above the layers: the `startup` module runs them after
//! these two, so a bad path fails at start-up and not at the first Create. This module
//! is a leaf: every layer reads the configuration, and it imports none of them.
//!
//! The reference with every field and default is `docs/kvm-agent.md`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use error::{ConfigError, ConfigProblem};

mod duration;
pub mod error;
mod redact;
mod ssh_address;
mod static_addresses;
mod validate;

pub use duration::DurationBounds;
pub use redact::redact_url;
pub use static_addresses::{MAX_RANGE_SIZE, StaticAddresses};

/// The default libvirt socket of a monolithic libvirtd.
pub const DEFAULT_LIBVIRT_SOCKET: &str = "/var/run/libvirt/libvirt-sock";

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Config {
    /// Hypervisors the agent places VMs on.
    pub hosts: Vec<HostConfig>,
    /// Named VM sizes that a Proxy's `machineType` selects.
    #[serde(default)]
    pub machine_types: BTreeMap<String, MachineType>,
    /// Named base images that a Proxy's `image` selects.
    #[serde(default)]
    pub images: BTreeMap<String, ImageConfig>,
    /// Timeouts and keepalives of the SSH and libvirt transport.
    #[serde(default)]
    pub transport: TransportConfig,
}

/// One hypervisor.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HostConfig {
    /// Unique name; instances record it, so renaming a host orphans its VMs.
    pub name: String,
    /// Reach libvirt through SSH. Exactly one of `ssh` and `local: true`.
    #[serde(default)]
    pub ssh: Option<SshConfig>,
    /// The agent runs on this hypervisor and uses its libvirt socket directly.
    #[serde(default)]
    pub local: bool,
    /// libvirt's read-write socket on the hypervisor (`virtqemud-sock` with modular daemons).
    #[serde(default = "default_libvirt_socket")]
    pub libvirt_socket: PathBuf,
    /// Storage pool that holds base images, overlays and seeds.
    #[serde(default = "default_storage_pool")]
    pub storage_pool: String,
    /// libvirt network for the VMs' NIC (default `default`); exclusive with `bridge`.
    #[serde(default)]
    pub network: Option<String>,
    /// Host bridge for the VMs' NIC; exclusive with `network`.
    #[serde(default)]
    pub bridge: Option<String>,
    /// With a `bridge`: the addresses the agent gives instances itself, configured in
    /// the guest through its NoCloud `network-config` (unset: the bridge's own DHCP
    /// server, if any, gives them, and address identities are refused).
    #[serde(default)]
    pub static_addresses: Option<StaticAddresses>,
    /// `kvm`, `qemu` (software emulation), or `auto`.
    #[serde(default)]
    pub domain_type: DomainType,
    /// The zone the host belongs to: a Proxy's `placement.zone` picks the zone's host
    /// with the most room. Unset: in no zone.
    #[serde(default)]
    pub zone: Option<String>,
    /// How much of the host the agent's VMs may take.
    #[serde(default)]
    pub capacity: HostCapacity,
}

/// How much of a host the agent's VMs may take (room is counted from these and what
/// libvirt reports; see `docs/kvm-agent.md`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct HostCapacity {
    /// Memory kept for the host itself, never counted as room for VMs, in MiB.
    #[serde(rename = "reservedMemoryMiB", default = "default_reserved_memory_mib")]
    pub reserved_memory_mib: u64,
    /// The most instances of the agent the host holds, in any state (unset: no limit).
    #[serde(default)]
    pub max_instances: Option<u32>,
}

impl Default for HostCapacity {
    fn default() -> Self {
        Self {
            reserved_memory_mib: default_reserved_memory_mib(),
            max_instances: None,
        }
    }
}

/// How to reach a hypervisor over SSH.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct SshConfig {
    /// `host` or `host:port` (port 22 when omitted; `[v6]:port` for IPv6).
    pub address: String,
    /// Remote user with read-write access to the libvirt socket.
    pub user: String,
    /// OpenSSH private key (ed25519 or RSA), unencrypted.
    pub private_key: PathBuf,
    /// `known_hosts` file holding the hypervisor's host key.
    #[serde(default)]
    pub known_hosts: Option<PathBuf>,
    /// Accept any host key. Man-in-the-middle exposure; logged loudly at every connect.
    #[serde(default)]
    pub insecure_skip_host_key_verification: bool,
}

/// Which libvirt domain type new VMs get.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DomainType {
    /// Hardware virtualisation.
    Kvm,
    /// Software emulation (TCG): slow, but works where KVM is missing or nested KVM hangs.
    Qemu,
    /// `kvm` when the host's capabilities offer it, else `qemu`.
    #[default]
    Auto,
}

/// A VM size.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct MachineType {
    /// Virtual CPUs.
    pub vcpus: u32,
    /// Memory in MiB.
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u64,
    /// Root disk (overlay) size in GiB.
    #[serde(rename = "diskGiB")]
    pub disk_gib: u64,
}

/// A base image. Its `Debug` shows the URL as [`redact_url`] does: no credentials, no query.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ImageConfig {
    /// `http://`, `https://` or `file://` URL of the image. `user:password@` in an
    /// http(s) URL is sent as HTTP basic authentication.
    pub url: String,
    /// Expected SHA-256 of the file, lowercase hex; verified while downloading.
    #[serde(default)]
    pub sha256: Option<String>,
    /// Disk format of the file.
    #[serde(default)]
    pub format: ImageFormat,
    /// Boot firmware.
    #[serde(default)]
    pub firmware: Firmware,
    /// Whether cloud-init must install qemu-guest-agent (`install`, the default) or the
    /// image ships it (`preinstalled`: cloud-init only starts it, and the first boot
    /// skips `apt-get update`).
    #[serde(default)]
    pub guest_agent: GuestAgent,
}

impl fmt::Debug for ImageConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImageConfig")
            .field("url", &redact_url(&self.url))
            .field("sha256", &self.sha256)
            .field("format", &self.format)
            .field("firmware", &self.firmware)
            .field("guest_agent", &self.guest_agent)
            .finish()
    }
}

/// How an image gets qemu-guest-agent (the `guestAgent` setting of an image).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GuestAgent {
    /// cloud-init installs the package (an `apt-get update` on every first boot) and
    /// starts the agent.
    #[default]
    Install,
    /// The image ships the package: cloud-init only enables and starts the agent.
    Preinstalled,
}

/// Disk image format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    /// QEMU copy-on-write v2.
    #[default]
    Qcow2,
    /// Raw disk.
    Raw,
}

/// Boot firmware.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Firmware {
    /// OVMF, secure boot off (modern cloud images hang in GRUB on BIOS without video).
    #[default]
    Uefi,
    /// SeaBIOS.
    Bios,
}

/// Transport tuning; defaults suit a LAN.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TransportConfig {
    /// Deadline for TCP connect, SSH key exchange and authentication.
    #[serde(default = "default_handshake_timeout", with = "duration")]
    pub ssh_handshake_timeout: Duration,
    /// SSH keepalive interval; the session closes after `sshKeepaliveMax` unanswered ones.
    #[serde(default = "default_ssh_keepalive_interval", with = "duration")]
    pub ssh_keepalive_interval: Duration,
    /// Unanswered SSH keepalives before the session is closed.
    #[serde(default = "default_keepalive_max")]
    pub ssh_keepalive_max: u32,
    /// libvirt keepalive interval; the connection closes after `libvirtKeepaliveCount`
    /// unanswered ones.
    #[serde(default = "default_libvirt_keepalive_interval", with = "duration")]
    pub libvirt_keepalive_interval: Duration,
    /// Unanswered libvirt keepalives before libvirt closes the connection.
    #[serde(default = "default_keepalive_max")]
    pub libvirt_keepalive_count: u32,
    /// Deadline of a libvirt call when the caller sets none.
    #[serde(default = "default_call_timeout", with = "duration")]
    pub default_call_timeout: Duration,
    /// How long one base image download (fetch, upload into the host's pool, marker) may
    /// take. It runs detached from the Create that started it, so a Create whose own
    /// deadline passes answers "still downloading" and a later one finds the base ready.
    #[serde(default = "default_image_download_timeout", with = "duration")]
    pub image_download_timeout: Duration,
    /// Writable directory where an image served without `Content-Length` is spooled
    /// before its upload (libvirt needs the length first). Default: the system temp dir
    /// (`TMPDIR`); on a read-only root filesystem, a mounted scratch volume.
    #[serde(default)]
    pub image_spool_dir: Option<PathBuf>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        Self {
            ssh_handshake_timeout: default_handshake_timeout(),
            ssh_keepalive_interval: default_ssh_keepalive_interval(),
            ssh_keepalive_max: default_keepalive_max(),
            libvirt_keepalive_interval: default_libvirt_keepalive_interval(),
            libvirt_keepalive_count: default_keepalive_max(),
            default_call_timeout: default_call_timeout(),
            image_download_timeout: default_image_download_timeout(),
            image_spool_dir: None,
        }
    }
}

fn default_libvirt_socket() -> PathBuf {
    PathBuf::from(DEFAULT_LIBVIRT_SOCKET)
}
fn default_reserved_memory_mib() -> u64 {
    512
}
fn default_storage_pool() -> String {
    "default".to_owned()
}
fn default_handshake_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_ssh_keepalive_interval() -> Duration {
    Duration::from_secs(10)
}
fn default_libvirt_keepalive_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_keepalive_max() -> u32 {
    3
}
fn default_call_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_image_download_timeout() -> Duration {
    Duration::from_secs(3600)
}

impl HostConfig {
    /// The NIC attachment: the configured bridge, else the network (default `default`).
    pub fn attachment(&self) -> Attachment {
        match (&self.bridge, &self.network) {
            (Some(bridge), _) => Attachment::Bridge(bridge.clone()),
            (None, Some(network)) => Attachment::Network(network.clone()),
            (None, None) => Attachment::Network("default".to_owned()),
        }
    }
}

impl HostConfig {
    /// The static address block, when the host attaches its VMs to a bridge and has one.
    pub fn static_block(&self) -> Option<&StaticAddresses> {
        self.bridge.as_ref().and(self.static_addresses.as_ref())
    }
}

/// Where a VM's NIC attaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attachment {
    /// A libvirt network.
    Network(String),
    /// A host bridge.
    Bridge(String),
}

impl Config {
    /// Parses YAML; unknown fields are errors with their location.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        serde_norway::from_str(text).map_err(|e| {
            let field = e
                .location()
                .map(|l| format!("line {} column {}", l.line(), l.column()))
                .unwrap_or_default();
            ConfigError::new(vec![ConfigProblem::new(field, e.to_string())])
        })
    }

    /// The host named `name`.
    pub fn host(&self, name: &str) -> Option<&HostConfig> {
        self.hosts.iter().find(|h| h.name == name)
    }
}

impl fmt::Display for DomainType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DomainType::Kvm => "kvm",
            DomainType::Qemu => "qemu",
            DomainType::Auto => "auto",
        })
    }
}

#[cfg(test)]
mod tests;
