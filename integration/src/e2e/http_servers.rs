//! The two HTTP servers of the end-to-end stack.
//!
//! - [`ImageServer`]: serves the guest image to the agent on the host's loopback, as
//!   a private image mirror would: only with basic-auth credentials that are unique to
//!   the server (so a test can look for them where they must not appear), and counts
//!   the downloads (a warm run downloads nothing). The same file is also served under
//!   `/fresh/` with its `Content-Length` (an image URL whose base no pool has yet), and
//!   a test can cut the next downloads there after some bytes
//!   ([`ImageServer::cut_next_downloads`]), as a dropped connection would.
//! - [`TargetServer`]: what a proxied request reaches, listening inside the test's
//!   network namespace on the NAT network's gateway address, where the guests' squid can
//!   connect. It answers with a fixed body and remembers each request's `Via` header.
//!   Like a partner's service, it also echoes the caller's address (`/ip`, an egress
//!   check URL) and admits one source only (`/only-from/IP`: 403 for any other).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::get;
use base64::Engine;
use tokio::task::JoinHandle;

use crate::netns::bind_tcp_in;

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
            // The target's handlers take the caller's address; a router served without
            // it would answer them 500.
            let app = app.into_make_service_with_connect_info::<SocketAddr>();
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
    port: u16,
    fresh_url: String,
    password: String,
    downloads: Arc<AtomicUsize>,
    cuts: Arc<Mutex<Cuts>>,
    task: JoinHandle<()>,
}

/// The cuts armed for downloads under `/fresh/`, and when the last one happened.
#[derive(Debug, Default)]
struct Cuts {
    remaining: usize,
    after_bytes: usize,
    last: Option<Instant>,
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
        let cuts = Arc::new(Mutex::new(Cuts::default()));
        let fresh_authorization = authorization.clone();
        let (fresh_body, fresh_counter, fresh_cuts) = (body.clone(), counter.clone(), cuts.clone());
        let app = Router::new()
            .route(
                &format!("/{name}"),
                get(move |headers: HeaderMap| {
                    let authorized = is_authorized(&headers, &authorization);
                    if authorized {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                    let body = body.clone();
                    async move {
                        if authorized {
                            axum::http::Response::new(throttled(body, bytes_per_second))
                        } else {
                            unauthorized()
                        }
                    }
                }),
            )
            .route(
                &format!("/fresh/{name}"),
                get(move |headers: HeaderMap| {
                    let authorized = is_authorized(&headers, &fresh_authorization);
                    let body = fresh_body.clone();
                    let cut = authorized.then(|| {
                        fresh_counter.fetch_add(1, Ordering::Relaxed);
                        let mut cuts = fresh_cuts.lock().unwrap_or_else(|p| p.into_inner());
                        (cuts.remaining > 0).then(|| {
                            cuts.remaining -= 1;
                            cuts.after_bytes
                        })
                    });
                    let cuts = fresh_cuts.clone();
                    async move {
                        match cut {
                            None => unauthorized(),
                            Some(cut) => with_length(body, bytes_per_second, cut, cuts),
                        }
                    }
                }),
            );
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let address = listener.local_addr()?;
        let url = format!("http://{IMAGE_USER}:{password}@{address}/{name}");
        let fresh_url = format!("http://{IMAGE_USER}:{password}@{address}/fresh/{name}");
        let task = serve(runtime, listener, app)?;
        Ok(Self {
            url,
            port: address.port(),
            fresh_url,
            password,
            downloads,
            cuts,
            task,
        })
    }

    /// The same file under `/fresh/` (credentials in it, like [`ImageServer::url`]): an
    /// image configured with this URL and no `sha256` gets a base of its own.
    pub fn fresh_url(&self) -> &str {
        &self.fresh_url
    }

    /// Cuts each of the next `downloads` under `/fresh/` after `after_bytes` bytes: the
    /// response announces the whole `Content-Length`, and the connection is reset.
    pub fn cut_next_downloads(&self, downloads: usize, after_bytes: usize) {
        let mut cuts = self.cuts.lock().unwrap_or_else(|p| p.into_inner());
        cuts.remaining = downloads;
        cuts.after_bytes = after_bytes;
    }

    /// When the last download was cut, if one was.
    pub fn last_cut(&self) -> Option<Instant> {
        self.cuts.lock().unwrap_or_else(|p| p.into_inner()).last
    }

    /// The file's URL, with the credentials in it (`http://USER:PASSWORD@…`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The server's port on the host's loopback.
    pub fn port(&self) -> u16 {
        self.port
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

fn is_authorized(headers: &HeaderMap, authorization: &str) -> bool {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .is_some_and(|value| value.as_bytes() == authorization.as_bytes())
}

fn unauthorized() -> axum::http::Response<axum::body::Body> {
    let mut refused = axum::http::Response::new(axum::body::Body::empty());
    *refused.status_mut() = axum::http::StatusCode::UNAUTHORIZED;
    refused
}

/// `body` with its `Content-Length`, paced like [`throttled`]; with `cut`, only that
/// many bytes, then an error that makes the server reset the connection (recorded in
/// `cuts` as the time of the cut).
fn with_length(
    body: Bytes,
    bytes_per_second: Option<u64>,
    cut: Option<usize>,
    cuts: Arc<Mutex<Cuts>>,
) -> axum::http::Response<axum::body::Body> {
    use futures::StreamExt;
    let length = body.len();
    let sent = match cut {
        Some(bytes) => body.slice(..bytes.min(length)),
        None => body,
    };
    let stream = paced(sent, bytes_per_second).chain(futures::stream::iter(cut).map(move |_| {
        cuts.lock().unwrap_or_else(|p| p.into_inner()).last = Some(Instant::now());
        Err(std::io::Error::other("download cut by the test"))
    }));
    let mut response = axum::http::Response::new(axum::body::Body::from_stream(stream));
    response
        .headers_mut()
        .insert(axum::http::header::CONTENT_LENGTH, length.into());
    response
}

/// `body` in 1 MiB chunks, paced to `bytes_per_second` when set.
fn paced(
    body: Bytes,
    bytes_per_second: Option<u64>,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send {
    const CHUNK: usize = 1 << 20;
    let pause = bytes_per_second
        .filter(|r| *r > 0)
        .map(|rate| Duration::from_secs_f64(CHUNK as f64 / rate as f64));
    futures::stream::unfold(body, move |mut rest| async move {
        if rest.is_empty() {
            return None;
        }
        let chunk = rest.split_to(rest.len().min(CHUNK));
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        Some((Ok::<_, std::io::Error>(chunk), rest))
    })
}

/// `body`, paced like [`paced`] when `bytes_per_second` is set.
fn throttled(body: Bytes, bytes_per_second: Option<u64>) -> axum::body::Body {
    if bytes_per_second.is_some_and(|r| r > 0) {
        axum::body::Body::from_stream(paced(body, bytes_per_second))
    } else {
        axum::body::Body::from(body)
    }
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
    seen: Arc<Mutex<Seen>>,
    task: JoinHandle<()>,
}

/// What [`TargetServer`] received.
#[derive(Debug, Default)]
struct Seen {
    /// One per request.
    vias: Vec<String>,
    /// The answers of `/ip`.
    echoed: Vec<IpAddr>,
}

type Shared = Arc<Mutex<Seen>>;

impl TargetServer {
    /// Listens on `ip`, a free port, inside `netns`.
    pub fn start(
        runtime: &tokio::runtime::Handle,
        netns: &str,
        ip: Ipv4Addr,
    ) -> anyhow::Result<Self> {
        let listener = bind_tcp_in(netns, SocketAddr::from((ip, 0)))?;
        let addr = listener.local_addr()?;
        let seen = Shared::default();
        let app = Router::new()
            .route("/ip", get(echo_source))
            .route("/only-from/{allowed}", get(only_from))
            .fallback(get(answer))
            .with_state(seen.clone());
        let task = serve(runtime, listener, app)?;
        Ok(Self { addr, seen, task })
    }

    /// `http://IP:PORT/ip`: answers the caller's address, as an egress check URL must.
    pub fn echo_url(&self) -> String {
        format!("http://{}/ip", self.addr)
    }

    /// `http://IP:PORT/only-from/ALLOWED`: [`TARGET_BODY`] to a caller from `allowed`,
    /// 403 to any other, as a partner that allow-lists one source address answers.
    pub fn only_from_url(&self, allowed: &str) -> String {
        format!("http://{}/only-from/{allowed}", self.addr)
    }

    /// The addresses [`TargetServer::echo_url`] answered, in order.
    pub fn echoed(&self) -> Vec<IpAddr> {
        self.seen().echoed.clone()
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `http://IP:PORT/`.
    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// The `Via` header of every request received (empty when a request had none).
    pub fn vias(&self) -> Vec<String> {
        self.seen().vias.clone()
    }
}

/// Records the request; returns the caller's address.
fn record(seen: &Shared, caller: SocketAddr, headers: &HeaderMap) -> IpAddr {
    let via = headers
        .get("via")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
    seen.vias.push(via);
    caller.ip()
}

async fn answer(
    State(seen): State<Shared>,
    ConnectInfo(caller): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> &'static str {
    record(&seen, caller, &headers);
    TARGET_BODY
}

async fn echo_source(
    State(seen): State<Shared>,
    ConnectInfo(caller): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
) -> String {
    let source = record(&seen, caller, &headers);
    seen.lock()
        .unwrap_or_else(|p| p.into_inner())
        .echoed
        .push(source);
    format!("{source}\n")
}

async fn only_from(
    State(seen): State<Shared>,
    ConnectInfo(caller): ConnectInfo<SocketAddr>,
    UrlPath(allowed): UrlPath<String>,
    headers: HeaderMap,
) -> (StatusCode, String) {
    let source = record(&seen, caller, &headers);
    if source.to_string() == allowed {
        (StatusCode::OK, TARGET_BODY.to_owned())
    } else {
        (
            StatusCode::FORBIDDEN,
            format!("{source} is not the allow-listed {allowed}\n"),
        )
    }
}

impl Drop for TargetServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
