//! The crate's one error type, and THE mapping of every error to the contract.
//!
//! Every [`Error`] has a [`ErrorClass`] that tells a caller what to do (retry, surface and
//! stop, treat as absent, or report the deadline). libvirt errors are classified where
//! the call runs, in [`crate::transport::libvirt_error`]; a transport failure drops the
//! connection ([`Error::drops_connection`]).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use egressproxy_provider::ProviderError;

use crate::libvirt::xml::XmlError;
use crate::transport::libvirt_error::SYSTEM_ERROR;
pub use crate::transport::libvirt_error::{
    LibvirtFailure, classify_libvirt, classify_libvirt_parts,
};

/// What a caller should do about an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retry with backoff: the host, network or daemon may recover.
    Transient,
    /// Retrying the same request cannot succeed until configuration or input changes.
    Permanent,
    /// The object does not exist.
    NotFound,
    /// The caller's deadline passed; the operation's outcome is unknown.
    DeadlineExceeded,
    /// Something else holds the name the request needs; retrying cannot help until it is
    /// removed or the request changes.
    Conflict,
}

/// One problem in the configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigProblem {
    /// The field's path, e.g. `hosts[0].ssh.privateKey` (or a line/column for syntax errors).
    pub field: String,
    /// What is wrong and what to do.
    pub message: String,
}

impl ConfigProblem {
    /// A problem with `field`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.field, self.message)
        }
    }
}

/// Errors of the kvm-agent.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration file is unreadable or invalid; all problems are listed.
    #[error("invalid configuration:\n{}", list(.problems))]
    Config {
        /// Each problem with its field.
        problems: Vec<ConfigProblem>,
    },

    /// A request named a host that is not configured.
    #[error("host {host:?} is not in the configuration")]
    UnknownHost {
        /// The requested host name.
        host: String,
    },

    /// TCP connect to the SSH server failed.
    #[error("host {host}: cannot connect to SSH server {address}")]
    SshConnect {
        /// Host name from the configuration.
        host: String,
        /// `host:port` dialled.
        address: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },

    /// TCP connect, key exchange and authentication did not finish in time.
    #[error("host {host}: SSH handshake did not finish within {after:?}")]
    SshHandshakeTimeout {
        /// Host name from the configuration.
        host: String,
        /// The handshake deadline.
        after: Duration,
    },

    /// The SSH protocol failed or the session closed.
    #[error("host {host}: SSH session failed")]
    Ssh {
        /// Host name from the configuration.
        host: String,
        /// russh's error.
        #[source]
        source: russh::Error,
    },

    /// The server's host key is not in `known_hosts`.
    #[error(
        "host {host}: unknown SSH host key {fingerprint} (not in {}); verify the fingerprint on \
         the hypervisor (`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`) and add the key",
        known_hosts.display()
    )]
    HostKeyUnknown {
        /// Host name from the configuration.
        host: String,
        /// `SHA256:...` fingerprint of the key the server presented.
        fingerprint: String,
        /// The `known_hosts` file consulted.
        known_hosts: PathBuf,
    },

    /// The server's host key differs from the one in `known_hosts`.
    #[error(
        "host {host}: SSH host key CHANGED: server presented {fingerprint}, {} line {line} \
         records another key; possible man-in-the-middle. If the hypervisor was reinstalled, \
         replace that line",
        known_hosts.display()
    )]
    HostKeyChanged {
        /// Host name from the configuration.
        host: String,
        /// `SHA256:...` fingerprint of the key the server presented.
        fingerprint: String,
        /// The `known_hosts` file consulted.
        known_hosts: PathBuf,
        /// The line that records the other key.
        line: usize,
    },

    /// The server rejected public-key authentication.
    #[error(
        "host {host}: SSH server rejected public key {key_fingerprint} for user {user:?}; add \
         it to that user's authorized_keys"
    )]
    SshAuthRejected {
        /// Host name from the configuration.
        host: String,
        /// Remote user.
        user: String,
        /// Fingerprint of the client's public key (never the private key).
        key_fingerprint: String,
    },

    /// Recent SSH connects to the host failed; the next attempt is not due before the
    /// caller's deadline.
    #[error(
        "host {host}: not reconnecting for another {retry_in:?} after SSH failures (last: {last_error})"
    )]
    SshBackingOff {
        /// Host name from the configuration.
        host: String,
        /// Time until the next attempt.
        retry_in: Duration,
        /// The last failure, as text.
        last_error: String,
        /// The last failure's class (a rejected host key stays permanent).
        last_class: ErrorClass,
    },

    /// The SSH session closed under an open connection: the peer went away or stopped
    /// answering keepalives.
    #[error("host {host}: SSH session closed (hypervisor unreachable or not answering keepalives)")]
    SshSessionClosed {
        /// Host name from the configuration.
        host: String,
    },

    /// The SSH server refused to forward the libvirt socket, or the socket does not exist.
    #[error(
        "host {host}: SSH server refused to forward {}: {reason}; check that libvirtd runs and \
         listens there, that the SSH user may use it, and that sshd has \
         `AllowTcpForwarding local` (or `yes`)",
        socket.display()
    )]
    ForwardRefused {
        /// Host name from the configuration.
        host: String,
        /// Remote libvirt socket.
        socket: PathBuf,
        /// The channel-open failure.
        reason: String,
    },

    /// The local libvirt socket (local mode) cannot be connected.
    #[error("host {host}: cannot connect to libvirt socket {}", socket.display())]
    LocalSocket {
        /// Host name from the configuration.
        host: String,
        /// Local libvirt socket.
        socket: PathBuf,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },

    /// A libvirt API call failed.
    #[error("host {host}: {op} failed: {} ({})", failure.message, failure.code_name)]
    Libvirt {
        /// Host name from the configuration.
        host: String,
        /// libvirt API name, e.g. `virDomainDefineXML`.
        op: &'static str,
        /// The classified libvirt error.
        failure: LibvirtFailure,
    },

    /// The caller's deadline passed; the connection under the call was dropped.
    #[error("host {host}: {op} did not finish within {after:?}")]
    DeadlineExceeded {
        /// Host name from the configuration.
        host: String,
        /// libvirt API name (or `connect`).
        op: &'static str,
        /// The time the call was given.
        after: Duration,
    },

    /// The connection under the call was cut because another call on it ran past its
    /// deadline (the host stopped answering); the call's outcome is unknown.
    #[error("host {host}: {op} aborted: its connection was cut after {cause}")]
    ConnectionCut {
        /// Host name from the configuration.
        host: String,
        /// libvirt API name.
        op: &'static str,
        /// Why the connection was cut.
        cause: String,
    },

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

    /// Local I/O of the agent itself failed (private socket directory, relay).
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

    /// A blocking libvirt task panicked or was cancelled.
    #[error("host {host}: {op} worker ended abnormally: {reason}")]
    Worker {
        /// Host name from the configuration.
        host: String,
        /// libvirt API name.
        op: &'static str,
        /// Panic or cancellation message.
        reason: String,
    },
}

/// 5xx, 429 (too many requests) and 408 (timeout) may pass; other statuses will not.
fn http_status_class(status: u16) -> ErrorClass {
    match status {
        500..=599 | 429 | 408 => ErrorClass::Transient,
        _ => ErrorClass::Permanent,
    }
}

fn list(problems: &[ConfigProblem]) -> String {
    problems
        .iter()
        .map(|p| format!("  - {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}

impl Error {
    /// A configuration error with `problems`.
    pub fn config(problems: Vec<ConfigProblem>) -> Self {
        Self::Config { problems }
    }

    /// What a caller should do about this error.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Config { .. }
            | Error::UnknownHost { .. }
            | Error::HostKeyUnknown { .. }
            | Error::HostKeyChanged { .. }
            | Error::SshAuthRejected { .. }
            | Error::DomainXmlInvalid { .. }
            | Error::InvalidArgument { .. }
            | Error::Xml { .. }
            | Error::HostNotReady { .. } => ErrorClass::Permanent,
            Error::DomainNameTaken { .. } | Error::SpecMismatch { .. } => ErrorClass::Conflict,
            Error::InstanceNotFound { .. } => ErrorClass::NotFound,
            Error::InstanceVanished { .. } | Error::CreateTaskFailed { .. } => {
                ErrorClass::Transient
            }
            Error::CreateInProgress { .. } | Error::KvmProbeRunning { .. } => ErrorClass::Transient,
            Error::SshConnect { .. }
            | Error::SshHandshakeTimeout { .. }
            | Error::Ssh { .. }
            | Error::SshSessionClosed { .. }
            | Error::ForwardRefused { .. }
            | Error::LocalSocket { .. }
            | Error::ConnectionCut { .. }
            | Error::Io { .. }
            | Error::Worker { .. } => ErrorClass::Transient,
            Error::Libvirt { failure, .. } => failure.class,
            Error::SshBackingOff { last_class, .. } => *last_class,
            Error::DeadlineExceeded { .. } => ErrorClass::DeadlineExceeded,
            Error::ImageHttp { status, .. } => http_status_class(*status),
            Error::ImageFetch { permanent, .. } => {
                if *permanent {
                    ErrorClass::Permanent
                } else {
                    ErrorClass::Transient
                }
            }
            Error::ImageTruncated { .. } | Error::ImageDownloading { .. } => ErrorClass::Transient,
            Error::ImageChecksum { .. } | Error::ImageFormat { .. } => ErrorClass::Permanent,
            Error::Shared(error) => error.class(),
        }
    }

    /// Whether the libvirt connection the error happened on must be discarded.
    ///
    /// Errors libvirt reports about the operation keep a healthy connection; transport
    /// failures, deadline expiry and worker panics drop it.
    pub fn drops_connection(&self) -> bool {
        !matches!(self, Error::Libvirt { failure, .. } if !failure.transport)
    }

    /// The libvirt error code, when libvirt reported the error.
    pub fn libvirt_code(&self) -> Option<i32> {
        match self {
            Error::Libvirt { failure, .. } => Some(failure.code),
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

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

impl Error {
    /// The error as the Provider contract carries it: class, a stable reason, the message,
    /// and a retry hint when the agent knows one. The table test below lists every case.
    ///
    /// A libvirt object that does not exist (pool, network, volume) maps to
    /// FAILED_PRECONDITION, not NOT_FOUND: the contract's NOT_FOUND means *the instance*
    /// is gone (the operator then forgets it), which only Get and Delete decide, from the
    /// domain lookup. A host missing from the configuration is permanent: an endless retry
    /// would pin the operator's finalizer.
    pub fn to_provider_error(&self) -> ProviderError {
        use egressproxy_provider::ErrorClass as C;
        let (class, reason) = match self {
            Error::Shared(error) => return error.to_provider_error(),
            Error::Config { .. } => (C::Permanent, "AGENT_CONFIG_INVALID"),
            Error::UnknownHost { .. } => (C::Permanent, "HOST_NOT_CONFIGURED"),
            Error::SshConnect { .. }
            | Error::SshHandshakeTimeout { .. }
            | Error::SshSessionClosed { .. }
            | Error::LocalSocket { .. } => (C::Transient, "HOST_UNREACHABLE"),
            Error::Ssh { .. } => (C::Transient, "SSH_FAILED"),
            Error::HostKeyUnknown { .. } => (C::Permanent, "SSH_HOST_KEY_UNKNOWN"),
            Error::HostKeyChanged { .. } => (C::Permanent, "SSH_HOST_KEY_CHANGED"),
            Error::SshAuthRejected { .. } => (C::Permanent, "SSH_AUTH_REJECTED"),
            Error::SshBackingOff { last_class, .. } => match last_class {
                ErrorClass::Permanent => (C::Permanent, "SSH_BACKING_OFF"),
                _ => (C::Transient, "SSH_BACKING_OFF"),
            },
            Error::ForwardRefused { .. } => (C::Transient, "LIBVIRT_FORWARD_REFUSED"),
            Error::Libvirt { failure, .. } => match failure.class {
                _ if failure.transport => (C::Transient, "LIBVIRT_CONNECTION_FAILED"),
                ErrorClass::NotFound => (C::Permanent, "LIBVIRT_OBJECT_MISSING"),
                ErrorClass::Permanent | ErrorClass::Conflict => (C::Permanent, "LIBVIRT_REJECTED"),
                ErrorClass::DeadlineExceeded => (C::DeadlineExceeded, "LIBVIRT_DEADLINE"),
                ErrorClass::Transient if failure.code == SYSTEM_ERROR => {
                    (C::Transient, "LIBVIRT_HOST_ERROR")
                }
                ErrorClass::Transient => (C::Transient, "LIBVIRT_FAILED"),
            },
            Error::DomainNameTaken { .. } => (C::AlreadyExists, "DOMAIN_NAME_TAKEN"),
            Error::DomainXmlInvalid { .. } => (C::Permanent, "DOMAIN_XML_INVALID"),
            Error::HostNotReady { .. } => (C::Permanent, "HOST_NOT_READY"),
            Error::CreateInProgress { .. } => (C::Transient, "CREATE_IN_PROGRESS"),
            Error::KvmProbeRunning { .. } => (C::Transient, "KVM_PROBE_RUNNING"),
            Error::DeadlineExceeded { .. } => (C::DeadlineExceeded, "LIBVIRT_DEADLINE"),
            Error::ConnectionCut { .. } => (C::Transient, "LIBVIRT_CONNECTION_CUT"),
            Error::Io { .. } => (C::Transient, "AGENT_IO_FAILED"),
            Error::Worker { .. } | Error::CreateTaskFailed { .. } => {
                (C::Transient, "AGENT_WORKER_FAILED")
            }
            Error::SpecMismatch { .. } => (C::AlreadyExists, "SPEC_MISMATCH"),
            Error::Xml {
                error: XmlError::Parse { .. },
                ..
            } => (C::Permanent, "LIBVIRT_XML_UNREADABLE"),
            Error::Xml { .. } => (C::Permanent, "LIBVIRT_XML_UNBUILDABLE"),
            Error::InstanceNotFound { .. } => (C::NotFound, "INSTANCE_NOT_FOUND"),
            Error::InstanceVanished { .. } => (C::Transient, "INSTANCE_VANISHED"),
            Error::InvalidArgument { field, reason } => {
                return ProviderError::invalid_argument(*field, reason.clone());
            }
            Error::ImageHttp { status, .. } => match (status, http_status_class(*status)) {
                (404 | 410, _) => (C::Permanent, "IMAGE_NOT_FOUND"),
                (401 | 403, _) => (C::Permanent, "IMAGE_FORBIDDEN"),
                (_, ErrorClass::Transient) => (C::Transient, "IMAGE_SERVER_ERROR"),
                _ => (C::Permanent, "IMAGE_HTTP_ERROR"),
            },
            Error::ImageFetch {
                permanent: true, ..
            } => (C::Permanent, "IMAGE_URL_INVALID"),
            Error::ImageFetch { .. } => (C::Transient, "IMAGE_UNREACHABLE"),
            Error::ImageTruncated { .. } => (C::Transient, "IMAGE_TRUNCATED"),
            Error::ImageChecksum { .. } => (C::Permanent, "IMAGE_CHECKSUM_MISMATCH"),
            Error::ImageDownloading { .. } => (C::Transient, "IMAGE_DOWNLOADING"),
            Error::ImageFormat { .. } => (C::Permanent, "IMAGE_FORMAT_MISMATCH"),
        };
        let retry_after = match self {
            Error::SshBackingOff { retry_in, .. } if class == C::Transient => Some(*retry_in),
            Error::ImageDownloading { retry_in, .. } | Error::KvmProbeRunning { retry_in, .. } => {
                Some(*retry_in)
            }
            _ => None,
        };
        ProviderError::new(class, self.to_string())
            .with_reason(reason)
            .with_retry_after(retry_after)
    }
}

impl From<Error> for ProviderError {
    fn from(error: Error) -> Self {
        error.to_provider_error()
    }
}

#[cfg(test)]
mod tests;
