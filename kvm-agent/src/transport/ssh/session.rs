//! One authenticated SSH session to a hypervisor.
//!
//! [`SshSession::connect`]:
//! 1. TCP connect, key exchange, host key verification and public-key authentication all
//!    run under one handshake deadline;
//! 2. the host key is checked by [`known_hosts::verify`]; a rejection is reported with the
//!    host's name and the key's fingerprint (russh alone would only say "unknown key");
//! 3. RSA keys sign with rsa-sha2-512/256 (never SHA-1);
//! 4. SSH keepalives run for the session's life: after `sshKeepaliveMax` unanswered ones
//!    russh closes the session, which ends every channel (and so every libvirt connection)
//!    on it.

use std::sync::{Arc, Mutex};

use russh::client::{self, Handle};
use russh::keys::{HashAlg, PrivateKeyWithHashAlg, PublicKeyOrCertificate};
use tokio::net::TcpStream;

use super::keys::{fingerprint, load_private_key};
use super::known_hosts::{self, HostKeyPolicy};
use crate::config::error::{ConfigError, ConfigProblem};
use crate::config::{SshConfig, TransportConfig};
use crate::transport::error::TransportError;

/// An authenticated SSH session; channels are opened on it concurrently.
pub struct SshSession {
    host: String,
    handle: Handle<Verifier>,
    /// Counts the session in `kvm_agent_ssh_sessions` while it lives.
    _open: crate::metrics::OpenSession,
}

impl std::fmt::Debug for SshSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshSession")
            .field("host", &self.host)
            .field("closed", &self.handle.is_closed())
            .finish()
    }
}

struct Verifier {
    host_name: String,
    host: String,
    port: u16,
    policy: HostKeyPolicy,
    /// The detailed rejection, since russh turns `Ok(false)` into a bare `UnknownKey`.
    rejection: Arc<Mutex<Option<TransportError>>>,
}

impl client::Handler for Verifier {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        server_key: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let PublicKeyOrCertificate::PublicKey { key, .. } = server_key else {
            tracing::warn!(
                host = self.host_name,
                "SSH server presented a certificate; only plain host keys are supported"
            );
            return Ok(false);
        };
        match known_hosts::verify(&self.policy, &self.host_name, &self.host, self.port, key) {
            Ok(()) => Ok(true),
            Err(e) => {
                *self.rejection.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                Ok(false)
            }
        }
    }
}

impl SshSession {
    /// Connects and authenticates to `ssh.address` within `transport.ssh_handshake_timeout`.
    pub async fn connect(
        host_name: &str,
        ssh: &SshConfig,
        transport: &TransportConfig,
    ) -> Result<Self, TransportError> {
        let after = transport.ssh_handshake_timeout;
        tokio::time::timeout(after, Self::handshake(host_name, ssh, transport))
            .await
            .unwrap_or_else(|_| {
                Err(TransportError::SshHandshakeTimeout {
                    host: host_name.to_owned(),
                    after,
                })
            })
    }

    async fn handshake(
        host_name: &str,
        ssh: &SshConfig,
        transport: &TransportConfig,
    ) -> Result<Self, TransportError> {
        let (host, port) = ssh.host_and_port().map_err(|e| {
            TransportError::from(ConfigError::new(vec![ConfigProblem::new(
                format!("host {host_name} ssh.address"),
                e,
            )]))
        })?;
        let policy = if ssh.insecure_skip_host_key_verification {
            HostKeyPolicy::InsecureAcceptAny
        } else {
            HostKeyPolicy::KnownHosts(ssh.known_hosts.clone().unwrap_or_default())
        };
        // Read at every dial so a rotated key (a re-mounted Secret) is picked up.
        let key = load_private_key(&ssh.private_key).map_err(|message| {
            TransportError::from(ConfigError::new(vec![ConfigProblem::new(
                format!("host {host_name} ssh.privateKey"),
                message,
            )]))
        })?;

        let tcp = TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|source| TransportError::SshConnect {
                host: host_name.to_owned(),
                address: ssh.address.clone(),
                source,
            })?;
        let _ = tcp.set_nodelay(true);

        let config = Arc::new(client::Config {
            keepalive_interval: Some(transport.ssh_keepalive_interval),
            keepalive_max: transport.ssh_keepalive_max as usize,
            inactivity_timeout: None,
            nodelay: true,
            ..client::Config::default()
        });
        let rejection = Arc::new(Mutex::new(None));
        let verifier = Verifier {
            host_name: host_name.to_owned(),
            host,
            port,
            policy,
            rejection: rejection.clone(),
        };
        let mut handle = match client::connect_stream(config, tcp, verifier).await {
            Ok(handle) => handle,
            Err(source) => {
                let detailed = rejection.lock().unwrap_or_else(|p| p.into_inner()).take();
                return Err(detailed.unwrap_or(TransportError::Ssh {
                    host: host_name.to_owned(),
                    source: Box::new(source),
                }));
            }
        };

        let ssh_err = |source| TransportError::Ssh {
            host: host_name.to_owned(),
            source: Box::new(source),
        };
        let hash = if key.algorithm().is_rsa() {
            let offered = handle.best_supported_rsa_hash().await.map_err(ssh_err)?;
            Some(offered.flatten().unwrap_or(HashAlg::Sha256))
        } else {
            None
        };
        let auth = handle
            .authenticate_publickey(
                ssh.user.clone(),
                PrivateKeyWithHashAlg::new(key.clone(), hash),
            )
            .await
            .map_err(ssh_err)?;
        if !auth.success() {
            return Err(TransportError::SshAuthRejected {
                host: host_name.to_owned(),
                user: ssh.user.clone(),
                key_fingerprint: fingerprint(&key),
            });
        }
        tracing::debug!(host = host_name, address = %ssh.address, user = %ssh.user, "SSH session established");
        Ok(Self {
            host: host_name.to_owned(),
            handle,
            _open: crate::metrics::global().ssh_session_opened(host_name),
        })
    }

    /// The configured name of the host.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Whether the session has ended (closed by either side or by missed keepalives).
    pub(crate) fn is_closed(&self) -> bool {
        self.handle.is_closed()
    }

    /// Opens a `direct-streamlocal@openssh.com` channel to `socket` on the remote host.
    pub(crate) async fn open_streamlocal(
        &self,
        socket: &std::path::Path,
    ) -> Result<russh::Channel<client::Msg>, TransportError> {
        self.handle
            .channel_open_direct_streamlocal(socket.to_string_lossy())
            .await
            .map_err(|e| match e {
                russh::Error::ChannelOpenFailure(reason) => TransportError::ForwardRefused {
                    host: self.host.clone(),
                    socket: socket.to_owned(),
                    reason: format!("{reason:?}"),
                },
                source => TransportError::Ssh {
                    host: self.host.clone(),
                    source: Box::new(source),
                },
            })
    }
}
