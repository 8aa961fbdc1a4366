//! Server-side enforcement of the caller's `grpc-timeout`.
//!
//! tonic's server already stops a call when its `grpc-timeout` passes, but answers
//! CANCELLED "Timeout expired" with no details: callers would read a transient
//! cancellation, not the contract's DEADLINE_EXCEEDED with ErrorInfo. This layer sits
//! inside tonic's own timer and ends the call slightly earlier ([`margin`]), with the
//! contract's error, so tonic's timer never fires first.
//!
//! A provider that bounds its own work by the deadline (and answers with a more
//! specific reason) gives up earlier still, and its answer passes through unchanged.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::{ProviderError, parse_grpc_timeout};

/// How much earlier than tonic's own timer the layer answers. tokio's timers tick in
/// milliseconds, so two milliseconds guarantee an earlier tick; long deadlines get a
/// little more room for the answer to travel.
fn margin(timeout: Duration) -> Duration {
    (timeout / 100).clamp(Duration::from_millis(2), Duration::from_millis(50))
}

/// Adds [`ServerDeadline`] to every service of a server.
#[derive(Debug, Clone, Copy, Default)]
pub struct ServerDeadlineLayer;

impl<S> tower::Layer<S> for ServerDeadlineLayer {
    type Service = ServerDeadline<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ServerDeadline { inner }
    }
}

/// Ends a call with DEADLINE_EXCEEDED (and ErrorInfo) when its `grpc-timeout` passes.
#[derive(Debug, Clone)]
pub struct ServerDeadline<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for ServerDeadline<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
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
        let started = tokio::time::Instant::now();
        let call = self.inner.call(request);
        Box::pin(async move {
            let Some(timeout) = timeout else {
                return call.await;
            };
            let deadline = started + timeout.saturating_sub(margin(timeout));
            match tokio::time::timeout_at(deadline, call).await {
                Ok(result) => result,
                Err(_) => Ok(deadline_exceeded(timeout).to_status().into_http()),
            }
        })
    }
}

fn deadline_exceeded(timeout: Duration) -> ProviderError {
    ProviderError::deadline_exceeded(format!(
        "the call's deadline of {} passed before the provider finished: retry with a \
         longer deadline or later",
        humantime::format_duration(timeout)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_margin_is_at_least_one_timer_tick_and_at_most_fifty_milliseconds() {
        assert_eq!(margin(Duration::from_millis(1)), Duration::from_millis(2));
        assert_eq!(margin(Duration::from_secs(1)), Duration::from_millis(10));
        assert_eq!(margin(Duration::from_secs(60)), Duration::from_millis(50));
    }
}
