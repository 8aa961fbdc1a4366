//! Client-side enforcement of a call's `grpc-timeout`: when it passes, the call ends
//! with DEADLINE_EXCEEDED. The caller's interceptor sets the header on every call, so
//! this layer only reads it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::Status;

/// Wraps a channel so that every call ends by its `grpc-timeout`.
#[derive(Debug, Clone)]
pub struct Deadline<S> {
    pub(crate) inner: S,
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
        // The clock starts before the call, so this deadline fires no later than the
        // channel's own (which would report CANCELLED).
        let deadline = timeout.map(|timeout| (tokio::time::Instant::now() + timeout, timeout));
        let call = self.inner.call(request);
        Box::pin(async move {
            let Some((deadline, timeout)) = deadline else {
                return call.await;
            };
            let exceeded = || {
                let message = format!(
                    "the provider did not answer within the call's deadline of {timeout:?}"
                );
                Ok(Status::deadline_exceeded(message).into_http())
            };
            match tokio::time::timeout_at(deadline, call).await {
                Err(_) => exceeded(),
                Ok(Err(error)) if is_timeout(&error) => exceeded(),
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
}
