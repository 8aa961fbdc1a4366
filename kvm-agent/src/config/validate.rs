//! [`Config::validate`]: every semantic check of a parsed configuration that needs
//! nothing but the file, collected, each naming its field and what to do. The checks
//! that read the machine are the `startup` module's.

use std::collections::BTreeMap;

use super::error::{ConfigError, ConfigProblem};
use super::{Config, HostConfig, duration};

impl Config {
    /// Every semantic check; all problems are reported together.
    pub fn validate(&self) -> Result<(), ConfigError> {
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
                        super::redact_url(&image.url)
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
        for (field, value, bounds) in [
            (
                "transport.sshHandshakeTimeout",
                t.ssh_handshake_timeout,
                duration::SSH_HANDSHAKE_TIMEOUT,
            ),
            (
                "transport.sshKeepaliveInterval",
                t.ssh_keepalive_interval,
                duration::SSH_KEEPALIVE_INTERVAL,
            ),
            (
                "transport.libvirtKeepaliveInterval",
                t.libvirt_keepalive_interval,
                duration::LIBVIRT_KEEPALIVE_INTERVAL,
            ),
            (
                "transport.defaultCallTimeout",
                t.default_call_timeout,
                duration::DEFAULT_CALL_TIMEOUT,
            ),
            (
                "transport.imageDownloadTimeout",
                t.image_download_timeout,
                duration::IMAGE_DOWNLOAD_TIMEOUT,
            ),
        ] {
            if let Err(message) = bounds.check(value) {
                p(field.into(), message);
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::new(problems))
        }
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
    if let Some(block) = &host.static_addresses {
        if host.bridge.is_none() {
            p(
                format!("{at}.staticAddresses"),
                "is only for a host with a `bridge`: on a libvirt network the network's DHCP \
                 server gives the addresses; remove it or set `bridge`"
                    .into(),
            );
        }
        for (field, message) in block.problems(&format!("{at}.staticAddresses")) {
            p(field, message);
        }
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
    if let Some(zone) = &host.zone {
        if zone.is_empty() || zone.len() > egressproxy_provider::validation::MAX_STRING_BYTES {
            p(
                format!("{at}.zone"),
                format!(
                    "{} bytes: a zone name is 1 to {} bytes (or leave it unset)",
                    zone.len(),
                    egressproxy_provider::validation::MAX_STRING_BYTES
                ),
            );
        } else if let Some(problem) = not_xml_safe(zone) {
            p(format!("{at}.zone"), problem);
        }
    }
    let Some(ssh) = &host.ssh else {
        return;
    };
    let at = format!("{at}.ssh");
    if let Err(e) = ssh.host_and_port() {
        p(format!("{at}.address"), format!("{:?}: {e}", ssh.address));
    }
    if ssh.user.trim().is_empty() {
        p(
            format!("{at}.user"),
            "is empty; name the remote SSH user".into(),
        );
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
        _ => {}
    }
}
