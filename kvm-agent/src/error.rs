//! The crate's top-level error, and THE mapping of every error to the contract.
//!
//! Each layer has its own error type and classifies its own errors once
//! ([`Classification`]: the contract's class, the reason code, a retry hint):
//! [`TransportError`] (SSH, relay, libvirt, deadlines, workers), [`ConfigError`], the
//! libvirt layer's [`XmlError`] (XML libvirt returned that the agent cannot read is its own
//! case, never an I/O failure), and the guest layer's [`GuestError`]. [`Error`] wraps them
//! with `#[from]`, adds the errors of the image cache and of the provider itself, and
//! [`Error::to_provider_error`] turns any of them into the contract's error: the only
//! place a [`ProviderError`] is built.

use std::time::Duration;

pub use egressproxy_provider::ErrorClass;
use egressproxy_provider::ProviderError;

pub use crate::config::error::{ConfigError, ConfigProblem};
pub use crate::guest::GuestError;
use crate::libvirt::xml::XmlError;
pub use crate::transport::error::TransportError;
pub use crate::transport::libvirt_error::{
    LibvirtFailure, classify_libvirt, classify_libvirt_parts,
};
pub use classification::Classification;

mod classification;

/// Errors of the kvm-agent.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),

    /// Reaching a host or calling its libvirt failed.
    #[error(transparent)]
    Transport(#[from] TransportError),

    /// A request's cloud-init documents cannot be used.
    #[error(transparent)]
    Guest(#[from] GuestError),

    /// An image server answered with an HTTP error.
    #[error("image {url}: the server answered HTTP {status}")]
    ImageHttp {
        /// The image's URL.
        url: String,
        /// The HTTP status code.
        status: u16,
    },

    /// An image could not be requested (network, TLS, bad URL).
    #[error("image {url}: cannot fetch: {reason}")]
    ImageFetch {
        /// The image's URL.
        url: String,
        /// What went wrong, with its causes.
        reason: String,
        /// Whether retrying cannot help (an invalid URL).
        permanent: bool,
    },

    /// An image download ended before all its bytes arrived.
    #[error(
        "image {url}: download ended after {received} bytes{}: {reason}",
        expected.map(|e| format!(" of {e}")).unwrap_or_default()
    )]
    ImageTruncated {
        /// The image's URL.
        url: String,
        /// Bytes received.
        received: u64,
        /// Bytes announced, if the server said.
        expected: Option<u64>,
        /// Why it ended.
        reason: String,
    },

    /// A downloaded image does not have the configured SHA-256.
    #[error(
        "image {url}: SHA-256 is {actual}, the configuration expects {expected}; fix the \
         image's url or sha256"
    )]
    ImageChecksum {
        /// The image's URL.
        url: String,
        /// The configured digest.
        expected: String,
        /// The digest of what was downloaded.
        actual: String,
    },

    /// A storage pool has less free space than a base image needs: libvirt would only
    /// report its upload helper's end of file, which names neither the cause nor the pool.
    #[error(
        "storage pool {pool} on host {host} is full: {} free, image {image} needs {}; \
         free space in the pool or grow its filesystem (retried with backoff), or place \
         the Proxy on another host",
        mib(*available),
        mib(*needed)
    )]
    PoolFull {
        /// Host name from the configuration.
        host: String,
        /// The storage pool.
        pool: String,
        /// The image's name in the configuration.
        image: String,
        /// Bytes the upload still needs.
        needed: u64,
        /// Bytes the pool has free.
        available: u64,
    },

    /// A caller's deadline passed while the download of a base image it needs goes on
    /// (detached, under `transport.imageDownloadTimeout`); a later Create finds it done.
    #[error(
        "image {image} still downloading on host {host}: {received} of {} bytes",
        expected.map(|e| e.to_string()).unwrap_or_else(|| "unknown".into())
    )]
    ImageDownloading {
        /// The image's name in the configuration.
        image: String,
        /// Host name from the configuration.
        host: String,
        /// Bytes received so far.
        received: u64,
        /// Bytes announced, if the server said.
        expected: Option<u64>,
        /// When the download should be done, at the rate so far (the retry hint).
        retry_in: Duration,
    },

    /// The downloaded image is not in the configured format, or refers to a backing file
    /// (which would let a guest read a file of the hypervisor).
    #[error("image {url}: {problem}; fix the image's format or url")]
    ImageFormat {
        /// The image's URL.
        url: String,
        /// What libvirt found, against what the configuration says.
        problem: String,
    },

    /// The failure of work shared by several callers (one image download), as each of
    /// them sees it: message, class and reason are the underlying error's.
    #[error(transparent)]
    Shared(std::sync::Arc<Error>),

    /// Local I/O of the agent itself failed (spooling an image download).
    #[error("{context}")]
    Io {
        /// What the agent was doing.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A domain has the instance's name but was not created by the agent (no metadata);
    /// it is never touched.
    #[error(
        "key {key}: host {host} has a domain named {domain} that this agent did not create; \
         it is left alone: rename or remove it, or use another key"
    )]
    DomainNameTaken {
        /// Host name from the configuration.
        host: String,
        /// The instance key.
        key: String,
        /// The domain's name.
        domain: String,
    },

    /// The domain XML could not be built from the request (a bug or an unencodable value).
    #[error("cannot build the domain XML of {domain}: {reason}")]
    DomainXmlInvalid {
        /// The domain's name.
        domain: String,
        /// The serializer's error.
        reason: String,
    },

    /// The host check found problems that make Create fail; each with what to fix.
    #[error("host {host} is not ready: {}", failures.join("; "))]
    HostNotReady {
        /// Host name from the configuration.
        host: String,
        /// Each failed check with its fix.
        failures: Vec<String>,
    },

    /// Another Create (or Delete) of the same key in this agent still ran when the
    /// caller's deadline passed; its outcome decides this one's.
    #[error(
        "key {key} on host {host}: another Create or Delete of the same key is in progress \
         (waited {waited:?}); retry"
    )]
    CreateInProgress {
        /// Host name from the configuration.
        host: String,
        /// The instance key.
        key: String,
        /// How long the caller waited.
        waited: Duration,
    },

    /// The `domainType: auto` KVM probe of the host (up to 15 s, under its own deadline)
    /// still ran when the caller's deadline passed; a later call gets its answer.
    #[error("host {host}: the KVM probe (domainType: auto) is still running; retry")]
    KvmProbeRunning {
        /// Host name from the configuration.
        host: String,
        /// When the probe should be done at the latest (the retry hint).
        retry_in: Duration,
    },

    /// Create found the key's instance, made from another spec (placement, cloud-init or
    /// proxy port): the key is taken.
    #[error(
        "key {key} belongs to instance {host}/{key}, created with a different placement, \
         cloud-init or proxy port: delete it first or use another key"
    )]
    SpecMismatch {
        /// Host name from the configuration.
        host: String,
        /// The instance key.
        key: String,
    },

    /// The instance a request names does not exist.
    #[error("instance {id} does not exist ({detail})")]
    InstanceNotFound {
        /// The instance id as requested.
        id: String,
        /// Why it is missing (no such domain, or an id this provider cannot have made).
        detail: String,
    },

    /// The domain Create just made or found was gone when it was read back.
    #[error("domain {domain} vanished right after Create made it (deleted concurrently?)")]
    InstanceVanished {
        /// The domain's name.
        domain: String,
    },

    /// Request fields this provider cannot use, each with what is wrong (the message shows
    /// the first; the contract's field violations list them all).
    #[error("{}", violations.first().map(|(f, d)| format!("{f}: {d}")).unwrap_or_default())]
    InvalidFields {
        /// Each field with what is wrong with it.
        violations: Vec<(String, String)>,
    },

    /// A request field this provider cannot use.
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// The field's name in the request.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// XML the agent exchanges with libvirt could not be read back (libvirt returned
    /// something the agent does not understand) or not be built. Not an I/O failure:
    /// retrying the same call gets the same XML.
    #[error("{context}: {error}")]
    Xml {
        /// What the agent was reading or building.
        context: String,
        /// The XML error.
        error: XmlError,
    },

    /// The task running Create's steps panicked or was cancelled.
    #[error("Create of key {key} stopped unexpectedly: {reason}")]
    CreateTaskFailed {
        /// The instance key.
        key: String,
        /// Panic or cancellation message.
        reason: String,
    },
}

/// 5xx, 429 (too many requests) and 408 (timeout) may pass; other statuses will not.
fn http_status_is_transient(status: u16) -> bool {
    matches!(status, 500..=599 | 429 | 408)
}

impl Error {
    /// A configuration error with `problems`.
    pub fn config(problems: Vec<ConfigProblem>) -> Self {
        Self::Config(ConfigError { problems })
    }

    /// The verdict of the layer the error comes from: class, reason and retry hint.
    pub fn classify(&self) -> Classification {
        use ErrorClass as C;
        let of = Classification::new;
        match self {
            Error::Config(e) => e.classify(),
            Error::Transport(e) => e.classify(),
            Error::Guest(e) => e.classify(),
            Error::Xml { error, .. } => error.classify(),
            Error::Shared(error) => error.classify(),
            // The image cache.
            Error::ImageHttp {
                status: 404 | 410, ..
            } => of(C::Permanent, "IMAGE_NOT_FOUND"),
            Error::ImageHttp {
                status: 401 | 403, ..
            } => of(C::Permanent, "IMAGE_FORBIDDEN"),
            Error::ImageHttp { status, .. } if http_status_is_transient(*status) => {
                of(C::Transient, "IMAGE_SERVER_ERROR")
            }
            Error::ImageHttp { .. } => of(C::Permanent, "IMAGE_HTTP_ERROR"),
            Error::ImageFetch {
                permanent: true, ..
            } => of(C::Permanent, "IMAGE_URL_INVALID"),
            Error::ImageFetch { .. } => of(C::Transient, "IMAGE_UNREACHABLE"),
            Error::ImageTruncated { .. } => of(C::Transient, "IMAGE_TRUNCATED"),
            Error::ImageChecksum { .. } => of(C::Permanent, "IMAGE_CHECKSUM_MISMATCH"),
            Error::ImageDownloading { retry_in, .. } => {
                of(C::Transient, "IMAGE_DOWNLOADING").retry_after(*retry_in)
            }
            Error::ImageFormat { .. } => of(C::Permanent, "IMAGE_FORMAT_MISMATCH"),
            Error::PoolFull { .. } => of(C::Transient, "POOL_FULL"),
            Error::Io { .. } => of(C::Transient, "AGENT_IO_FAILED"),
            // The provider's own.
            Error::DomainNameTaken { .. } => of(C::AlreadyExists, "DOMAIN_NAME_TAKEN"),
            Error::DomainXmlInvalid { .. } => of(C::Permanent, "DOMAIN_XML_INVALID"),
            Error::HostNotReady { .. } => of(C::Permanent, "HOST_NOT_READY"),
            Error::CreateInProgress { .. } => of(C::Transient, "CREATE_IN_PROGRESS"),
            Error::KvmProbeRunning { retry_in, .. } => {
                of(C::Transient, "KVM_PROBE_RUNNING").retry_after(*retry_in)
            }
            Error::SpecMismatch { .. } => of(C::AlreadyExists, "SPEC_MISMATCH"),
            Error::InstanceNotFound { .. } => of(C::NotFound, "INSTANCE_NOT_FOUND"),
            Error::InstanceVanished { .. } => of(C::Transient, "INSTANCE_VANISHED"),
            Error::InvalidArgument { .. } | Error::InvalidFields { .. } => {
                of(C::InvalidArgument, "INVALID_ARGUMENT")
            }
            Error::CreateTaskFailed { .. } => of(C::Transient, "AGENT_WORKER_FAILED"),
        }
    }

    /// What a caller should do about this error, as the layer it comes from sees it
    /// (`NotFound`: the object the error is about is missing).
    pub fn class(&self) -> ErrorClass {
        self.classify().class
    }

    /// Whether the libvirt connection the error happened on must be discarded.
    ///
    /// Errors libvirt reports about the operation keep a healthy connection; transport
    /// failures, deadline expiry and worker panics drop it.
    pub fn drops_connection(&self) -> bool {
        match self {
            Error::Transport(e) => e.drops_connection(),
            _ => true,
        }
    }

    /// The libvirt error code, when libvirt reported the error.
    pub fn libvirt_code(&self) -> Option<i32> {
        match self {
            Error::Transport(e) => e.libvirt_code(),
            Error::Shared(error) => error.libvirt_code(),
            _ => None,
        }
    }

    /// XML that could not be read or built, while doing `context`.
    pub(crate) fn xml(context: impl Into<String>, error: XmlError) -> Self {
        Self::Xml {
            context: context.into(),
            error,
        }
    }

    pub(crate) fn transport_io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Transport(TransportError::Io {
            context: context.into(),
            source,
        })
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    fn is_instance_missing(&self) -> bool {
        match self {
            Error::InstanceNotFound { .. } => true,
            Error::Shared(error) => error.is_instance_missing(),
            _ => false,
        }
    }

    /// The request fields at fault, for an invalid argument.
    fn field_violations(&self) -> Vec<(String, String)> {
        match self {
            Error::InvalidArgument { field, reason } => vec![((*field).to_owned(), reason.clone())],
            Error::InvalidFields { violations } => violations.clone(),
            Error::Guest(e) => e.field_violations(),
            Error::Shared(error) => error.field_violations(),
            _ => Vec::new(),
        }
    }

    /// The error as the Provider contract carries it: the layer's class and reason, the
    /// message, the retry hint and the fields at fault. The table test lists every case.
    ///
    /// The contract's NOT_FOUND means *the instance* is gone (the operator then forgets
    /// it), which only Get and Delete decide, from the domain lookup. Any other object
    /// that is missing (pool, network, volume) is therefore FAILED_PRECONDITION here.
    pub fn to_provider_error(&self) -> ProviderError {
        let Classification {
            class,
            reason,
            retry_after,
        } = self.classify();
        let class = match class {
            ErrorClass::NotFound if !self.is_instance_missing() => ErrorClass::Permanent,
            class => class,
        };
        let retry_after = retry_after.filter(|_| class == ErrorClass::Transient);
        self.field_violations().into_iter().fold(
            ProviderError::new(class, self.to_string())
                .with_reason(reason)
                .with_retry_after(retry_after),
            |error, (field, description)| error.with_violation(field, description),
        )
    }
}

impl From<Error> for ProviderError {
    fn from(error: Error) -> Self {
        error.to_provider_error()
    }
}

#[cfg(test)]
mod tests;

/// `bytes` in MiB with one decimal, for messages people read.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}
