//! Per-host libvirt connections: reused, redialled, isolated.
//!
//! A [`Pool`] holds one [`HostPool`] per configured host. Guarantees:
//! 1. **Reuse.** A host's cheap calls share one libvirt connection (libvirt pipelines
//!    concurrent calls on it).
//! 2. **Serialized dials.** At most one dial per host runs at a time; callers that find no
//!    usable connection wait for it (bounded by their own deadline) and then share it.
//! 3. **Isolation.** Hosts share no lock, so a hung host never delays another.
//! 4. **Redial on transport failure only.** A dead relay, a transport error or a deadline
//!    that passes during a call drops the connection and the next call dials anew; an error libvirt reports about the
//!    operation (no such domain, bad XML) keeps it. A link that breaks during the
//!    handshake itself (EOF, broken pipe, a closed socket: the daemon or sshd shed it) is
//!    dialled once more within the caller's deadline before the failure is reported.
//! 5. **Bulk on its own connection and session.** [`HostPool::bulk`] dials a dedicated
//!    libvirt connection for a stream, over a second SSH session of the host. A channel of
//!    its own is not enough: on a shared session (one TCP stream) a cheap call's packets
//!    would queue behind megabytes of upload data in the send buffers.
//! 6. **SSH sessions** (one for calls, one for bulk streams, per host) are reused by every
//!    connection's channel, re-established when closed (peer gone or keepalives
//!    unanswered), with exponential backoff after failures (OpenSSH penalises sources
//!    that fail repeatedly).
//!
//! Every connection's relay socket lives in one private directory (0700), created at
//! start-up under `$KVM_AGENT_RUNTIME_DIR` or the system temp dir (a writable mount on a
//! read-only root filesystem) and removed with the pool.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use tokio::time::Instant;
use tracing::Instrument;

use crate::classification::ErrorClass;
use crate::config::{Config, HostConfig, TransportConfig};
use crate::transport::bulk_runtime;
use crate::transport::call::{self, CallError, CallFailure, LibvirtOp};
use crate::transport::connection::Connection;
use crate::transport::error::TransportError;
use crate::transport::relay::Upstream;
use crate::transport::ssh::SshSession;

/// Unix socket paths are limited to 108 bytes including the terminator.
const MAX_SOCKET_PATH: usize = 100;
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// 100 ms after the first failed dial, doubling up to 10 s, for as long as dials fail.
const REDIAL_BACKOFF: ExponentialBuilder = ExponentialBuilder::new()
    .with_min_delay(Duration::from_millis(100))
    .with_max_delay(BACKOFF_MAX)
    .without_max_times();

/// Connections to every configured host.
#[derive(Debug)]
pub struct Pool {
    hosts: BTreeMap<String, Arc<HostPool>>,
    transport: TransportConfig,
    _dir: Arc<tempfile::TempDir>,
}

impl Pool {
    /// Creates the private relay directory and an idle pool per host; dials nothing yet.
    pub fn new(config: &Config) -> Result<Self, TransportError> {
        let base = std::env::var_os("KVM_AGENT_RUNTIME_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = tempfile::Builder::new()
            .prefix("kvm-agent-")
            .tempdir_in(&base)
            .map_err(|e| {
                TransportError::io(format!("create private directory in {}", base.display()), e)
            })?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700))
            .map_err(|e| TransportError::io(format!("chmod 0700 {}", dir.path().display()), e))?;
        let longest = dir.path().join(format!("c{}.sock", u64::MAX));
        if longest.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(TransportError::io(
                format!(
                    "private directory {} is too long for unix sockets; set KVM_AGENT_RUNTIME_DIR to a short path",
                    dir.path().display()
                ),
                std::io::Error::from(std::io::ErrorKind::InvalidInput),
            ));
        }
        let dir = Arc::new(dir);
        let hosts = config
            .hosts
            .iter()
            .map(|host| {
                let pool = HostPool::new(host.clone(), config.transport.clone(), dir.clone());
                (host.name.clone(), Arc::new(pool))
            })
            .collect();
        Ok(Self {
            hosts,
            transport: config.transport.clone(),
            _dir: dir,
        })
    }

    /// The pool of host `name`.
    pub fn host(&self, name: &str) -> Result<Arc<HostPool>, TransportError> {
        self.hosts
            .get(name)
            .cloned()
            .ok_or_else(|| TransportError::UnknownHost {
                host: name.to_owned(),
            })
    }

    /// Names of all configured hosts.
    pub fn host_names(&self) -> impl Iterator<Item = &str> {
        self.hosts.keys().map(String::as_str)
    }

    /// `now + transport.defaultCallTimeout`: the deadline of a call whose caller set none.
    pub fn default_deadline(&self) -> Instant {
        Instant::now() + self.transport.default_call_timeout
    }
}

#[derive(Debug, Default)]
struct SessionSlot {
    session: Option<Arc<SshSession>>,
    /// The delays before the next dials, while they fail; `None` after a success.
    backoff: Option<ExponentialBackoff>,
    retry_at: Option<Instant>,
    last_error: Option<(String, ErrorClass)>,
}

/// What a connection is for; bulk streams get their own SSH session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Calls,
    Bulk,
}

#[derive(Debug, Default)]
struct SessionState {
    calls: SessionSlot,
    bulk: SessionSlot,
}

/// Connections to one host. See the module docs.
#[derive(Debug)]
pub struct HostPool {
    config: HostConfig,
    transport: TransportConfig,
    dir: Arc<tempfile::TempDir>,
    shared: Mutex<Option<Arc<Connection>>>,
    dial: tokio::sync::Mutex<SessionState>,
    next_id: AtomicU64,
}

impl HostPool {
    fn new(config: HostConfig, transport: TransportConfig, dir: Arc<tempfile::TempDir>) -> Self {
        Self {
            config,
            transport,
            dir,
            shared: Mutex::new(None),
            dial: tokio::sync::Mutex::new(SessionState::default()),
            next_id: AtomicU64::new(1),
        }
    }

    /// The host's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The host's configuration.
    pub fn config(&self) -> &HostConfig {
        &self.config
    }

    /// Runs a libvirt call on the host's shared connection; see [`call`].
    ///
    /// `E` is the calling layer's error type: the closure fails with it, and the
    /// transport's own failures are converted into it.
    pub async fn call<T, E, F>(&self, op: LibvirtOp, deadline: Instant, call: F) -> Result<T, E>
    where
        F: FnOnce(&virt::connect::Connect) -> Result<T, CallFailure<E>> + Send + 'static,
        T: Send + 'static,
        E: CallError,
    {
        let api = op.api;
        call::traced(self.name(), &op, async move {
            let connection = self.shared_connection(deadline).await?;
            let outcome = call::run(&connection, api, deadline, call).await;
            if outcome.discard {
                self.discard(&connection);
            }
            outcome.result
        })
        .await
    }

    /// Runs a call on a dedicated connection that is closed afterwards (streams, uploads).
    ///
    /// The dial, the relay and the call run on the low-priority [`bulk_runtime`]; dropping
    /// the returned future aborts them (the relay is cut, so the libvirt call returns).
    pub async fn bulk<T, E, F>(
        self: &Arc<Self>,
        op: LibvirtOp,
        deadline: Instant,
        call: F,
    ) -> Result<T, E>
    where
        F: FnOnce(&virt::connect::Connect) -> Result<T, CallFailure<E>> + Send + 'static,
        T: Send + 'static,
        E: CallError,
    {
        let api = op.api;
        let this = self.clone();
        call::traced(self.name(), &op, async move {
            let host = this.name().to_owned();
            let work = async move {
                let connection = Arc::new(this.dial(deadline, Purpose::Bulk).await?);
                call::run(&connection, api, deadline, call).await.result
            }
            .in_current_span();
            let Some(runtime) = bulk_runtime::handle() else {
                return work.await;
            };
            let mut task = AbortOnDrop(runtime.spawn(work));
            (&mut task.0).await.unwrap_or_else(|join| {
                Err(TransportError::Worker {
                    host,
                    op: api,
                    reason: join.to_string(),
                }
                .into())
            })
        })
        .await
    }

    /// The shared connection, dialled if there is none or it is dead.
    async fn shared_connection(
        &self,
        deadline: Instant,
    ) -> Result<Arc<Connection>, TransportError> {
        if let Some(connection) = self.usable_shared() {
            return Ok(connection);
        }
        let mut state = self.lock_dial(deadline).await?;
        // Another caller may have dialled while this one waited.
        if let Some(connection) = self.usable_shared() {
            return Ok(connection);
        }
        let connection = Arc::new(
            self.dial_locked(&mut state, deadline, Purpose::Calls)
                .await?,
        );
        *self.shared.lock().unwrap_or_else(|p| p.into_inner()) = Some(connection.clone());
        Ok(connection)
    }

    fn usable_shared(&self) -> Option<Arc<Connection>> {
        let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        match shared.as_ref() {
            Some(connection) if connection.is_usable() => Some(connection.clone()),
            Some(_) => {
                *shared = None;
                None
            }
            None => None,
        }
    }

    /// Drops `connection` from the pool (if it is the shared one) and cuts its relay.
    fn discard(&self, connection: &Arc<Connection>) {
        connection.cut("a transport failure".to_owned());
        let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        if shared.as_ref().is_some_and(|c| Arc::ptr_eq(c, connection)) {
            *shared = None;
        }
    }

    async fn lock_dial(
        &self,
        deadline: Instant,
    ) -> Result<tokio::sync::MutexGuard<'_, SessionState>, TransportError> {
        let waited_from = Instant::now();
        tokio::time::timeout_at(deadline, self.dial.lock())
            .await
            .map_err(|_| TransportError::DeadlineExceeded {
                host: self.name().to_owned(),
                op: "virConnectOpen",
                after: deadline.saturating_duration_since(waited_from),
            })
    }

    async fn dial(
        &self,
        deadline: Instant,
        purpose: Purpose,
    ) -> Result<Connection, TransportError> {
        let mut state = self.lock_dial(deadline).await?;
        self.dial_locked(&mut state, deadline, purpose).await
    }

    async fn dial_locked(
        &self,
        state: &mut SessionState,
        deadline: Instant,
        purpose: Purpose,
    ) -> Result<Connection, TransportError> {
        let slot = match purpose {
            Purpose::Calls => &mut state.calls,
            Purpose::Bulk => &mut state.bulk,
        };
        let mut fresh_tries_left = 1;
        loop {
            let upstream = match &self.config.ssh {
                Some(_) => Upstream::Ssh {
                    session: self.session(slot, purpose, deadline).await?,
                    remote_socket: self.config.libvirt_socket.clone(),
                },
                None => Upstream::Local {
                    host: self.name().to_owned(),
                    socket: self.config.libvirt_socket.clone(),
                },
            };
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            let socket = self.dir.path().join(format!("c{id}.sock"));
            let op = LibvirtOp::new("virConnectOpen");
            let opened = call::traced(self.name(), &op, async {
                tracing::Span::current().record("libvirt.connection", id);
                Connection::open(self.name(), id, socket, upstream, &self.transport, deadline).await
            })
            .await;
            match opened {
                // The link broke mid-handshake: a busy daemon or sshd shedding one
                // connection, not a host that is down. libvirt reports the same shed as a
                // system error (EOF, broken pipe) or an internal one ("client socket is
                // closed") depending on which side noticed first, so any transport failure
                // of the open qualifies. One fresh link spares the caller a failed
                // operation; a second break is reported.
                Err(TransportError::Libvirt { failure, .. })
                    if failure.transport && fresh_tries_left > 0 && Instant::now() < deadline =>
                {
                    fresh_tries_left -= 1;
                    tracing::info!(
                        host = self.name(),
                        error = %failure.message,
                        "libvirt connection broke while opening; dialling once more"
                    );
                }
                other => return other,
            }
        }
    }

    /// The host's SSH session, connected (with backoff after failures) if needed.
    async fn session(
        &self,
        state: &mut SessionSlot,
        purpose: Purpose,
        deadline: Instant,
    ) -> Result<Arc<SshSession>, TransportError> {
        if let Some(session) = &state.session
            && !session.is_closed()
        {
            return Ok(session.clone());
        }
        state.session = None;
        let ssh = self
            .config
            .ssh
            .as_ref()
            .ok_or_else(|| TransportError::UnknownHost {
                host: self.name().to_owned(),
            })?;
        let started = Instant::now();
        if let Some(retry_at) = state.retry_at {
            // Fail fast rather than spend the caller's whole deadline waiting.
            if retry_at > deadline {
                let last = state
                    .last_error
                    .clone()
                    .unwrap_or((String::new(), ErrorClass::Transient));
                return Err(TransportError::SshBackingOff {
                    host: self.name().to_owned(),
                    retry_in: retry_at.saturating_duration_since(started),
                    last_error: last.0,
                    last_class: last.1,
                });
            }
            tokio::time::sleep_until(retry_at).await;
        }
        let span = tracing::info_span!(
            "ssh",
            otel.name = "ssh.connect",
            ssh.host = self.name(),
            ssh.address = %ssh.address,
            ssh.user = %ssh.user,
            ssh.purpose = match purpose {
                Purpose::Calls => "calls",
                Purpose::Bulk => "bulk",
            },
        );
        let connect = SshSession::connect(self.name(), ssh, &self.transport).instrument(span);
        let result = match tokio::time::timeout_at(deadline, connect).await {
            Ok(result) => result,
            Err(_) => Err(TransportError::DeadlineExceeded {
                host: self.name().to_owned(),
                op: "ssh connect",
                after: deadline.saturating_duration_since(started),
            }),
        };
        crate::metrics::global().ssh_connect(self.name(), result.is_ok());
        match result {
            Ok(session) => {
                let session = Arc::new(session);
                *state = SessionSlot {
                    session: Some(session.clone()),
                    backoff: None,
                    retry_at: None,
                    last_error: None,
                };
                Ok(session)
            }
            Err(e) => {
                let backoff = state
                    .backoff
                    .get_or_insert_with(|| REDIAL_BACKOFF.build())
                    .next()
                    .unwrap_or(BACKOFF_MAX);
                state.retry_at = Some(Instant::now() + backoff);
                state.last_error = Some((e.to_string(), e.class()));
                tracing::warn!(host = self.name(), error = %e, retry_in = ?backoff, "SSH connect failed");
                Err(e)
            }
        }
    }

    /// `virConnectGetLibVersion`: a cheap round trip that proves the host is reachable.
    pub async fn lib_version(&self, deadline: Instant) -> Result<u32, TransportError> {
        self.call(LibvirtOp::new("virConnectGetLibVersion"), deadline, |c| {
            Ok(c.lib_version()?)
        })
        .await
    }
}

/// Aborts a spawned task when the future awaiting it is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
