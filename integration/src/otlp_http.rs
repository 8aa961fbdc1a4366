//! An OTLP/HTTP trace receiver, as a collector's `otlphttp` receiver answers: `POST
//! /v1/traces` with a protobuf (`application/x-protobuf`) or JSON (`application/json`)
//! `ExportTraceServiceRequest`, over plain HTTP or TLS. It keeps every span (flattened
//! like the gRPC receiver's, [`crate::e2e::otlp::ReceivedSpan`]) and the content type of
//! every request. axum on a thread and runtime of its own, stopped when dropped.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message as _;

use crate::e2e::otlp::{ReceivedSpan, flatten};

#[derive(Debug, Clone, Default)]
struct Received {
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    content_types: Arc<Mutex<Vec<String>>>,
}

/// A running receiver on a loopback port.
#[derive(Debug)]
pub struct HttpSpanReceiver {
    addr: SocketAddr,
    tls: bool,
    received: Received,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HttpSpanReceiver {
    /// Starts the receiver; with `tls` (a PEM certificate chain and its key) it serves
    /// HTTPS only.
    pub fn start(tls: Option<(Vec<u8>, Vec<u8>)>) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let acceptor = tls.map(|(cert, key)| acceptor(&cert, &key)).transpose()?;
        let received = Received::default();
        let app = axum::Router::new()
            .route("/v1/traces", axum::routing::post(export))
            .with_state(received.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let tls = acceptor.is_some();
        let thread = std::thread::spawn(move || {
            runtime.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let stopped = async {
                    let _ = stopped.await;
                };
                let _ = match acceptor {
                    Some(acceptor) => {
                        axum::serve(TlsListener { listener, acceptor }, app)
                            .with_graceful_shutdown(stopped)
                            .await
                    }
                    None => {
                        axum::serve(listener, app)
                            .with_graceful_shutdown(stopped)
                            .await
                    }
                };
            });
        });
        Ok(Self {
            addr,
            tls,
            received,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The base URL for `OTEL_EXPORTER_OTLP_ENDPOINT` (the exporter appends
    /// `/v1/traces`): `https://localhost:PORT` with TLS, `http://127.0.0.1:PORT` without.
    pub fn endpoint(&self) -> String {
        match self.tls {
            true => format!("https://localhost:{}", self.addr.port()),
            false => format!("http://{}", self.addr),
        }
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        lock(&self.received.spans).clone()
    }

    /// The `Content-Type` of every export request, in arrival order.
    pub fn content_types(&self) -> Vec<String> {
        lock(&self.received.content_types).clone()
    }
}

impl Drop for HttpSpanReceiver {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

async fn export(
    State(received): State<Received>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], Vec<u8>) {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    lock(&received.content_types).push(content_type.clone());
    let request = if content_type.starts_with("application/json") {
        serde_json::from_slice::<ExportTraceServiceRequest>(&body).map_err(|e| e.to_string())
    } else {
        ExportTraceServiceRequest::decode(body).map_err(|e| e.to_string())
    };
    match request {
        Ok(request) => {
            lock(&received.spans).extend(flatten(request));
            // An empty ExportTraceServiceResponse, in the request's encoding.
            let (content_type, body) = match content_type.starts_with("application/json") {
                true => ("application/json", b"{}".to_vec()),
                false => ("application/x-protobuf", Vec::new()),
            };
            (StatusCode::OK, [(header::CONTENT_TYPE, content_type)], body)
        }
        Err(error) => (
            StatusCode::BAD_REQUEST,
            [(header::CONTENT_TYPE, "text/plain")],
            error.into_bytes(),
        ),
    }
}

fn acceptor(cert: &[u8], key: &[u8]) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .context("the receiver's certificate")?;
    let key = PrivateKeyDer::from_pem_slice(key).context("the receiver's key")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// TLS in front of a TCP listener; connections whose handshake fails are dropped.
struct TlsListener {
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
}

impl axum::serve::Listener for TlsListener {
    type Io = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, peer)) = self.listener.accept().await else {
                continue;
            };
            if let Ok(tls) = self.acceptor.accept(tcp).await {
                return (tls, peer);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.listener.local_addr()
    }
}
