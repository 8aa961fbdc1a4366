//! Every call's method, gRPC status and duration, for a provider's metrics.
//!
//! A provider gives [`super::ProviderServer::with_call_observer`] a [`CallObserver`];
//! the layer here reports each call once, when its status is known:
//!
//! 1. an answer whose headers carry `grpc-status` (tonic's "trailers-only" form of an
//!    error) is reported when the headers are sent;
//! 2. otherwise when the body's trailers pass (the status of a normal answer);
//! 3. a body dropped before its trailers (the client went away) is reported as
//!    `CANCELLED`, and an answer without any status as `UNKNOWN`.
//!
//! The method is the request path (`/egressproxy.provider.v1.Provider/CreateInstance`),
//! so health checks and reflection are counted beside the Provider's calls.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http_body::{Body as HttpBody, Frame};

/// Receives one report per call.
pub trait CallObserver: Send + Sync + 'static {
    /// The call to `method` (its path) ended with `code` after `elapsed`.
    fn observe(&self, method: &str, code: tonic::Code, elapsed: Duration);
}

/// The layer that reports calls to an observer (none: it passes calls through).
#[derive(Clone, Default)]
pub(super) struct ObserveLayer {
    pub(super) observer: Option<Arc<dyn CallObserver>>,
}

impl std::fmt::Debug for ObserveLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObserveLayer")
            .field("observing", &self.observer.is_some())
            .finish()
    }
}

impl<S> tower::Layer<S> for ObserveLayer {
    type Service = Observe<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Observe {
            inner,
            observer: self.observer.clone(),
        }
    }
}

/// See [`ObserveLayer`].
#[derive(Clone)]
pub(super) struct Observe<S> {
    inner: S,
    observer: Option<Arc<dyn CallObserver>>,
}

impl<S> std::fmt::Debug for Observe<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Observe").finish_non_exhaustive()
    }
}

/// One call being observed; reports at most once.
struct Pending {
    observer: Arc<dyn CallObserver>,
    method: String,
    started: Instant,
}

impl Pending {
    fn report(self, code: tonic::Code) {
        self.observer
            .observe(&self.method, code, self.started.elapsed());
    }
}

fn status_in(headers: &http::HeaderMap) -> Option<tonic::Code> {
    headers
        .get("grpc-status")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<i32>().ok())
        .map(tonic::Code::from_i32)
}

impl<S, B> tower::Service<http::Request<B>> for Observe<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let pending = self.observer.clone().map(|observer| Pending {
            observer,
            method: request.uri().path().to_owned(),
            started: Instant::now(),
        });
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            let Some(pending) = pending else {
                return Ok(response);
            };
            if let Some(code) = status_in(response.headers()) {
                pending.report(code);
                return Ok(response);
            }
            Ok(response.map(|body| {
                tonic::body::Body::new(ObservedBody {
                    inner: body,
                    pending: Some(pending),
                })
            }))
        })
    }
}

/// A response body that reports its call's status when its trailers pass.
struct ObservedBody {
    inner: tonic::body::Body,
    pending: Option<Pending>,
}

impl HttpBody for ObservedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(trailers) = frame.trailers_ref()
                    && let Some(pending) = self.pending.take()
                {
                    pending.report(status_in(trailers).unwrap_or(tonic::Code::Unknown));
                }
            }
            Poll::Ready(Some(Err(status))) => {
                if let Some(pending) = self.pending.take() {
                    pending.report(status.code());
                }
            }
            Poll::Ready(None) => {
                if let Some(pending) = self.pending.take() {
                    pending.report(tonic::Code::Unknown);
                }
            }
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for ObservedBody {
    fn drop(&mut self) {
        if let Some(pending) = self.pending.take() {
            pending.report(tonic::Code::Cancelled);
        }
    }
}
