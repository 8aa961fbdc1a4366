//! TLS for the server, re-read when its files change.
//!
//! Certificates are renewed while the server runs (cert-manager rewrites the mounted
//! Secret, a timer on a hypervisor runs `certbot` or a CA script). So the files are
//! not read once:
//!
//! 1. At start-up the certificate, key and client CA are read and checked; a missing
//!    or invalid file stops the server with an error naming the file.
//! 2. Every accepted connection compares the files' bytes with those last loaded
//!    (three small reads; gRPC connections are long-lived, so this is rare). Changed
//!    bytes are parsed into a new rustls configuration, which that connection and the
//!    ones after it use.
//! 3. Connections already established keep the configuration they were accepted with:
//!    a reload never drops a call in flight.
//! 4. Changed files that do not load (a renewal half-written, a key that does not match
//!    its certificate) leave the previous configuration in place; a warning names the
//!    problem once per distinct content, and the next connection tries again.
//! 5. Handshakes run beside the accept loop, each bounded by [`HANDSHAKE_TIMEOUT`], so
//!    a client that stalls its handshake holds no one else up.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::{ServeError, ServerTls};
use crate::error::with_causes;

/// How long a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepted TLS connections waiting for the server to pick them up.
const ACCEPTED_BACKLOG: usize = 64;

/// The bytes of the files, as last read.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Files {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Loaded {
    files: Files,
    config: Arc<ServerConfig>,
    /// Files that failed to load, so that their warning is logged once.
    rejected: Option<Files>,
}

/// The server's TLS configuration, reloaded when its files change.
#[derive(Debug)]
pub(super) struct ReloadingTls {
    paths: ServerTls,
    loaded: Mutex<Loaded>,
}

impl ReloadingTls {
    /// Reads and checks the files once; an error names the file at fault.
    pub(super) fn load(paths: ServerTls) -> Result<Self, ServeError> {
        let files = read_files(&paths)?;
        let config = server_config(&paths, &files)?;
        Ok(ReloadingTls {
            paths,
            loaded: Mutex::new(Loaded {
                files,
                config,
                rejected: None,
            }),
        })
    }

    /// The configuration for the next connection: the current files' when they load,
    /// else the last that did.
    fn current(&self) -> Arc<ServerConfig> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        let files = match read_files(&self.paths) {
            Ok(files) => files,
            Err(error) => {
                tracing::warn!(error = %with_causes(&error),
                    "cannot re-read the TLS files: serving the certificate loaded before");
                return loaded.config.clone();
            }
        };
        if files == loaded.files || loaded.rejected.as_ref() == Some(&files) {
            return loaded.config.clone();
        }
        match server_config(&self.paths, &files) {
            Ok(config) => {
                tracing::info!(cert = %self.paths.cert.display(),
                    "TLS files changed: new connections use the new certificate");
                loaded.files = files;
                loaded.config = config;
                loaded.rejected = None;
            }
            Err(error) => {
                tracing::warn!(error = %with_causes(&error),
                    "TLS files changed but do not load: serving the certificate loaded before");
                loaded.rejected = Some(files);
            }
        }
        loaded.config.clone()
    }

    /// Accepts connections on `listener` and yields those whose TLS handshake
    /// succeeded, until the returned stream is dropped.
    pub(super) fn incoming(
        self: Arc<Self>,
        listener: TcpListener,
    ) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<TlsStream<TcpStream>>> {
        let (accepted, stream) = tokio::sync::mpsc::channel(ACCEPTED_BACKLOG);
        tokio::spawn(async move {
            loop {
                let tcp = tokio::select! {
                    () = accepted.closed() => return,
                    tcp = listener.accept() => tcp,
                };
                let (tcp, peer) = match tcp {
                    Ok(connection) => connection,
                    Err(error) => {
                        // Out of file descriptors and the like: the server stays up.
                        tracing::warn!(%error, "accepting a connection failed");
                        continue;
                    }
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = TlsAcceptor::from(self.current());
                let accepted = accepted.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let _ = accepted.send(Ok(tls)).await;
                        }
                        Ok(Err(error)) => {
                            tracing::debug!(%peer, %error, "TLS handshake failed");
                        }
                        Err(_) => {
                            tracing::debug!(%peer, timeout = ?HANDSHAKE_TIMEOUT,
                                "TLS handshake timed out");
                        }
                    }
                });
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(stream)
    }
}

fn read_files(paths: &ServerTls) -> Result<Files, ServeError> {
    Ok(Files {
        cert: read(&paths.cert)?,
        key: read(&paths.key)?,
        client_ca: paths.client_ca.as_deref().map(read).transpose()?,
    })
}

fn read(path: &Path) -> Result<Vec<u8>, ServeError> {
    std::fs::read(path).map_err(|source| ServeError::TlsFile {
        path: path.to_owned(),
        source,
    })
}

fn invalid(path: &Path, problem: impl std::fmt::Display) -> ServeError {
    ServeError::TlsInvalid {
        path: path.to_owned(),
        problem: problem.to_string(),
    }
}

fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, ServeError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| invalid(path, format!("not PEM certificates: {error}")))?;
    if certs.is_empty() {
        return Err(invalid(path, "no PEM certificate in it"));
    }
    Ok(certs)
}

/// A rustls server configuration from the files' bytes (HTTP/2 only, as gRPC needs).
fn server_config(paths: &ServerTls, files: &Files) -> Result<Arc<ServerConfig>, ServeError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = certificates(&paths.cert, &files.cert)?;
    let key = PrivateKeyDer::from_pem_slice(&files.key)
        .map_err(|error| invalid(&paths.key, format!("not a PEM private key: {error}")))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|error| invalid(&paths.cert, error))?;
    let builder = match (&paths.client_ca, &files.client_ca) {
        (Some(path), Some(pem)) => {
            let mut roots = RootCertStore::empty();
            for ca in certificates(path, pem)? {
                roots
                    .add(ca)
                    .map_err(|error| invalid(path, format!("not a CA certificate: {error}")))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|error| invalid(path, error))?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|error| {
        invalid(
            &paths.key,
            format!("does not go with {}: {error}", paths.cert.display()),
        )
    })?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}
