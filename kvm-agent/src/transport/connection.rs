//! One libvirt connection and the relay under it.
//!
//! [`Connection::open`] binds a relay ([`Forward`]), opens `virt::Connect` on it on a
//! blocking thread under the caller's deadline, and turns libvirt keepalive on. Guarantees:
//! - The open is bounded: on expiry the relay is aborted, so the blocked open returns.
//! - Dropping a `Connection` never blocks the async runtime: the relay is aborted first
//!   (so `virConnectClose` cannot wait on a stalled peer) and the `virt::Connect` is
//!   released on a short-lived thread of its own, where a panic in `virt`'s `Drop` (a
//!   failed free) is contained.

use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Mutex;

use tokio::time::Instant;

use crate::config::TransportConfig;
use crate::transport::error::TransportError;
use crate::transport::event_loop;
use crate::transport::libvirt_error::classify_libvirt;
use crate::transport::relay::{Forward, Upstream};

/// An open libvirt connection; share it with `Arc`.
#[derive(Debug)]
pub struct Connection {
    id: u64,
    host: String,
    connect: Option<virt::connect::Connect>,
    forward: Forward,
    cut_because: Mutex<Option<String>>,
}

impl Connection {
    /// Opens a connection to `upstream` through a relay bound at `socket`.
    pub async fn open(
        host: &str,
        id: u64,
        socket: PathBuf,
        upstream: Upstream,
        transport: &TransportConfig,
        deadline: Instant,
    ) -> Result<Self, TransportError> {
        event_loop::ensure_started().map_err(|reason| TransportError::Worker {
            host: host.to_owned(),
            op: "virEventRegisterDefaultImpl",
            reason,
        })?;
        let started = Instant::now();
        let forward = Forward::listen(socket, upstream)?;
        let uri = forward.uri();
        let interval =
            i32::try_from(transport.libvirt_keepalive_interval.as_secs()).unwrap_or(i32::MAX);
        let count = transport.libvirt_keepalive_count;
        let task = tokio::task::spawn_blocking(move || {
            let connect = virt::connect::Connect::open(Some(&uri))?;
            connect.set_keep_alive(interval, count)?;
            Ok::<_, virt::error::Error>(connect)
        });
        match tokio::time::timeout_at(deadline, task).await {
            Err(_) => {
                // The open returns once its relay is gone; its result is dropped on the
                // blocking thread, never here.
                forward.abort();
                Err(TransportError::DeadlineExceeded {
                    host: host.to_owned(),
                    op: "virConnectOpen",
                    after: deadline.saturating_duration_since(started),
                })
            }
            Ok(Err(join)) => Err(TransportError::Worker {
                host: host.to_owned(),
                op: "virConnectOpen",
                reason: join.to_string(),
            }),
            Ok(Ok(Err(e))) => {
                forward.abort();
                Err(forward
                    .upstream_error()
                    .unwrap_or_else(|| TransportError::Libvirt {
                        host: host.to_owned(),
                        op: "virConnectOpen",
                        failure: classify_libvirt(&e, false),
                    }))
            }
            Ok(Ok(Ok(connect))) => Ok(Self {
                id,
                host: host.to_owned(),
                connect: Some(connect),
                forward,
                cut_because: Mutex::new(None),
            }),
        }
    }

    /// The libvirt connection. Use it only on a blocking thread.
    pub fn libvirt(&self) -> &virt::connect::Connect {
        self.connect
            .as_ref()
            .expect("a Connection holds its Connect until dropped")
    }

    /// The connection's number within its host (for spans and logs).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The host this connection leads to.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// False once the relay has ended: the connection is dead and must be replaced.
    pub(crate) fn is_usable(&self) -> bool {
        !self.forward.is_finished()
    }

    /// Cuts the relay so every call blocked on this connection returns now; `cause` is
    /// what the other calls on it are told.
    pub fn cut(&self, cause: String) {
        self.cut_because
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(cause);
        self.forward.abort();
    }

    /// Why the connection was cut, if [`Connection::cut`] was called.
    pub(crate) fn cut_because(&self) -> Option<String> {
        self.cut_because
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Why the relay's upstream failed, if it did (taken once).
    pub fn upstream_error(&self) -> Option<TransportError> {
        self.forward.upstream_error()
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.forward.abort();
        if let Some(connect) = self.connect.take() {
            let spawned = std::thread::Builder::new()
                .name("libvirt-close".into())
                .spawn(move || {
                    let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(connect)));
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, host = self.host, "cannot start a thread to close a libvirt connection; closing it here");
            }
        }
    }
}
