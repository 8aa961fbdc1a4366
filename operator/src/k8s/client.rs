//! The operator's Kubernetes client: kube's stack (base URI, authentication, extra
//! headers, retries of 429/503/504) over a hyper client whose connection pool is
//! bounded and lets idle connections go.
//!
//! kube builds its hyper client without a pool timer, so the pool's idle timeout never
//! fires, and with no bound on idle connections per host: after a burst of work (a few
//! hundred reconciles writing status at once) the operator held every connection it
//! had opened, 150–230 of them, for as long as it ran. Here:
//! 1. at most as many idle connections are kept as reconciles and Service syncs may run
//!    at once, plus [`SPARE_IDLE_CONNECTIONS`] (Events, the Lease, garbage collection),
//!    so a steady load reuses its connections; one more returned to the pool is
//!    closed;
//! 2. an idle connection is closed after [`IDLE_TIMEOUT`], by the pool's timer;
//! 3. connections in use are bounded by what is in flight: the reconciles and Service
//!    syncs (see the `--max-concurrent-reconciles` and `--max-concurrent-service-syncs`
//!    flags), their Events, and the watches.

use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use kube::client::retry::RetryPolicy;
use kube::client::{Body, ConfigExt};
use tower::ServiceBuilder;
use tower::retry::RetryLayer;

/// Idle connections kept beyond one per concurrent reconcile or Service sync.
pub const SPARE_IDLE_CONNECTIONS: usize = 8;
/// How long a connection may stay idle before it is closed (the pool checks every
/// this long, so a connection goes between one and two of these after its last use).
/// Ready Proxies are checked every 30 s by default: at scale the pool stays busy, and
/// a small operator reopens a connection now and then, which costs a TLS handshake.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(15);

/// A client for the apiserver of `config`, for an operator running at most
/// `concurrent_requests` reconciles and Service syncs at once.
pub fn client(config: kube::Config, concurrent_requests: u16) -> Result<kube::Client, kube::Error> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let https = config.rustls_https_connector_with_connector(http)?;
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    let hyper: hyper_util::client::legacy::Client<_, Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(IDLE_TIMEOUT)
            .pool_max_idle_per_host(usize::from(concurrent_requests) + SPARE_IDLE_CONNECTIONS)
            .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(tower::BoxError::from)
        .service(hyper);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// A client configured from the environment (in-cluster, or `KUBECONFIG`), as
/// `kube::Client::try_default` would be, with [`client`]'s pool.
pub async fn from_environment(concurrent_requests: u16) -> anyhow::Result<kube::Client> {
    let config = kube::Config::infer().await?;
    Ok(client(config, concurrent_requests)?)
}
