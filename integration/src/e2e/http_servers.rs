//! The two HTTP servers of the end-to-end stack.
//!
//! - [`ImageServer`]: serves the guest image to the agent on the host's loopback, as
//!   a private image mirror would: only with basic-auth credentials that are unique to
//!   the server (so a test can look for them where they must not appear), and counts
//!   the downloads (a warm run downloads nothing).
//! - [`TargetServer`]: what a proxied request reaches, listening inside the test's
//!   network namespace on the NAT network's gateway address, where the guests' squid can
//!   connect. It answers with a fixed body and remembers each request's `Via` header.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::get;
use base64::Engine;
use tokio::task::JoinHandle;

use super::netns::bind_tcp_in;

/// The body every [`TargetServer`] answer carries.
pub const TARGET_BODY: &str = "egressproxy end-to-end target\n";

fn serve(
    runtime: &tokio::runtime::Handle,
    listener: std::net::TcpListener,
    app: Router,
) -> anyhow::Result<JoinHandle<()>> {
    listener.set_nonblocking(true)?;
    Ok(runtime.spawn(async move {
        if let Ok(listener) = tokio::net::TcpListener::from_std(listener) {
            let _ = axum::serve(listener, app).await;
        }
    }))
}

/// The user name [`ImageServer`] asks for.
pub const IMAGE_USER: &str = "mirror";

/// Serves one file at `http://127.0.0.1:PORT/NAME` to requests with its basic-auth
/// credentials (401 otherwise); stops when dropped.
#[derive(Debug)]
pub struct ImageServer {
    url: String,
    password: String,
    downloads: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl ImageServer {
    /// Serves the file at `path` under its file name; with `bytes_per_second`, no faster
    /// than that (so a test can act while a download is under way).
    pub fn start(
        runtime: &tokio::runtime::Handle,
        path: &Path,
        bytes_per_second: Option<u64>,
    ) -> anyhow::Result<Self> {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| anyhow::anyhow!("{} has no file name", path.display()))?
            .to_owned();
        let body = Bytes::from(std::fs::read(path)?);
        let downloads = Arc::new(AtomicUsize::new(0));
        let counter = downloads.clone();
        let password = format!("image-password-{}", uuid::Uuid::new_v4().simple());
        let authorization = format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{IMAGE_USER}:{password}"))
        );
        let app = Router::new().route(
            &format!("/{name}"),
            get(move |headers: HeaderMap| {
                let authorized = headers
                    .get(axum::http::header::AUTHORIZATION)
                    .is_some_and(|value| value.as_bytes() == authorization.as_bytes());
                if authorized {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                let body = body.clone();
                async move {
                    if authorized {
                        axum::http::Response::new(throttled(body, bytes_per_second))
                    } else {
                        let mut refused = axum::http::Response::new(axum::body::Body::empty());
                        *refused.status_mut() = axum::http::StatusCode::UNAUTHORIZED;
                        refused
                    }
                }
            }),
        );
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let url = format!(
            "http://{IMAGE_USER}:{password}@{}/{name}",
            listener.local_addr()?
        );
        let task = serve(runtime, listener, app)?;
        Ok(Self {
            url,
            password,
            downloads,
            task,
        })
    }

    /// The file's URL, with the credentials in it (`http://USER:PASSWORD@…`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The password in [`ImageServer::url`]: a secret that must never be shown.
    pub fn password(&self) -> &str {
        &self.password
    }

    /// How many times the file was requested.
    pub fn downloads(&self) -> usize {
        self.downloads.load(Ordering::Relaxed)
    }
}

/// `body` in 1 MiB chunks, paced to `bytes_per_second` when set.
fn throttled(body: Bytes, bytes_per_second: Option<u64>) -> axum::body::Body {
    const CHUNK: usize = 1 << 20;
    let Some(rate) = bytes_per_second.filter(|r| *r > 0) else {
        return axum::body::Body::from(body);
    };
    let pause = Duration::from_secs_f64(CHUNK as f64 / rate as f64);
    let chunks = futures::stream::unfold(body, move |mut rest| async move {
        if rest.is_empty() {
            return None;
        }
        let chunk = rest.split_to(rest.len().min(CHUNK));
        tokio::time::sleep(pause).await;
        Some((Ok::<_, std::io::Error>(chunk), rest))
    });
    axum::body::Body::from_stream(chunks)
}

impl Drop for ImageServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An HTTP server inside a network namespace; stops when dropped.
#[derive(Debug)]
pub struct TargetServer {
    addr: SocketAddr,
    vias: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl TargetServer {
    /// Listens on `ip`, a free port, inside `netns`.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        netns: &str,
        ip: Ipv4Addr,
    ) -> anyhow::Result<Self> {
        let listener = bind_tcp_in(netns, SocketAddr::from((ip, 0)))?;
        let addr = listener.local_addr()?;
        let vias = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new().fallback(get(answer)).with_state(vias.clone());
        let task = serve(runtime, listener, app)?;
        Ok(Self { addr, vias, task })
    }

    /// `http://IP:PORT/`.
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// The `Via` header of every request received (empty when a request had none).
    pub fn vias(&self) -> Vec<String> {
        self.vias.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

async fn answer(State(vias): State<Arc<Mutex<Vec<String>>>>, headers: HeaderMap) -> &'static str {
    let via = headers
        .get("via")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    vias.lock().unwrap_or_else(|p| p.into_inner()).push(via);
    TARGET_BODY
}

impl Drop for TargetServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
