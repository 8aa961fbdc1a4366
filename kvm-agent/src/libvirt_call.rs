//! The one wrapper every libvirt call passes through: traced, off the runtime, bounded.
//!
//! [`run`] executes a closure against a [`Connection`]:
//! 1. it opens a span named after the libvirt API (`otel.name`, e.g. `virDomainDefineXML`)
//!    with `libvirt.host`, `libvirt.domain`/`libvirt.volume`, `libvirt.bytes`, the
//!    connection number, and on completion `libvirt.duration_ms` and, on failure,
//!    `libvirt.error_code` and an error status. The span is a child of the current span:
//!    the gRPC request span, whose parent comes from the caller's W3C trace context;
//! 2. the closure runs on the blocking pool, because libvirt calls block and never time
//!    out;
//! 3. the caller's deadline bounds the wait. On expiry the connection's relay is aborted,
//!    so the blocked call returns at once and frees its thread, and the connection is
//!    reported dead ([`Outcome::discard`]);
//! 4. a failure is classified: an error libvirt reports keeps the connection, a transport
//!    failure (or a relay whose upstream was refused) discards it.
//!
//! The closure should return plain data, not libvirt objects: their `Drop` calls into
//! libvirt and would run wherever the value ends up.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::connection::Connection;
use crate::error::{Error, classify_libvirt};

/// What a libvirt call is about, for its span.
#[derive(Debug, Clone, Default)]
pub struct LibvirtOp {
    /// The libvirt C API name, e.g. `virDomainDefineXML`; becomes the span name.
    pub api: &'static str,
    /// Domain name, when the call concerns one.
    pub domain: Option<String>,
    /// Volume name, when the call concerns one.
    pub volume: Option<String>,
    /// Bytes moved, for streams.
    pub bytes: Option<u64>,
}

impl LibvirtOp {
    /// A call of libvirt API `api`.
    pub fn new(api: &'static str) -> Self {
        Self {
            api,
            ..Self::default()
        }
    }

    /// The domain the call concerns.
    pub fn domain(mut self, name: impl Into<String>) -> Self {
        self.domain = Some(name.into());
        self
    }

    /// The volume the call concerns.
    pub fn volume(mut self, name: impl Into<String>) -> Self {
        self.volume = Some(name.into());
        self
    }

    /// The bytes the call moves.
    pub fn bytes(mut self, bytes: u64) -> Self {
        self.bytes = Some(bytes);
        self
    }

    /// The span for this call on `host`; fields filled in on completion are empty.
    pub fn span(&self, host: &str) -> Span {
        tracing::info_span!(
            "libvirt",
            otel.name = self.api,
            otel.status_code = Empty,
            otel.status_description = Empty,
            libvirt.op = self.api,
            libvirt.host = host,
            libvirt.domain = self.domain.as_deref(),
            libvirt.volume = self.volume.as_deref(),
            libvirt.bytes = self.bytes,
            libvirt.connection = Empty,
            libvirt.duration_ms = Empty,
            libvirt.error_code = Empty,
        )
    }
}

/// Why a closure passed to [`run`] failed.
#[derive(Debug)]
pub enum CallFailure {
    /// libvirt returned an error.
    Libvirt(virt::error::Error),
    /// The agent's side of the call failed (e.g. reading the data to upload).
    Agent(Error),
}

impl From<virt::error::Error> for CallFailure {
    fn from(e: virt::error::Error) -> Self {
        Self::Libvirt(e)
    }
}

/// The result of [`run`], and whether the connection must be discarded.
#[derive(Debug)]
pub struct Outcome<T> {
    /// The call's result.
    pub result: Result<T, Error>,
    /// True when the connection is dead (transport failure, deadline, worker panic).
    pub discard: bool,
}

/// Records completion fields on `span` and logs the call (visible with `-v`).
pub fn finish_span<T>(span: &Span, started: Instant, result: &Result<T, Error>) {
    let elapsed = started.elapsed();
    span.record("libvirt.duration_ms", elapsed.as_secs_f64() * 1000.0);
    match result {
        Ok(_) => {
            tracing::debug!(parent: span, duration = ?elapsed, "libvirt call done");
        }
        Err(e) => {
            span.record("otel.status_code", "ERROR");
            span.record("otel.status_description", e.to_string());
            if let Some(code) = e.libvirt_code() {
                span.record("libvirt.error_code", code);
            }
            tracing::debug!(parent: span, duration = ?elapsed, error = %e, "libvirt call failed");
        }
    }
}

/// Runs `call` on `connection` within `deadline`, inside the current span. See the module docs.
pub async fn run<T, F>(
    connection: &Arc<Connection>,
    api: &'static str,
    deadline: Instant,
    call: F,
) -> Outcome<T>
where
    F: FnOnce(&virt::connect::Connect) -> Result<T, CallFailure> + Send + 'static,
    T: Send + 'static,
{
    Span::current().record("libvirt.connection", connection.id());
    let started = Instant::now();
    let on_thread = connection.clone();
    let task = tokio::task::spawn_blocking(move || {
        let result = call(on_thread.libvirt());
        // virConnectIsAlive is local (no RPC): it reads the client's socket state.
        let alive = result.is_ok() || on_thread.libvirt().is_alive().unwrap_or(false);
        (result, alive)
    })
    .in_current_span();
    let host = connection.host().to_owned();
    match tokio::time::timeout_at(deadline, task).await {
        Err(_) => {
            let after = round_ms(deadline.saturating_duration_since(started));
            connection.cut(format!("{api} exceeded its {after:?} deadline"));
            Outcome {
                result: Err(Error::DeadlineExceeded {
                    host,
                    op: api,
                    after,
                }),
                discard: true,
            }
        }
        Ok(Err(join)) => Outcome {
            result: Err(Error::Worker {
                host,
                op: api,
                reason: join.to_string(),
            }),
            discard: true,
        },
        Ok(Ok((Ok(value), _))) => Outcome {
            result: Ok(value),
            discard: false,
        },
        Ok(Ok((Err(CallFailure::Agent(e)), alive))) => Outcome {
            discard: !alive,
            result: Err(e),
        },
        Ok(Ok((Err(CallFailure::Libvirt(e)), alive))) => {
            if let Some(upstream) = connection.upstream_error() {
                return Outcome {
                    result: Err(upstream),
                    discard: true,
                };
            }
            if let Some(cause) = connection.cut_because() {
                return Outcome {
                    result: Err(Error::ConnectionCut {
                        host,
                        op: api,
                        cause,
                    }),
                    discard: true,
                };
            }
            let failure = classify_libvirt(&e, alive);
            Outcome {
                discard: failure.transport,
                result: Err(Error::Libvirt {
                    host,
                    op: api,
                    failure,
                }),
            }
        }
    }
}

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis().try_into().unwrap_or(u64::MAX))
}

/// Runs `future` inside `op`'s span and records its completion.
pub async fn traced<T>(
    host: &str,
    op: &LibvirtOp,
    future: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    let span = op.span(host);
    let started = Instant::now();
    let result = future.instrument(span.clone()).await;
    finish_span(&span, started, &result);
    result
}
