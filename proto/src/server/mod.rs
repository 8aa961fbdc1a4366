//! The scaffold every provider is served with.
//!
//! [`ProviderServer`] wraps a `Provider` implementation and serves, on one listener:
//! 1. the Provider service itself, plus any extra services the provider adds;
//! 2. the standard `grpc.health.v1.Health` service, SERVING while the server runs and
//!    NOT_SERVING once shutdown begins;
//! 3. gRPC server reflection, v1 and v1alpha, advertising exactly the served services
//!    (so `grpcurl ADDR list` and `describe` work without proto files) and serving the
//!    `google.rpc` error detail types (`server/reflection.rs`);
//! 4. the caller's deadline: a call still running when its `grpc-timeout` passes
//!    answers DEADLINE_EXCEEDED with ErrorInfo ([`DeadlineLayer::server`]);
//! 5. a `grpc.request` span per call, a child of the caller's W3C trace context, and
//!    optionally each call's method, status and duration to a [`CallObserver`]
//!    (`server/observe.rs`, for metrics);
//! 6. TLS, or mutual TLS when a client CA is given, re-read when the files change
//!    (`server/tls.rs`: renewed certificates are served without a restart, and calls in
//!    flight are not dropped).
//!
//! Shutdown is graceful: when the shutdown future completes, health flips to
//! NOT_SERVING, the listener stops accepting, and in-flight calls finish.

mod observe;
mod reflection;
mod tls;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::server::NamedService;
use tonic::service::RoutesBuilder;
use tonic::transport::Server;
use tonic_health::ServingStatus;

pub use crate::deadline::{Deadline, DeadlineLayer};
use crate::pb;
use crate::reference::Misbehaviour;
use crate::trace_context;
pub use observe::CallObserver;
pub use tls::HANDSHAKE_TIMEOUT;

/// Files that configure the server's TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    /// PEM certificate chain the server presents.
    pub cert: PathBuf,
    /// PEM private key of that certificate.
    pub key: PathBuf,
    /// PEM CA bundle; when set, clients must present a certificate it signed (mTLS).
    pub client_ca: Option<PathBuf>,
}

/// Why the server could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A TLS file could not be read.
    #[error("cannot read TLS file {path}: check the path and its permissions")]
    TlsFile {
        /// The file that failed.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A TLS file was read but does not hold what it must.
    #[error("invalid TLS file {path}: {problem}")]
    TlsInvalid {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// Reflection could not index the descriptor sets.
    #[error("cannot build gRPC reflection")]
    Reflection(#[source] tonic_reflection::server::Error),
    /// The transport failed (bad TLS material, accept errors).
    #[error("gRPC transport failed")]
    Transport(#[source] tonic::transport::Error),
}

/// A Provider service with health, reflection, tracing and optional TLS.
#[derive(Debug)]
pub struct ProviderServer {
    routes: RoutesBuilder,
    service_names: Vec<&'static str>,
    tls: Option<ServerTls>,
    misbehave: Option<Misbehaviour>,
    observe: observe::ObserveLayer,
}

type ServiceRequest = http::Request<tonic::body::Body>;

/// Services the scaffold adds beside the provider's own, all advertised by reflection.
const INFRASTRUCTURE_SERVICES: [&str; 3] = [
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

impl ProviderServer {
    /// Serves `provider` as `egressproxy.provider.v1.Provider`.
    pub fn new<P: pb::provider_server::Provider>(provider: P) -> Self {
        ProviderServer {
            routes: RoutesBuilder::default(),
            service_names: Vec::new(),
            tls: None,
            misbehave: None,
            observe: observe::ObserveLayer::default(),
        }
        .with_service(pb::provider_server::ProviderServer::new(provider))
    }

    /// Serves one more gRPC service beside the Provider (advertised by reflection).
    pub fn with_service<S>(mut self, service: S) -> Self
    where
        S: tower::Service<
                ServiceRequest,
                Response = http::Response<tonic::body::Body>,
                Error = std::convert::Infallible,
            > + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        self.routes.add_service(service);
        self.service_names.push(S::NAME);
        self
    }

    /// Reports every call (method, gRPC status, duration) to `observer`, e.g. for metrics.
    pub fn with_call_observer(mut self, observer: std::sync::Arc<dyn CallObserver>) -> Self {
        self.observe = observe::ObserveLayer {
            observer: Some(observer),
        };
        self
    }

    /// Enables TLS (and mTLS when `tls.client_ca` is set). The files are read when
    /// serving starts and again whenever they change.
    pub fn with_tls(mut self, tls: Option<ServerTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Breaks one of the scaffold's own rules (health, reflection, the server's
    /// deadline) when `misbehave` is one of them: only for the reference provider's
    /// tests of the conformance suite.
    #[doc(hidden)]
    pub fn with_misbehaviour(mut self, misbehave: Option<Misbehaviour>) -> Self {
        self.misbehave = misbehave;
        self
    }

    /// Serves on `listener` until `shutdown` completes, then drains in-flight calls.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        let ProviderServer {
            mut routes,
            service_names,
            tls,
            misbehave,
            observe,
        } = self;
        let breaks = |m: Misbehaviour| misbehave == Some(m);
        let (health_reporter, health_service) = tonic_health::server::health_reporter();
        for name in service_names.iter().copied().chain([""]) {
            let status = if breaks(Misbehaviour::HealthNotServing) && !name.is_empty() {
                ServingStatus::NotServing
            } else {
                ServingStatus::Serving
            };
            health_reporter.set_service_status(name, status).await;
        }

        let reflection = || {
            let builder = reflection::builder(!breaks(Misbehaviour::ReflectionWithoutErrorTypes));
            service_names
                .iter()
                .copied()
                .chain(INFRASTRUCTURE_SERVICES)
                .fold(builder, |builder, name| builder.with_service_name(name))
        };
        routes
            .add_service(health_service)
            .add_service(reflection().build_v1().map_err(ServeError::Reflection)?)
            .add_service(
                reflection()
                    .build_v1alpha()
                    .map_err(ServeError::Reflection)?,
            );

        let deadline =
            (!breaks(Misbehaviour::CancelledAtDeadline)).then_some(DeadlineLayer::server());
        // Read before anything is served, so a bad file stops the server at once.
        let tls = tls.map(tls::ReloadingTls::load).transpose()?.map(Arc::new);
        // The observer outside the deadline, so that it sees the deadline's answers too.
        let mut builder = Server::builder()
            .layer(observe)
            .layer(tower::util::option_layer(deadline))
            .trace_fn(|request| {
                let span = tracing::info_span!(
                    "grpc.request",
                    otel.kind = "server",
                    rpc.system = "grpc",
                    rpc.method = %request.uri().path(),
                );
                trace_context::set_parent_from_headers(&span, request.headers());
                span
            });

        let reporter = health_reporter.clone();
        let shutdown = async move {
            shutdown.await;
            tracing::info!("shutting down: health is NOT_SERVING, draining in-flight calls");
            for name in service_names.iter().copied().chain([""]) {
                reporter
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
        };
        let router = builder.add_routes(routes.routes());
        match tls {
            Some(tls) => router
                .serve_with_incoming_shutdown(tls.incoming(listener), shutdown)
                .await
                .map_err(ServeError::Transport),
            None => router
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
                .await
                .map_err(ServeError::Transport),
        }
    }
}

/// Starts listening for SIGINT and SIGTERM, and returns a future that completes once one
/// arrived, for [`ProviderServer::serve`]. Call it before the process says it serves:
/// until a listener is installed, a signal ends the process at once (the default
/// action), without draining a call or flushing a span. An `async fn` would install it
/// only when first polled, which a server may do after it already answered a call.
/// (Off unix only Ctrl-C is listened for, from the first poll.)
///
/// # Panics
///
/// Outside a Tokio runtime with the signal driver enabled (`enable_all`), where
/// installing the handlers fails.
pub fn shutdown_signal() -> impl Future<Output = ()> + Send + 'static {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let installing = "installing a signal handler cannot fail on unix inside a runtime";
        let mut term = signal(SignalKind::terminate()).expect(installing);
        let mut interrupt = signal(SignalKind::interrupt()).expect(installing);
        async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = interrupt.recv() => {}
            }
        }
    }
    #[cfg(not(unix))]
    async {
        let _ = tokio::signal::ctrl_c().await;
    }
}
