//! What the benchmarks share: sample statistics, verdict lines, the agent's config for a
//! fixture host (over SSH and in local mode), and the `ssh` wrapper libvirt's own
//! `qemu+ssh://` baseline runs.

#![allow(dead_code, unreachable_pub)]

use std::path::Path;
use std::time::Duration;

use egressproxy_integration::libvirtd::Libvirtd;
use egressproxy_integration::sshd::Sshd;
use kvm_agent::config::{Config, DomainType, HostConfig, SshConfig, TransportConfig};

/// The `p` quantile (0.0 to 1.0) of `samples`, nearest rank; zero when there are none.
pub fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The median of `samples`.
pub fn median(samples: &[Duration]) -> Duration {
    percentile(samples, 0.5)
}

/// The targets a benchmark checks: each prints a `=> what  target ...  MET|MISSED`
/// line, and [`Targets::finish`] fails the run when one was missed, so a missed target
/// cannot pass unnoticed in a script or CI.
#[derive(Debug, Default)]
pub struct Targets {
    missed: Vec<String>,
}

impl Targets {
    /// Prints the verdict on `what` against `target`, and records it when missed.
    pub fn check(&mut self, what: &str, target: &str, ok: bool) {
        println!(
            "   => {what:<50} target {target:<9} {}",
            if ok { "MET" } else { "MISSED" }
        );
        if !ok {
            self.missed.push(format!("{what} (target {target})"));
        }
    }

    /// An error naming every missed target, if any.
    pub fn finish(self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.missed.is_empty(),
            "target missed: {}",
            self.missed.join("; ")
        );
        Ok(())
    }
}

/// Two hosts on `libvirtd`: `ssh` through `sshd` and `local` on its socket, with
/// `storage_pool`, `network` and a default call timeout of `call_timeout`.
pub fn ssh_and_local_config(
    sshd: &Sshd,
    libvirtd: &Libvirtd,
    storage_pool: &str,
    network: Option<&str>,
    call_timeout: Duration,
) -> Config {
    let host = |name: &str, ssh: Option<SshConfig>| HostConfig {
        name: name.to_owned(),
        local: ssh.is_none(),
        ssh,
        libvirt_socket: libvirtd.socket(),
        storage_pool: storage_pool.to_owned(),
        network: network.map(str::to_owned),
        bridge: None,
        static_addresses: None,
        domain_type: DomainType::Qemu,
        zone: None,
        capacity: Default::default(),
    };
    Config {
        hosts: vec![
            host(
                "ssh",
                Some(SshConfig {
                    address: sshd.address(),
                    user: sshd.user().to_owned(),
                    private_key: sshd.client_key(),
                    known_hosts: Some(sshd.known_hosts()),
                    insecure_skip_host_key_verification: false,
                }),
            ),
            host("local", None),
        ],
        machine_types: Default::default(),
        images: Default::default(),
        transport: TransportConfig {
            default_call_timeout: call_timeout,
            ..TransportConfig::default()
        },
    }
}

/// An `ssh` that libvirt's `command=` runs: strict host keys from the fixture's
/// known_hosts and its client key, so the baseline verifies the host like the agent does.
pub fn write_ssh_wrapper(path: &Path, sshd: &Sshd) -> anyhow::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let script = format!(
        "#!/bin/sh\nexec ssh -o UserKnownHostsFile={} -o StrictHostKeyChecking=yes -o BatchMode=yes \
         -o IdentitiesOnly=yes -i {} \"$@\"\n",
        sshd.known_hosts().display(),
        sshd.client_key().display()
    );
    std::fs::write(path, script)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))?;
    Ok(())
}
