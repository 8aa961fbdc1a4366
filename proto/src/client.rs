//! Connecting to a provider: every call carries the caller's W3C trace context and a
//! deadline (`grpc-timeout`), so a hung provider never hangs its caller.
//!
//! The deadline is enforced on both sides: the provider sees `grpc-timeout`, and the
//! client itself gives up when it passes and reports DEADLINE_EXCEEDED (tonic's own
//! timeout reports CANCELLED, which would be misread as a transient failure).

use std::path::PathBuf;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tower::Layer;

use crate::deadline::{Deadline, DeadlineLayer};
use crate::pb::provider_client::ProviderClient;
use crate::trace_context;

/// A Provider client whose calls carry trace context and a deadline.
pub type Client = ProviderClient<InterceptedService<Deadline<Channel>, CallContext>>;

/// Files that configure the client's TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTls {
    /// PEM CA bundle that signed the provider's certificate.
    pub ca: PathBuf,
    /// Name to verify in the provider's certificate; default: the endpoint's host.
    pub domain: Option<String>,
    /// PEM client certificate and key, for mutual TLS.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// How to reach a provider.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// `http://host:port` or `https://host:port`.
    pub endpoint: String,
    /// Deadline of each call that does not set its own.
    pub call_timeout: Duration,
    /// Deadline of establishing the connection.
    pub connect_timeout: Duration,
    /// TLS settings; required for `https://` endpoints.
    pub tls: Option<ClientTls>,
}

impl ClientOptions {
    /// Plaintext options with default deadlines (30 s per call, 5 s to connect).
    pub fn new(endpoint: impl Into<String>) -> Self {
        ClientOptions {
            endpoint: endpoint.into(),
            call_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            tls: None,
        }
    }
}

/// Why a client could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The endpoint is not a valid URI.
    #[error(
        "invalid provider endpoint {endpoint:?}: expected http://host:port or https://host:port"
    )]
    Endpoint {
        /// The endpoint as given.
        endpoint: String,
        /// The parse error.
        #[source]
        source: tonic::transport::Error,
    },
    /// A TLS file could not be read.
    #[error("cannot read TLS file {path}: check the path and its permissions")]
    TlsFile {
        /// The file that failed.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The TLS settings were rejected.
    #[error("invalid TLS settings for provider endpoint {endpoint}")]
    Tls {
        /// The endpoint.
        endpoint: String,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
}

/// Adds trace context and the default deadline to every outgoing call.
#[derive(Debug, Clone)]
pub struct CallContext {
    call_timeout: Duration,
}

impl tonic::service::Interceptor for CallContext {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if !request.metadata().contains_key("grpc-timeout") {
            request.set_timeout(self.call_timeout);
        }
        trace_context::inject_current(request.metadata_mut());
        Ok(request)
    }
}

/// Builds a client that connects lazily (on first call, and again after failures), so
/// an unavailable provider is an UNAVAILABLE call error, not a start-up failure.
pub fn connect_lazy(options: &ClientOptions) -> Result<Client, ConnectError> {
    let channel = DeadlineLayer::client().layer(endpoint(options)?.connect_lazy());
    Ok(ProviderClient::with_interceptor(
        channel,
        CallContext {
            call_timeout: options.call_timeout,
        },
    ))
}

/// A plain lazy channel to the provider with the same TLS settings, without trace
/// context or a per-call deadline: for health, reflection and raw-header checks.
pub fn raw_channel(options: &ClientOptions) -> Result<Channel, ConnectError> {
    Ok(endpoint(options)?.connect_lazy())
}

fn endpoint(options: &ClientOptions) -> Result<Endpoint, ConnectError> {
    let mut endpoint = Endpoint::from_shared(options.endpoint.clone())
        .map_err(|source| ConnectError::Endpoint {
            endpoint: options.endpoint.clone(),
            source,
        })?
        .connect_timeout(options.connect_timeout)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10));
    if let Some(tls) = &options.tls {
        let mut config =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(&tls.ca)?));
        if let Some(domain) = &tls.domain {
            config = config.domain_name(domain.clone());
        }
        if let Some((cert, key)) = &tls.identity {
            config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        endpoint = endpoint
            .tls_config(config)
            .map_err(|source| ConnectError::Tls {
                endpoint: options.endpoint.clone(),
                source,
            })?;
    }
    Ok(endpoint)
}

fn read(path: &PathBuf) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::TlsFile {
        path: path.clone(),
        source,
    })
}
