//! The agent's YAML configuration: hosts, machine types, images, transport tuning.
//!
//! Loading is two steps, both at start-up:
//! 1. [`Config::parse`]: serde with unknown fields rejected, so a typo is an error with
//!    its line and column instead of a silently ignored setting;
//! 2. [`Config::validate`]: every semantic check, collected (not first-only), each naming
//!    the field at fault and what to do. It reads the SSH private keys and `known_hosts`
//!    files, so a bad path fails now and not at the first Create.
//!
//! The reference with every field and default is `docs/kvm-agent.md`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::error::{ConfigProblem, Error};
use crate::guest::cloud_init::GuestAgent;

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
    /// `kvm`, `qemu` (software emulation), or `auto`.
    #[serde(default)]
    pub domain_type: DomainType,
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

/// A base image. Its `Debug` shows the URL as [`redact_url`](crate::images::fetch::redact_url)
/// does: no credentials, no query.
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
            .field("url", &crate::images::fetch::redact_url(&self.url))
            .field("sha256", &self.sha256)
            .field("format", &self.format)
            .field("firmware", &self.firmware)
            .field("guest_agent", &self.guest_agent)
            .finish()
    }
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
    #[serde(default = "default_handshake_timeout", with = "humantime_serde")]
    pub ssh_handshake_timeout: Duration,
    /// SSH keepalive interval; the session closes after `sshKeepaliveMax` unanswered ones.
    #[serde(default = "default_ssh_keepalive_interval", with = "humantime_serde")]
    pub ssh_keepalive_interval: Duration,
    /// Unanswered SSH keepalives before the session is closed.
    #[serde(default = "default_keepalive_max")]
    pub ssh_keepalive_max: u32,
    /// libvirt keepalive interval; the connection closes after `libvirtKeepaliveCount`
    /// unanswered ones.
    #[serde(
        default = "default_libvirt_keepalive_interval",
        with = "humantime_serde"
    )]
    pub libvirt_keepalive_interval: Duration,
    /// Unanswered libvirt keepalives before libvirt closes the connection.
    #[serde(default = "default_keepalive_max")]
    pub libvirt_keepalive_count: u32,
    /// Deadline of a libvirt call when the caller sets none.
    #[serde(default = "default_call_timeout", with = "humantime_serde")]
    pub default_call_timeout: Duration,
    /// How long one base image download (fetch, upload into the host's pool, marker) may
    /// take. It runs detached from the Create that started it, so a Create whose own
    /// deadline passes answers "still downloading" and a later one finds the base ready.
    #[serde(default = "default_image_download_timeout", with = "humantime_serde")]
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

/// Durations in humantime's notation (`10s`, `1m 30s`, `2h`).
mod humantime_serde {
    use super::*;

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        d.deserialize_str(DurationVisitor)
    }

    /// Fails inside the YAML deserializer, while it is still at the value: the error then
    /// carries the field's own path and line, not those of the enclosing mapping.
    struct DurationVisitor;

    impl serde::de::Visitor<'_> for DurationVisitor {
        type Value = Duration;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a duration such as \"10s\" or \"1m 30s\"")
        }

        fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Duration, E> {
            humantime::parse_duration(text).map_err(|e| {
                E::custom(format!(
                    "{text:?} is not a duration ({e}); write e.g. \"10s\" or \"1m 30s\""
                ))
            })
        }
    }
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

/// Where a VM's NIC attaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attachment {
    /// A libvirt network.
    Network(String),
    /// A host bridge.
    Bridge(String),
}

impl SshConfig {
    /// The host part and port of `address`.
    pub fn host_and_port(&self) -> Result<(String, u16), String> {
        split_host_port(&self.address)
    }
}

fn split_host_port(address: &str) -> Result<(String, u16), String> {
    let bad_port = |p: &str| format!("port {p:?} is not a number from 1 to 65535");
    if let Some(rest) = address.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| "missing ']' after an IPv6 address".to_owned())?;
        return match after.strip_prefix(':') {
            Some(p) => Ok((host.to_owned(), parse_port(p).ok_or_else(|| bad_port(p))?)),
            None if after.is_empty() => Ok((host.to_owned(), 22)),
            None => Err(format!("unexpected {after:?} after ']'")),
        };
    }
    match address.rsplit_once(':') {
        Some((host, _)) if host.contains(':') => Ok((address.to_owned(), 22)),
        Some((host, p)) => Ok((host.to_owned(), parse_port(p).ok_or_else(|| bad_port(p))?)),
        None => Ok((address.to_owned(), 22)),
    }
}

fn parse_port(p: &str) -> Option<u16> {
    p.parse().ok().filter(|port| *port != 0)
}

impl Config {
    /// Reads, parses and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Self, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::config(vec![ConfigProblem::new(
                "",
                format!(
                    "cannot read config file {}: {e}; pass the path of the agent's YAML config",
                    path.display()
                ),
            )])
        })?;
        let config = Self::parse(&text)?;
        config.validate()?;
        Ok(config)
    }

    /// Parses YAML; unknown fields are errors with their location.
    pub fn parse(text: &str) -> Result<Self, Error> {
        serde_norway::from_str(text).map_err(|e| {
            let field = e
                .location()
                .map(|l| format!("line {} column {}", l.line(), l.column()))
                .unwrap_or_default();
            Error::config(vec![ConfigProblem::new(field, e.to_string())])
        })
    }

    /// Every semantic check; all problems are reported together.
    pub fn validate(&self) -> Result<(), Error> {
        let mut problems = Vec::new();
        let mut p =
            |field: String, message: String| problems.push(ConfigProblem::new(field, message));
        if self.hosts.is_empty() {
            p(
                "hosts".into(),
                "no hosts configured; add at least one hypervisor".into(),
            );
        }
        let mut seen = BTreeMap::new();
        for (i, host) in self.hosts.iter().enumerate() {
            let at = format!("hosts[{i}]");
            if host.name.trim().is_empty() {
                p(
                    format!("{at}.name"),
                    "is empty; give every host a unique name".into(),
                );
            } else if let Some(first) = seen.insert(host.name.clone(), i) {
                p(
                    format!("{at}.name"),
                    format!(
                        "{:?} is also the name of hosts[{first}]; names must be unique",
                        host.name
                    ),
                );
            }
            validate_host(host, &at, &mut p);
            for (field, name) in [
                ("name", Some(&host.name)),
                ("network", host.network.as_ref()),
                ("bridge", host.bridge.as_ref()),
            ] {
                if let Some(message) = name.and_then(|n| not_xml_safe(n)) {
                    p(format!("{at}.{field}"), message);
                }
            }
        }
        for (name, machine) in &self.machine_types {
            let at = format!("machineTypes.{}", name.escape_debug());
            if let Some(message) = not_xml_safe(name) {
                p(at.clone(), message);
            }
            if machine.vcpus == 0 {
                p(format!("{at}.vcpus"), "must be at least 1".into());
            }
            if machine.memory_mib < 128 {
                p(
                    format!("{at}.memoryMiB"),
                    "must be at least 128 (MiB)".into(),
                );
            }
            if machine.disk_gib == 0 {
                p(format!("{at}.diskGiB"), "must be at least 1 (GiB)".into());
            }
        }
        for (name, image) in &self.images {
            let at = format!("images.{}", name.escape_debug());
            if let Some(message) = not_xml_safe(name) {
                p(at.clone(), message);
            }
            if !["http://", "https://", "file://"]
                .iter()
                .any(|s| image.url.starts_with(s))
            {
                p(
                    format!("{at}.url"),
                    format!(
                        "{:?} is not an http://, https:// or file:// URL",
                        crate::images::fetch::redact_url(&image.url)
                    ),
                );
            }
            if let Some(sum) = &image.sha256
                && (sum.len() != 64 || !sum.bytes().all(|b| b.is_ascii_hexdigit()))
            {
                p(
                    format!("{at}.sha256"),
                    "must be 64 hexadecimal digits (the output of sha256sum)".into(),
                );
            }
        }
        let t = &self.transport;
        for (field, value) in [
            ("transport.sshHandshakeTimeout", t.ssh_handshake_timeout),
            ("transport.sshKeepaliveInterval", t.ssh_keepalive_interval),
            (
                "transport.libvirtKeepaliveInterval",
                t.libvirt_keepalive_interval,
            ),
            ("transport.defaultCallTimeout", t.default_call_timeout),
            ("transport.imageDownloadTimeout", t.image_download_timeout),
        ] {
            if value.is_zero() {
                p(field.into(), "must be longer than zero".into());
            }
        }
        if t.libvirt_keepalive_interval.as_secs() == 0 {
            p(
                "transport.libvirtKeepaliveInterval".into(),
                "libvirt counts keepalives in whole seconds; use at least \"1s\"".into(),
            );
        }
        if let Err(message) = check_spool_dir(t.image_spool_dir.as_deref()) {
            p("transport.imageSpoolDir".into(), message);
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(Error::config(problems))
        }
    }

    /// The host named `name`.
    pub fn host(&self, name: &str) -> Option<&HostConfig> {
        self.hosts.iter().find(|h| h.name == name)
    }
}

fn validate_host(host: &HostConfig, at: &str, p: &mut impl FnMut(String, String)) {
    match (&host.ssh, host.local) {
        (Some(_), true) => p(
            format!("{at}.local"),
            "set either `ssh` (remote hypervisor) or `local: true` (agent on the hypervisor), not both"
                .into(),
        ),
        (None, false) => p(
            format!("{at}.ssh"),
            "missing: add an `ssh` block (address, user, privateKey, knownHosts) or set `local: true`"
                .into(),
        ),
        _ => {}
    }
    if host.bridge.is_some() && host.network.is_some() {
        p(
            format!("{at}.bridge"),
            "set either `network` (a libvirt network) or `bridge` (a host bridge), not both".into(),
        );
    }
    if !host.libvirt_socket.is_absolute() {
        p(
            format!("{at}.libvirtSocket"),
            format!("{} is not an absolute path", host.libvirt_socket.display()),
        );
    }
    if host.storage_pool.trim().is_empty() {
        p(
            format!("{at}.storagePool"),
            "is empty; name a libvirt storage pool".into(),
        );
    }
    let Some(ssh) = &host.ssh else {
        return;
    };
    let at = format!("{at}.ssh");
    let host_port = match ssh.host_and_port() {
        Ok(hp) => Some(hp),
        Err(e) => {
            p(format!("{at}.address"), format!("{:?}: {e}", ssh.address));
            None
        }
    };
    if ssh.user.trim().is_empty() {
        p(
            format!("{at}.user"),
            "is empty; name the remote SSH user".into(),
        );
    }
    if let Err(e) = crate::transport::ssh::keys::load_private_key(&ssh.private_key) {
        p(format!("{at}.privateKey"), e);
    }
    match (&ssh.known_hosts, ssh.insecure_skip_host_key_verification) {
        (Some(_), true) => p(
            format!("{at}.insecureSkipHostKeyVerification"),
            "set together with knownHosts; remove one (verification is either on or off)".into(),
        ),
        (None, false) => p(
            format!("{at}.knownHosts"),
            "missing: point it to a known_hosts file with the hypervisor's host key \
             (e.g. from `ssh-keyscan`, checked against the host's fingerprint)"
                .into(),
        ),
        (Some(path), false) => {
            let checked = match host_port {
                Some((h, port)) => {
                    crate::transport::ssh::known_hosts::check_file_lists_host(path, &h, port)
                }
                None => std::fs::read(path)
                    .map(drop)
                    .map_err(|e| format!("cannot read known_hosts {}: {e}", path.display())),
            };
            if let Err(e) = checked {
                p(format!("{at}.knownHosts"), e);
            }
        }
        (None, true) => {}
    }
}

/// Why `name` cannot go into a domain's XML unchanged, if it cannot. Host, network,
/// bridge, machine type and image names are written into every domain the agent
/// defines (the NIC and the placement record); XML normalises tabs and line breaks in
/// attributes and cannot carry most other control characters, so such a name would
/// come back different (or the definition would fail) at the first Create. The rule
/// is the one the agent applies to a request's name and tags.
fn not_xml_safe(name: &str) -> Option<String> {
    name.chars()
        .find(|c| c.is_control() || matches!(c, '\u{FFFE}' | '\u{FFFF}'))
        .map(|c| {
            format!(
                "contains the control character U+{:04X}, which libvirt's XML cannot keep; \
                 remove it",
                u32::from(c)
            )
        })
}

/// The spool directory (`configured`, else the system temp dir) must take a file: an image
/// served without `Content-Length` is staged there, and on a read-only root filesystem
/// without a writable `TMPDIR` every such download would fail.
fn check_spool_dir(configured: Option<&Path>) -> Result<(), String> {
    let (dir, what) = match configured {
        Some(dir) => (dir.to_owned(), String::new()),
        None => (
            std::env::temp_dir(),
            " (the default: the system temp dir, TMPDIR)".to_owned(),
        ),
    };
    // The same unnamed file a download spools to; gone when closed.
    tempfile::tempfile_in(&dir).map(drop).map_err(|e| {
        format!(
            "cannot create a file in {}{what}: {e}; images served without Content-Length are \
             staged there: point transport.imageSpoolDir at a writable directory (e.g. a \
             mounted scratch volume) with room for one image",
            dir.display()
        )
    })
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
mod tests {
    use super::*;

    #[test]
    fn addresses_split_into_host_and_port() {
        assert_eq!(split_host_port("hv1").unwrap(), ("hv1".into(), 22));
        assert_eq!(split_host_port("hv1:2222").unwrap(), ("hv1".into(), 2222));
        assert_eq!(split_host_port("[::1]:2222").unwrap(), ("::1".into(), 2222));
        assert_eq!(split_host_port("[::1]").unwrap(), ("::1".into(), 22));
        assert_eq!(split_host_port("fe80::1").unwrap(), ("fe80::1".into(), 22));
        assert!(split_host_port("hv1:0").is_err());
        assert!(split_host_port("hv1:ssh").is_err());
    }

    #[test]
    fn local_host_gets_user_facing_defaults() {
        let config = Config::parse("hosts:\n- name: here\n  local: true\n").unwrap();
        config.validate().unwrap();
        let host = &config.hosts[0];
        assert_eq!(host.libvirt_socket, Path::new(DEFAULT_LIBVIRT_SOCKET));
        assert_eq!(host.storage_pool, "default");
        assert_eq!(host.domain_type, DomainType::Auto);
        assert_eq!(host.attachment(), Attachment::Network("default".into()));
        assert_eq!(
            config.transport.default_call_timeout,
            Duration::from_secs(30)
        );
        assert_eq!(
            config.transport.image_download_timeout,
            Duration::from_secs(3600)
        );
        assert_eq!(config.transport.image_spool_dir, None);
    }

    #[test]
    fn image_defaults_are_qcow2_and_uefi() {
        let config = Config::parse(
            "hosts: [{name: here, local: true}]\nimages:\n  debian:\n    url: https://example.org/d.qcow2\n",
        )
        .unwrap();
        let image = &config.images["debian"];
        assert_eq!(image.format, ImageFormat::Qcow2);
        assert_eq!(image.firmware, Firmware::Uefi);
    }

    #[test]
    fn unknown_field_is_rejected_with_its_location() {
        let err = Config::parse("hosts:\n- name: here\n  local: true\n  storagepool: x\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown field `storagepool`"), "{err}");
        assert!(err.contains("line 4"), "{err}");
    }

    #[test]
    fn all_problems_are_reported_with_their_field() {
        let config = Config::parse(
            "hosts:\n\
             - name: a\n  local: true\n  network: n\n  bridge: b\n\
             - name: a\n\
             - name: c\n  ssh: {address: 'c:99999', user: u, privateKey: /nonexistent/key, knownHosts: /nonexistent/kh}\n\
             machineTypes:\n  tiny: {vcpus: 0, memoryMiB: 64, diskGiB: 0}\n\
             images:\n  x: {url: ftp://x, sha256: abc}\n",
        )
        .unwrap();
        let err = config.validate().unwrap_err().to_string();
        for field in [
            "hosts[0].bridge",
            "hosts[1].name",
            "hosts[1].ssh",
            "hosts[2].ssh.address",
            "hosts[2].ssh.privateKey",
            "hosts[2].ssh.knownHosts",
            "machineTypes.tiny.vcpus",
            "machineTypes.tiny.memoryMiB",
            "machineTypes.tiny.diskGiB",
            "images.x.url",
            "images.x.sha256",
        ] {
            assert!(err.contains(field), "{field} missing from:\n{err}");
        }
        assert!(err.contains("/nonexistent/key"), "{err}");
    }

    #[test]
    fn names_that_xml_cannot_keep_are_refused_with_their_field() {
        let config = Config::parse(
            "hosts:\n\
             - {name: \"hv\\n1\", local: true, network: \"net\\x7f\"}\n\
             - {name: hv2, local: true, bridge: \"br\\t0\"}\n\
             machineTypes: {\"small\\r\": {vcpus: 1, memoryMiB: 512, diskGiB: 1}}\n\
             images: {\"deb\\0\": {url: 'https://example.org/d.qcow2'}}\n",
        )
        .unwrap();
        let Error::Config { problems } = config.validate().unwrap_err() else {
            panic!("not a config error");
        };
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "hosts[0].name",
                "hosts[0].network",
                "hosts[1].bridge",
                "machineTypes.small\\r",
                "images.deb\\0"
            ]
        );
        assert!(
            problems[0].message.contains("U+000A"),
            "{}",
            problems[0].message
        );
    }

    #[test]
    fn image_urls_are_shown_without_credentials() {
        let config = Config::parse(
            "hosts: [{name: here, local: true}]\n\
             images:\n  x: {url: 'ftp://user:hunter2@example.org/x?sig=s3cr3t'}\n",
        )
        .unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("images.x.url"), "{err}");
        assert!(err.contains("ftp://…@example.org/x?…"), "{err}");
        let debug = format!("{:?}", config.images["x"]);
        for secret in ["hunter2", "s3cr3t", "user"] {
            assert!(!err.contains(secret), "{err}");
            assert!(!debug.contains(secret), "{debug}");
        }
        assert!(debug.contains("example.org"), "{debug}");
    }

    #[test]
    fn a_spool_dir_that_cannot_take_a_file_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let config = Config::parse(&format!(
            "hosts: [{{name: here, local: true}}]\ntransport: {{imageSpoolDir: {}}}\n",
            file.join("spool").display()
        ))
        .unwrap();
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("transport.imageSpoolDir"), "{err}");
        assert!(err.contains("writable directory"), "{err}");
        check_spool_dir(Some(dir.path())).unwrap();
    }

    #[test]
    fn durations_are_human_readable() {
        let config = Config::parse(
            "hosts: [{name: here, local: true}]\ntransport: {defaultCallTimeout: 1m 30s}\n",
        )
        .unwrap();
        assert_eq!(
            config.transport.default_call_timeout,
            Duration::from_secs(90)
        );
        let config = Config::parse(
            "hosts: [{name: here, local: true}]\n\
             transport: {imageDownloadTimeout: 2h, imageSpoolDir: /scratch}\n",
        )
        .unwrap();
        assert_eq!(
            config.transport.image_download_timeout,
            Duration::from_secs(7200)
        );
        assert_eq!(
            config.transport.image_spool_dir.as_deref(),
            Some(Path::new("/scratch"))
        );
        let err = Config::parse("hosts: []\ntransport: {defaultCallTimeout: soon}\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not a duration"), "{err}");
    }

    #[test]
    fn a_bad_duration_names_its_own_field_and_line() {
        let text = "hosts: [{name: here, local: true}]\n\
                    transport:\n\
                    \x20 sshHandshakeTimeout: 5s\n\
                    \x20 sshKeepaliveMax: 3\n\
                    \x20 defaultCallTimeout: 5 parsecs\n\
                    \x20 imageDownloadTimeout: 1h\n";
        assert_eq!(text.lines().nth(4), Some("  defaultCallTimeout: 5 parsecs"));
        let err = Config::parse(text).unwrap_err().to_string();
        assert!(err.contains("transport.defaultCallTimeout"), "{err}");
        assert!(err.contains("line 5"), "{err}");
        assert!(!err.contains("line 4"), "{err}");
        assert!(err.contains("\"5 parsecs\" is not a duration"), "{err}");
        // A value that is not even a string says what it wanted.
        let err = Config::parse("hosts: []\ntransport:\n  sshKeepaliveInterval: [1]\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("transport.sshKeepaliveInterval"), "{err}");
        assert!(err.contains("line 3"), "{err}");
        assert!(err.contains("a duration such as"), "{err}");
    }
}
