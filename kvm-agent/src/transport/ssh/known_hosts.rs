//! Host key verification against an OpenSSH `known_hosts` file.
//!
//! Lookups use `[host]:port` for ports other than 22 and understand hashed entries
//! (russh's parser); wildcards and `@cert-authority` lines are not supported, so list the
//! hypervisor's key itself. A key of the same algorithm that differs from the recorded one
//! is a *changed* key and always rejected.

use std::path::{Path, PathBuf};

use russh::keys::{HashAlg, PublicKey};

use crate::transport::error::TransportError;

/// How a host's SSH key is verified.
#[derive(Debug, Clone)]
pub(crate) enum HostKeyPolicy {
    /// The key must be listed in this `known_hosts` file.
    KnownHosts(PathBuf),
    /// Any key is accepted (explicit opt-out; warned about at every connect).
    InsecureAcceptAny,
}

/// `SHA256:...` fingerprint of a public key.
pub(crate) fn fingerprint(key: &PublicKey) -> String {
    key.fingerprint(HashAlg::Sha256).to_string()
}

/// Verifies the key `host:port` presented under `policy`.
pub(crate) fn verify(
    policy: &HostKeyPolicy,
    host_name: &str,
    host: &str,
    port: u16,
    key: &PublicKey,
) -> Result<(), TransportError> {
    let path = match policy {
        HostKeyPolicy::InsecureAcceptAny => {
            tracing::warn!(
                host = host_name,
                fingerprint = %fingerprint(key),
                "SSH host key NOT VERIFIED (insecureSkipHostKeyVerification is set): \
                 anyone on the path can impersonate this hypervisor"
            );
            return Ok(());
        }
        HostKeyPolicy::KnownHosts(path) => path,
    };
    match russh::keys::check_known_hosts_path(host, port, key, path) {
        Ok(true) => Ok(()),
        Ok(false) => Err(TransportError::HostKeyUnknown {
            host: host_name.to_owned(),
            fingerprint: fingerprint(key),
            known_hosts: path.clone(),
        }),
        Err(russh::keys::Error::KeyChanged { line }) => Err(TransportError::HostKeyChanged {
            host: host_name.to_owned(),
            fingerprint: fingerprint(key),
            known_hosts: path.clone(),
            line,
        }),
        Err(source) => Err(TransportError::KnownHostsUnreadable {
            host: host_name.to_owned(),
            known_hosts: path.clone(),
            source: Box::new(source),
        }),
    }
}

/// Start-up check: `path` is readable and lists at least one key for `host:port`.
pub(crate) fn check_file_lists_host(path: &Path, host: &str, port: u16) -> Result<(), String> {
    if let Err(e) = std::fs::read(path) {
        return Err(format!("cannot read known_hosts {}: {e}", path.display()));
    }
    let entry = if port == 22 {
        host.to_owned()
    } else {
        format!("[{host}]:{port}")
    };
    match russh::keys::known_hosts::known_host_keys_path(host, port, path) {
        Ok(keys) if !keys.is_empty() => Ok(()),
        Ok(_) => Err(format!(
            "{} has no key for {entry}; add the hypervisor's host key (e.g. \
             `ssh-keyscan -p {port} {host} >> {}`, then compare the fingerprint with \
             `ssh-keygen -lf` on the hypervisor)",
            path.display(),
            path.display()
        )),
        Err(e) => Err(format!("cannot parse known_hosts {}: {e}", path.display())),
    }
}
