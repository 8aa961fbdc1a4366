//! One HTTP/1.1 server on 127.0.0.1 for the tests and benchmarks that download images:
//! axum on a thread and runtime of its own (so it works from sync code and outlives no
//! test runtime), with routes added as a test goes, each answering the way the test
//! needs: a body whole, without `Content-Length`, cut short, stalled or slow, a status,
//! a redirect, or no answer at all. It records every request (path, `Host`,
//! `Authorization`) and counts the bodies it sent to the end. It stops when dropped.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::Response;

/// What the server saw of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// The request's path, without its query.
    pub path: String,
    /// The `Host` header.
    pub host: Option<String>,
    /// The `Authorization` header.
    pub authorization: Option<String>,
}

/// How a route answers.
#[derive(Debug, Clone)]
pub enum Reply {
    /// This status, with an empty body.
    Status(u16),
    /// This redirect status, with this `Location`, as given (relative or not).
    Redirect(u16, String),
    /// 200 with these bytes.
    Body(Bytes, Delivery),
    /// 200 with the bytes of this file, read as they are sent.
    File(PathBuf, Delivery),
    /// Nothing: no status line, the connection stays open.
    Silent,
}

/// How a 200's body is sent. All but [`Delivery::NoLength`] announce the whole length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Every byte.
    Whole,
    /// Every byte, chunked, without `Content-Length`.
    NoLength,
    /// The first half, then the connection ends.
    Short,
    /// The first half, then nothing, the connection kept open.
    Stall,
    /// Every byte, `chunk` bytes at a time with `pause` after each.
    Slow {
        /// Bytes per piece.
        chunk: usize,
        /// Pause after each piece.
        pause: Duration,
    },
}

type Handler = Arc<dyn Fn(&Seen, usize) -> Reply + Send + Sync>;

#[derive(Default)]
struct Shared {
    routes: HashMap<String, Handler>,
    dir: Option<PathBuf>,
    seen: Vec<Seen>,
    completed: HashMap<String, usize>,
}

/// The server; see the module docs.
pub struct HttpServer {
    address: SocketAddr,
    shared: Arc<Mutex<Shared>>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl std::fmt::Debug for HttpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpServer")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl HttpServer {
    /// Starts a server with no routes: every path answers 404 until a route is added.
    pub fn start() -> Self {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .expect("bind 127.0.0.1:0");
        let address = listener.local_addr().expect("a bound address");
        let shared = Arc::<Mutex<Shared>>::default();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let state = shared.clone();
        std::thread::Builder::new()
            .name("test-http-server".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the test HTTP server");
                runtime.block_on(async move {
                    let listener =
                        tokio::net::TcpListener::from_std(listener).expect("a tokio listener");
                    let app = axum::Router::new().fallback(move |request| answer(request, state));
                    // Dropping the runtime on stop closes every connection, stalled ones too.
                    tokio::select! {
                        _ = axum::serve(listener, app) => {}
                        _ = stopped => {}
                    }
                });
            })
            .expect("spawn the test HTTP server's thread");
        Self {
            address,
            shared,
            _stop: stop,
        }
    }

    /// Starts a server that answers with the files of `dir` (`/NAME`), whole.
    pub fn serving_dir(dir: &Path) -> Self {
        let server = Self::start();
        server.lock().dir = Some(dir.to_owned());
        server
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The port the server listens on.
    pub fn port(&self) -> u16 {
        self.address.port()
    }

    /// Answers `path` with `reply` every time; returns its URL.
    pub fn route(&self, path: &str, reply: Reply) -> String {
        self.route_with(path, move |_, _| reply.clone())
    }

    /// Answers `path` with what `handler` returns for the request and its number (1 for
    /// the first request of that path); returns its URL.
    pub fn route_with(
        &self,
        path: &str,
        handler: impl Fn(&Seen, usize) -> Reply + Send + Sync + 'static,
    ) -> String {
        self.lock()
            .routes
            .insert(path.to_owned(), Arc::new(handler));
        format!("{}{path}", self.base_url())
    }

    /// How many requests for `path` arrived.
    pub fn requests(&self, path: &str) -> usize {
        self.seen(path).len()
    }

    /// The requests for `path`, in order.
    pub fn seen(&self, path: &str) -> Vec<Seen> {
        let shared = self.lock();
        shared
            .seen
            .iter()
            .filter(|s| s.path == path)
            .cloned()
            .collect()
    }

    /// How many bodies of `path` were handed to the connection to their last byte.
    pub fn completed(&self, path: &str) -> usize {
        self.lock().completed.get(path).copied().unwrap_or(0)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }
}

async fn answer(request: axum::extract::Request, shared: Arc<Mutex<Shared>>) -> Response {
    let seen = Seen {
        path: request.uri().path().to_owned(),
        host: text(request.headers(), header::HOST),
        authorization: text(request.headers(), header::AUTHORIZATION),
    };
    let (handler, dir, nth) = {
        let mut state = shared.lock().unwrap_or_else(|p| p.into_inner());
        state.seen.push(seen.clone());
        let nth = state.seen.iter().filter(|s| s.path == seen.path).count();
        (
            state.routes.get(&seen.path).cloned(),
            state.dir.clone(),
            nth,
        )
    };
    let reply = match (handler, dir) {
        (Some(handler), _) => handler(&seen, nth),
        (None, Some(dir)) => match dir.join(seen.path.trim_start_matches('/')) {
            file if file.is_file() => Reply::File(file, Delivery::Whole),
            _ => Reply::Status(404),
        },
        (None, None) => Reply::Status(404),
    };
    let done = move || {
        let mut state = shared.lock().unwrap_or_else(|p| p.into_inner());
        *state.completed.entry(seen.path).or_default() += 1;
    };
    match reply {
        Reply::Status(status) => empty(status, None),
        Reply::Redirect(status, location) => empty(status, Some(location)),
        Reply::Silent => std::future::pending().await,
        Reply::Body(bytes, delivery) => {
            let length = bytes.len() as u64;
            body(Source::Memory(bytes), length, delivery, done)
        }
        Reply::File(path, delivery) => match tokio::fs::File::open(&path).await {
            Ok(file) => {
                let length = file.metadata().await.map(|m| m.len()).unwrap_or(0);
                body(Source::File(file), length, delivery, done)
            }
            Err(_) => empty(404, None),
        },
    }
}

fn text(headers: &HeaderMap, name: header::HeaderName) -> Option<String> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

fn empty(status: u16, location: Option<String>) -> Response {
    let mut response = Response::builder()
        .status(StatusCode::from_u16(status).expect("a valid status"))
        .header(header::CONTENT_LENGTH, 0);
    if let Some(location) = location {
        response = response.header(header::LOCATION, location);
    }
    response.body(Body::empty()).expect("a valid response")
}

enum Source {
    Memory(Bytes),
    File(tokio::fs::File),
}

/// Pieces read from a file at a time.
const FILE_CHUNK: usize = 256 * 1024;

impl Source {
    /// Up to `max` next bytes; empty at the end.
    async fn next(&mut self, max: usize) -> std::io::Result<Bytes> {
        match self {
            Source::Memory(rest) => Ok(rest.split_to(rest.len().min(max))),
            Source::File(file) => {
                use tokio::io::AsyncReadExt;
                let mut buf = bytes::BytesMut::with_capacity(max.min(FILE_CHUNK));
                file.read_buf(&mut buf).await?;
                Ok(buf.freeze())
            }
        }
    }
}

/// A 200 whose body is `source` (`length` bytes) sent as `delivery` says; `done` runs
/// once the last byte was handed over.
fn body(
    source: Source,
    length: u64,
    delivery: Delivery,
    done: impl FnOnce() + Send + 'static,
) -> Response {
    let (limit, piece, pause) = match delivery {
        Delivery::Whole | Delivery::NoLength => (length, FILE_CHUNK, None),
        Delivery::Short | Delivery::Stall => (length / 2, FILE_CHUNK, None),
        Delivery::Slow { chunk, pause } => (length, chunk, Some(pause)),
    };
    let state = (source, 0u64, Some(done));
    let stream = futures::stream::unfold(state, move |(mut source, sent, mut done)| async move {
        if sent >= limit {
            if delivery == Delivery::Stall {
                std::future::pending::<()>().await;
            }
            return None;
        }
        let max = usize::try_from(limit - sent)
            .unwrap_or(usize::MAX)
            .min(piece);
        let chunk = match source.next(max).await {
            Ok(chunk) if chunk.is_empty() => {
                return Some((
                    Err(std::io::Error::other("the file ended early")),
                    (source, limit, None),
                ));
            }
            Ok(chunk) => chunk,
            Err(e) => return Some((Err(e), (source, limit, None))),
        };
        if let Some(pause) = pause {
            tokio::time::sleep(pause).await;
        }
        let sent = sent + chunk.len() as u64;
        // Counted as the last byte is handed over: with a `Content-Length`, hyper does
        // not poll the body again once that many bytes have gone.
        if sent == length
            && let Some(done) = done.take()
        {
            done();
        }
        Some((Ok::<_, std::io::Error>(chunk), (source, sent, done)))
    });
    let mut response = Response::builder().status(StatusCode::OK);
    if delivery != Delivery::NoLength {
        response = response.header(header::CONTENT_LENGTH, length);
    }
    response
        .body(Body::from_stream(stream))
        .expect("a valid response")
}
