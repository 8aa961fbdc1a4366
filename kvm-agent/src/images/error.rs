//! The image layer's error: fetching an image, verifying it, and keeping base volumes on
//! a host (through the libvirt layer, whose errors it carries).
//!
//! [`ImageError::classify`] is the layer's one verdict on each.

use std::sync::Arc;
use std::time::Duration;

use crate::classification::{Classification, ErrorClass};
use crate::config::error::ConfigError;
use crate::libvirt::LibvirtError;
use crate::transport::call::CallError;
use crate::transport::error::TransportError;

/// Errors of the base image cache.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// An image server answered with an HTTP error.
    #[error("image {url}: the server answered HTTP {status}")]
    Http {
        /// The image's URL.
        url: String,
        /// The HTTP status code.
        status: u16,
    },

    /// An image could not be requested (network, TLS, bad URL).
    #[error("image {url}: cannot fetch: {reason}")]
    Fetch {
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
    Truncated {
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
    Checksum {
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
    Downloading {
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
    Format {
        /// The image's URL.
        url: String,
        /// What libvirt found, against what the configuration says.
        problem: String,
    },

    /// Local I/O of the agent itself failed (spooling an image download).
    #[error("{context}")]
    Io {
        /// What the agent was doing.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// An image's configuration cannot be used (its digest).
    #[error(transparent)]
    Config(#[from] ConfigError),

    /// Creating, inspecting or deleting a base volume on the host failed.
    #[error(transparent)]
    Libvirt(#[from] LibvirtError),

    /// The failure of work shared by several callers (one image download), as each of
    /// them sees it: message, class and reason are the underlying error's.
    #[error(transparent)]
    Shared(Arc<ImageError>),
}

/// `bytes` in MiB with one decimal, for messages people read.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

/// 5xx, 429 (too many requests) and 408 (timeout) may pass; other statuses will not.
fn http_status_is_transient(status: u16) -> bool {
    matches!(status, 500..=599 | 429 | 408)
}

impl ImageError {
    /// Local I/O failed while doing `context`.
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    /// The layer's verdict: class, reason and retry hint.
    pub fn classify(&self) -> Classification {
        use ErrorClass as C;
        let of = Classification::new;
        match self {
            ImageError::Http {
                status: 404 | 410, ..
            } => of(C::Permanent, "IMAGE_NOT_FOUND"),
            ImageError::Http {
                status: 401 | 403, ..
            } => of(C::Permanent, "IMAGE_FORBIDDEN"),
            ImageError::Http { status, .. } if http_status_is_transient(*status) => {
                of(C::Transient, "IMAGE_SERVER_ERROR")
            }
            ImageError::Http { .. } => of(C::Permanent, "IMAGE_HTTP_ERROR"),
            ImageError::Fetch {
                permanent: true, ..
            } => of(C::Permanent, "IMAGE_URL_INVALID"),
            ImageError::Fetch { .. } => of(C::Transient, "IMAGE_UNREACHABLE"),
            ImageError::Truncated { .. } => of(C::Transient, "IMAGE_TRUNCATED"),
            ImageError::Checksum { .. } => of(C::Permanent, "IMAGE_CHECKSUM_MISMATCH"),
            ImageError::PoolFull { .. } => of(C::Transient, "POOL_FULL"),
            ImageError::Downloading { retry_in, .. } => {
                of(C::Transient, "IMAGE_DOWNLOADING").retry_after(*retry_in)
            }
            ImageError::Format { .. } => of(C::Permanent, "IMAGE_FORMAT_MISMATCH"),
            ImageError::Io { .. } => of(C::Transient, "AGENT_IO_FAILED"),
            ImageError::Config(e) => e.classify(),
            ImageError::Libvirt(e) => e.classify(),
            ImageError::Shared(error) => error.classify(),
        }
    }

    /// What a caller should do about this error (`NotFound`: the object it is about is
    /// missing).
    pub fn class(&self) -> ErrorClass {
        self.classify().class
    }

    /// Whether the libvirt connection the error happened on must be discarded (only a
    /// libvirt error reported on a healthy connection keeps it).
    pub fn drops_connection(&self) -> bool {
        match self {
            ImageError::Libvirt(e) => e.drops_connection(),
            ImageError::Shared(error) => error.drops_connection(),
            _ => true,
        }
    }

    /// The libvirt error code, when libvirt reported the error.
    pub fn libvirt_code(&self) -> Option<i32> {
        match self {
            ImageError::Libvirt(e) => e.libvirt_code(),
            ImageError::Shared(error) => error.libvirt_code(),
            _ => None,
        }
    }
}

impl From<TransportError> for ImageError {
    fn from(error: TransportError) -> Self {
        Self::Libvirt(error.into())
    }
}

impl CallError for ImageError {
    fn libvirt_code(&self) -> Option<i32> {
        ImageError::libvirt_code(self)
    }
}
