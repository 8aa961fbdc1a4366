//! The operator's HTTP endpoints: `/metrics` (Prometheus), `/healthz` (the control loop
//! still processes requests: [`crate::shared::liveness`]) and `/readyz` (configuration loaded and
//! the Kubernetes API reachable).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;

use crate::shared::liveness::Liveness;
use crate::shared::metrics::Metrics;

#[derive(Clone)]
struct Endpoints {
    metrics: Arc<Metrics>,
    client: kube::Client,
    liveness: Arc<Liveness>,
}

/// Serves the endpoints on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    client: kube::Client,
    liveness: Arc<Liveness>,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics_text))
        .route("/healthz", get(alive))
        .route("/readyz", get(ready))
        .with_state(Endpoints {
            metrics,
            client,
            liveness,
        });
    axum::serve(listener, app).await
}

async fn metrics_text(
    State(endpoints): State<Endpoints>,
) -> ([(&'static str, &'static str); 1], String) {
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        endpoints.metrics.encode(),
    )
}

async fn alive(State(endpoints): State<Endpoints>) -> (StatusCode, String) {
    match endpoints.liveness.check() {
        Ok(alive) => (StatusCode::OK, alive),
        Err(stopped) => (StatusCode::SERVICE_UNAVAILABLE, stopped),
    }
}

async fn ready(State(endpoints): State<Endpoints>) -> (StatusCode, String) {
    match endpoints.client.apiserver_version().await {
        Ok(_) => (StatusCode::OK, "ok".into()),
        Err(error) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("Kubernetes API unreachable: {error}"),
        ),
    }
}
