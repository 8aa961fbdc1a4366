//! The caller's `grpc-timeout`, enforced by one tower layer on either side of a call:
//! when it passes, the call ends with DEADLINE_EXCEEDED, never with tonic's own
//! CANCELLED "Timeout expired", which callers would read as a transient cancellation.
//!
//! - **Server** ([`DeadlineLayer::server`], in every [`crate::server::ProviderServer`]):
//!   tonic's server stops a call when its `grpc-timeout` passes, but answers CANCELLED
//!   with no details. This layer sits inside tonic's timer and ends the call slightly
//!   earlier ([`margin`]) with the contract's error and its ErrorInfo, so tonic's timer
//!   never fires first. A provider that bounds its own work by the deadline (and
//!   answers with a more specific reason) gives up earlier still, and its answer passes
//!   through unchanged.
//! - **Client** ([`DeadlineLayer::client`], under every [`crate::client::Client`]): the
//!   caller's interceptor sets the header on every call, so the layer only reads it. Its
//!   clock starts before the call, so it fires no later than the channel's own timer;
//!   should that one fire first anyway, its error is reported as DEADLINE_EXCEEDED too.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::Status;

use crate::ProviderError;

/// Which side of a call the layer guards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Client,
    Server,
}

impl Side {
    /// When the layer ends a call of `timeout` that started at `started`.
    fn deadline(self, started: tokio::time::Instant, timeout: Duration) -> tokio::time::Instant {
        match self {
            Side::Client => started + timeout,
            Side::Server => started + timeout.saturating_sub(margin(timeout)),
        }
    }

    /// The answer of a call whose `timeout` passed.
    fn exceeded(self, timeout: Duration) -> Status {
        match self {
            Side::Client => Status::deadline_exceeded(format!(
                "the provider did not answer within the call's deadline of {timeout:?}"
            )),
            Side::Server => ProviderError::deadline_exceeded(format!(
                "the call's deadline of {} passed before the provider finished: retry with a \
                 longer deadline or later",
                humantime::format_duration(timeout)
            ))
            .to_status(),
        }
    }
}

/// How much earlier than tonic's own timer the server's layer answers. tokio's timers
/// tick in milliseconds, so two milliseconds guarantee an earlier tick; long deadlines
/// get a little more room for the answer to travel.
fn margin(timeout: Duration) -> Duration {
    (timeout / 100).clamp(Duration::from_millis(2), Duration::from_millis(50))
}

/// Adds [`Deadline`] to a service: a server's, or a client's channel.
#[derive(Debug, Clone, Copy)]
pub struct DeadlineLayer {
    side: Side,
}

impl DeadlineLayer {
    /// For a server: answers with the contract's error just before tonic's own timer.
    pub fn server() -> Self {
        Self { side: Side::Server }
    }

    /// For a client's channel: ends the call when its `grpc-timeout` passes.
    pub fn client() -> Self {
        Self { side: Side::Client }
    }
}

impl<S> tower::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Deadline {
            inner,
            side: self.side,
        }
    }
}

/// Ends every call by its `grpc-timeout` with DEADLINE_EXCEEDED (see the module docs).
#[derive(Debug, Clone)]
pub struct Deadline<S> {
    inner: S,
    side: Side,
}

impl<S, B> tower::Service<http::Request<B>> for Deadline<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: std::error::Error + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let timeout = request
            .headers()
            .get("grpc-timeout")
            .and_then(|value| value.to_str().ok())
            .and_then(parse_grpc_timeout);
        let side = self.side;
        let started = tokio::time::Instant::now();
        let call = self.inner.call(request);
        Box::pin(async move {
            let Some(timeout) = timeout else {
                return call.await;
            };
            match tokio::time::timeout_at(side.deadline(started, timeout), call).await {
                Err(_) => Ok(side.exceeded(timeout).into_http()),
                Ok(Err(error)) if is_timeout(&error) => Ok(side.exceeded(timeout).into_http()),
                Ok(result) => result,
            }
        })
    }
}

/// Whether `error` is tonic's own timeout (which it would report as CANCELLED).
fn is_timeout(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        if error.is::<tonic::TimeoutExpired>() {
            return true;
        }
        cause = error.source();
    }
    false
}

/// Parses a `grpc-timeout` header value: up to 8 digits and a unit (H, M, S, m, u, n).
/// Servers use it to bound their own work by the caller's deadline.
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit_and_rejects_garbage() {
        assert_eq!(parse_grpc_timeout("300m"), Some(Duration::from_millis(300)));
        assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("5M"), Some(Duration::from_secs(300)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_grpc_timeout("9n"), Some(Duration::from_nanos(9)));
        for bad in ["", "S", "10", "10x", "123456789S", "-1S", "+1S"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn the_margin_is_at_least_one_timer_tick_and_at_most_fifty_milliseconds() {
        assert_eq!(margin(Duration::from_millis(1)), Duration::from_millis(2));
        assert_eq!(margin(Duration::from_secs(1)), Duration::from_millis(10));
        assert_eq!(margin(Duration::from_secs(60)), Duration::from_millis(50));
    }

    #[test]
    fn only_the_server_answers_early_and_with_error_info() {
        let started = tokio::time::Instant::now();
        let second = Duration::from_secs(1);
        assert_eq!(Side::Client.deadline(started, second), started + second);
        assert_eq!(
            Side::Server.deadline(started, second),
            started + Duration::from_millis(990)
        );
        let server = Side::Server.exceeded(second);
        assert_eq!(server.code(), tonic::Code::DeadlineExceeded);
        assert!(!server.details().is_empty(), "ErrorInfo is in the details");
        assert_eq!(
            ProviderError::from(server).class,
            crate::ErrorClass::DeadlineExceeded
        );
        let client = Side::Client.exceeded(second);
        assert_eq!(client.code(), tonic::Code::DeadlineExceeded);
        assert!(client.details().is_empty(), "{client:?}");
    }
}
