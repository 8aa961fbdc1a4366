//! The one wrapper every libvirt call passes through: traced, off the runtime, bounded.
//!
//! [`run`] executes a closure against a `Connection`:
//! 1. it opens a span named after the libvirt API (`otel.name`, e.g. `virDomainDefineXML`)
//!    with `libvirt.host`, `libvirt.domain`/`libvirt.volume`, `libvirt.bytes`, the
//!    connection number, and on completion `libvirt.duration_ms` and, on failure,
//!    `libvirt.error_code` and an error status. The span is a child of the current span:
//!    the gRPC request span, whose parent comes from the caller's W3C trace context;
//! 2. libvirt calls block and never time out, so the closure runs off the async workers:
//!    on a multi-thread runtime in place, on the caller's thread, which `block_in_place`
//!    turns into a blocking thread while the worker's other tasks move to another (no
//!    hand-off to another thread and back: measured, that hand-off was the largest part
//!    of a cheap call's overhead); on a current-thread runtime on the blocking pool. The
//!    caller's task waits meanwhile, so calls that must overlap (one per host) belong in
//!    separate tasks;
//! 3. the caller's deadline bounds the wait. On expiry the connection's relay is aborted
//!    (by a watchdog task, or by the waiting caller on the blocking-pool path), so the
//!    blocked call returns at once and frees its thread, and the connection is reported
//!    dead ([`Outcome::discard`]). The watchdog and the call's end settle which came
//!    first once, so a call that returned in time never has its connection cut after
//!    it (the next caller would meet the cut). A call whose deadline passed before it
//!    began fails without touching the connection;
//! 4. a failure is classified: an error libvirt reports keeps the connection, a transport
//!    failure (or a relay whose upstream was refused) discards it.
//!
//! The closure should return plain data, not libvirt objects: their `Drop` calls into
//! libvirt and would run wherever the value ends up.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::transport::connection::Connection;
use crate::transport::error::TransportError;
use crate::transport::libvirt_error::classify_libvirt;

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

/// The error a libvirt call ends with: the caller's layer's own error type, which holds
/// the transport's failures ([`TransportError`]) and whatever the layer's closure adds
/// (XML it cannot read, the data of an upload). Each layer picks its own, so the
/// transport never names an error of a layer above it.
pub trait CallError: From<TransportError> + std::fmt::Display + Send + 'static {
    /// The libvirt error code, when libvirt reported the error (for the call's span).
    fn libvirt_code(&self) -> Option<i32>;
}

impl CallError for TransportError {
    fn libvirt_code(&self) -> Option<i32> {
        TransportError::libvirt_code(self)
    }
}

/// Why a closure passed to [`run`] failed; `E` is the calling layer's error type.
#[derive(Debug)]
pub enum CallFailure<E = TransportError> {
    /// libvirt returned an error.
    Libvirt(virt::error::Error),
    /// The agent's side of the call failed (e.g. reading the data to upload, XML it
    /// cannot read).
    Agent(E),
}

impl<E> From<virt::error::Error> for CallFailure<E> {
    fn from(e: virt::error::Error) -> Self {
        Self::Libvirt(e)
    }
}

impl<E> CallFailure<E> {
    /// The same failure, with the agent's side converted into a wider error type (a
    /// layer's closure calling a function of a layer below it).
    pub fn err_into<F: From<E>>(self) -> CallFailure<F> {
        match self {
            Self::Libvirt(e) => CallFailure::Libvirt(e),
            Self::Agent(e) => CallFailure::Agent(e.into()),
        }
    }
}

/// The result of [`run`], and whether the connection must be discarded.
#[derive(Debug)]
pub struct Outcome<T, E> {
    /// The call's result.
    pub result: Result<T, E>,
    /// True when the connection is dead (transport failure, deadline, worker panic).
    pub discard: bool,
}

/// Records completion fields on `span` and logs the call (visible with `-v`).
pub(crate) fn finish_span<T, E: CallError>(span: &Span, started: Instant, result: &Result<T, E>) {
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
pub async fn run<T, E, F>(
    connection: &Arc<Connection>,
    api: &'static str,
    deadline: Instant,
    call: F,
) -> Outcome<T, E>
where
    F: FnOnce(&virt::connect::Connect) -> Result<T, CallFailure<E>> + Send + 'static,
    T: Send + 'static,
    E: CallError,
{
    Span::current().record("libvirt.connection", connection.id());
    let started = Instant::now();
    if started >= deadline {
        // Nothing was sent: the connection is as good as it was.
        return Outcome {
            result: Err(TransportError::DeadlineExceeded {
                host: connection.host().to_owned(),
                op: api,
                after: Duration::ZERO,
            }
            .into()),
            discard: false,
        };
    }
    let joined = if on_multi_thread_runtime() {
        in_place(connection, api, deadline, call)
    } else {
        on_blocking_pool(connection, deadline, call).await
    };
    let host = connection.host().to_owned();
    match joined {
        Err(Joined::DeadlineExceeded) => {
            let after = round_ms(deadline.saturating_duration_since(started));
            connection.cut(format!("{api} exceeded its {after:?} deadline"));
            Outcome {
                result: Err(TransportError::DeadlineExceeded {
                    host,
                    op: api,
                    after,
                }
                .into()),
                discard: true,
            }
        }
        Err(Joined::Panicked(reason)) => Outcome {
            result: Err(TransportError::Worker {
                host,
                op: api,
                reason,
            }
            .into()),
            discard: true,
        },
        Ok((Ok(value), _)) => Outcome {
            result: Ok(value),
            discard: false,
        },
        Ok((Err(CallFailure::Agent(e)), alive)) => Outcome {
            discard: !alive,
            result: Err(e),
        },
        Ok((Err(CallFailure::Libvirt(e)), alive)) => {
            if let Some(upstream) = connection.upstream_error() {
                return Outcome {
                    result: Err(upstream.into()),
                    discard: true,
                };
            }
            if let Some(cause) = connection.cut_because() {
                return Outcome {
                    result: Err(TransportError::ConnectionCut {
                        host,
                        op: api,
                        cause,
                    }
                    .into()),
                    discard: true,
                };
            }
            let failure = classify_libvirt(&e, alive);
            Outcome {
                discard: failure.transport,
                result: Err(TransportError::Libvirt {
                    host,
                    op: api,
                    failure,
                }
                .into()),
            }
        }
    }
}

/// Why a call has no result of its own.
enum Joined {
    /// The deadline passed; the connection has been cut.
    DeadlineExceeded,
    /// The closure panicked (or its thread died): the reason.
    Panicked(String),
}

/// The closure's result and whether the connection is still alive after it.
type Finished<T, E> = (Result<T, CallFailure<E>>, bool);

fn call_and_check<T, E>(
    connect: &virt::connect::Connect,
    call: impl FnOnce(&virt::connect::Connect) -> Result<T, CallFailure<E>>,
) -> Finished<T, E> {
    let result = call(connect);
    // virConnectIsAlive is local (no RPC): it reads the client's socket state.
    let alive = result.is_ok() || connect.is_alive().unwrap_or(false);
    (result, alive)
}

fn on_multi_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

// The states of the race between a call and its watchdog ([`in_place`]): the call
// runs, then either it returned in time or the watchdog fired (and cut it).
const RUNNING: u8 = 0;
const RETURNED: u8 = 1;
const FIRED: u8 = 2;

/// Runs the call on the calling worker thread ([`tokio::task::block_in_place`]: the
/// worker's other tasks move to another thread meanwhile), with a watchdog task that cuts
/// the connection at the deadline so the call returns. No hand-off to another thread and
/// back, which measured 40-100 µs per cheap call on a small machine.
fn in_place<T, E, F>(
    connection: &Arc<Connection>,
    api: &'static str,
    deadline: Instant,
    call: F,
) -> Result<Finished<T, E>, Joined>
where
    F: FnOnce(&virt::connect::Connect) -> Result<T, CallFailure<E>>,
{
    let started = Instant::now();
    // Whichever of the watchdog and the call's end moves the race from RUNNING first
    // wins: the watchdog cuts only a call still running, and such a call's result is
    // the deadline, whatever it returned.
    let race = Arc::new(AtomicU8::new(RUNNING));
    let (watched, watching) = (connection.clone(), race.clone());
    let watchdog = tokio::spawn(async move {
        tokio::time::sleep_until(deadline).await;
        if watching
            .compare_exchange(RUNNING, FIRED, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let after = round_ms(deadline.saturating_duration_since(started));
            watched.cut(format!("{api} exceeded its {after:?} deadline"));
        }
    });
    let finished = tokio::task::block_in_place(|| {
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            call_and_check(connection.libvirt(), call)
        }))
    });
    let in_time = race
        .compare_exchange(RUNNING, RETURNED, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok();
    watchdog.abort();
    match finished {
        Err(panic) => Err(Joined::Panicked(panic_reason(panic.as_ref()))),
        Ok(_) if !in_time => Err(Joined::DeadlineExceeded),
        Ok(finished) => Ok(finished),
    }
}

/// Runs the call on tokio's blocking pool (on a current-thread runtime, where
/// `block_in_place` is not available), bounded by the deadline.
async fn on_blocking_pool<T, E, F>(
    connection: &Arc<Connection>,
    deadline: Instant,
    call: F,
) -> Result<Finished<T, E>, Joined>
where
    F: FnOnce(&virt::connect::Connect) -> Result<T, CallFailure<E>> + Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    let on_thread = connection.clone();
    let task = tokio::task::spawn_blocking(move || call_and_check(on_thread.libvirt(), call))
        .in_current_span();
    match tokio::time::timeout_at(deadline, task).await {
        Err(_) => Err(Joined::DeadlineExceeded),
        Ok(Err(join)) => Err(Joined::Panicked(join.to_string())),
        Ok(Ok(finished)) => Ok(finished),
    }
}

fn panic_reason(panic: &(dyn std::any::Any + Send)) -> String {
    let message = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("no message");
    format!("the libvirt call panicked: {message}")
}

fn round_ms(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis().try_into().unwrap_or(u64::MAX))
}

/// Runs `future` inside `op`'s span and records its completion.
pub(crate) async fn traced<T, E: CallError>(
    host: &str,
    op: &LibvirtOp,
    future: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    let span = op.span(host);
    let started = Instant::now();
    let result = future.instrument(span.clone()).await;
    finish_span(&span, started, &result);
    crate::metrics::global().libvirt_call(host, op.api, result.is_ok(), started.elapsed());
    result
}
