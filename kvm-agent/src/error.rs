//! The crate's one error type, and the one place that classifies foreign errors.
//!
//! Every [`Error`] has a [`ErrorClass`] that tells a caller what to do (retry, surface and
//! stop, treat as absent, or report the deadline). libvirt errors are split in
//! [`classify_libvirt`]: an error libvirt *reports* (no such domain, bad XML) leaves the
//! connection healthy; an error of the *transport* under it (EOF, reset, RPC failure) means
//! the connection is dead and must be dropped ([`Error::drops_connection`]).

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use egressproxy_provider::ProviderError;
use virt::error::{ErrorDomain, ErrorNumber};

use crate::libvirt::xml::XmlError;

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

/// A libvirt error as reported by the library, detached from its FFI types.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LibvirtFailure {
    /// The `virErrorNumber` (e.g. 42 for `VIR_ERR_NO_DOMAIN`).
    pub code: i32,
    /// The code's name (e.g. `NoDomain`).
    pub code_name: String,
    /// libvirt's message.
    pub message: String,
    /// Whether the failure is the connection's transport, not the operation.
    pub transport: bool,
    /// The class derived from the code.
    pub class: ErrorClass,
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

/// `VIR_ERR_SYSTEM_ERROR`: an OS call failed, on the agent's side (the transport) or on
/// the hypervisor (EACCES, ENOSPC, EROFS, a failed qemu-img).
const SYSTEM_ERROR: i32 = 38;

/// Classifies a libvirt error. `connection_alive` is `virConnectIsAlive` after the failure.
pub fn classify_libvirt(error: &virt::error::Error, connection_alive: bool) -> LibvirtFailure {
    classify_libvirt_parts(
        error.code(),
        error.domain(),
        error.message(),
        connection_alive,
    )
}

/// [`classify_libvirt`] on the error's parts.
///
/// | error | transport (drops the connection) | class |
/// |---|---|---|
/// | any, on a dead connection | yes | transient |
/// | any from the RPC or remote layer (`VIR_FROM_RPC`, `VIR_FROM_REMOTE`) | yes | transient |
/// | `Rpc`, `NoConnect`, `InvalidConn`, `AuthFailed`, `Ssh`, `Libssh` | yes | transient |
/// | `SystemError` from the hypervisor's drivers (storage, qemu) on a live connection | no | transient (`LIBVIRT_HOST_ERROR`: fix the host, e.g. permissions or disk space; retried with backoff) |
/// | `No*` (domain, pool, volume, network, ...) | no | not found |
/// | invalid argument, XML, unsupported, denied, CPU incompatible | no | permanent |
/// | anything else | no | transient |
///
/// A `SystemError` libvirtd reports about the host (its own OS call failed) arrives on a
/// healthy connection: dropping that connection would not help, and an error that is
/// already classified must not cost the other calls on the connection their link. Only the client's own system errors (RPC/remote layer: EOF, reset) and any
/// error on a dead connection are transport failures.
pub fn classify_libvirt_parts(
    code: virt::error::ErrorNumberEnum,
    domain: virt::error::ErrorDomainEnum,
    message: &str,
    connection_alive: bool,
) -> LibvirtFailure {
    use ErrorNumber as N;
    let transport = !connection_alive
        || domain.is_any(vec![ErrorDomain::Rpc, ErrorDomain::Remote])
        || code.is_any(vec![
            N::Rpc,
            N::NoConnect,
            N::InvalidConn,
            N::AuthFailed,
            N::Ssh,
            N::Libssh,
        ]);
    let class = if transport {
        ErrorClass::Transient
    } else if code.is_any(vec![
        N::NoDomain,
        N::NoStoragePool,
        N::NoStorageVolume,
        N::NoNetwork,
        N::NoDomainMetadata,
        N::NoDomainSnapshot,
        N::NoSecret,
        N::NoInterface,
        N::NoNodeDevice,
    ]) {
        ErrorClass::NotFound
    } else if code.is_any(vec![
        N::InvalidArg,
        N::XmlError,
        N::XmlDetail,
        N::XmlInvalidSchema,
        N::ConfigUnsupported,
        N::NoSupport,
        N::ArgumentUnsupported,
        N::OperationUnsupported,
        N::OperationDenied,
        N::AccessDenied,
        N::CpuIncompatible,
    ]) {
        ErrorClass::Permanent
    } else {
        ErrorClass::Transient
    };
    LibvirtFailure {
        code: code.to_raw() as i32,
        code_name: code.to_string(),
        message: message.to_owned(),
        transport,
        class,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_error_lists_every_problem_with_its_field() {
        let err = Error::config(vec![
            ConfigProblem::new("hosts[0].name", "is empty"),
            ConfigProblem::new("hosts[1].ssh.user", "is empty"),
        ]);
        let text = err.to_string();
        assert!(text.contains("  - hosts[0].name: is empty"), "{text}");
        assert!(text.contains("  - hosts[1].ssh.user: is empty"), "{text}");
        assert_eq!(err.class(), ErrorClass::Permanent);
    }

    fn libvirt(class: ErrorClass, transport: bool) -> Error {
        Error::Libvirt {
            host: "hv".into(),
            op: "virStoragePoolLookupByName",
            failure: LibvirtFailure {
                code: 49,
                code_name: "NoStoragePool".into(),
                message: "no pool".into(),
                transport,
                class,
            },
        }
    }

    fn image_http(status: u16) -> Error {
        Error::ImageHttp {
            url: "https://example.org/i.qcow2".into(),
            status,
        }
    }

    /// One error of every kind the mapping tells apart, with its contract class and reason.
    fn mapping_table() -> Vec<(Error, egressproxy_provider::ErrorClass, &'static str)> {
        use egressproxy_provider::ErrorClass as C;
        use virt::error::{ErrorDomain as D, ErrorNumber as N};
        let io = || std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let backing_off = |last_class| Error::SshBackingOff {
            host: "hv".into(),
            retry_in: Duration::from_secs(3),
            last_error: "refused".into(),
            last_class,
        };
        let table: Vec<(Error, C, &str)> = vec![
            (Error::config(vec![]), C::Permanent, "AGENT_CONFIG_INVALID"),
            (
                Error::UnknownHost {
                    host: "gone".into(),
                },
                C::Permanent,
                "HOST_NOT_CONFIGURED",
            ),
            (
                Error::SshConnect {
                    host: "hv".into(),
                    address: "hv:22".into(),
                    source: io(),
                },
                C::Transient,
                "HOST_UNREACHABLE",
            ),
            (
                Error::SshHandshakeTimeout {
                    host: "hv".into(),
                    after: Duration::from_secs(10),
                },
                C::Transient,
                "HOST_UNREACHABLE",
            ),
            (
                Error::SshSessionClosed { host: "hv".into() },
                C::Transient,
                "HOST_UNREACHABLE",
            ),
            (
                Error::LocalSocket {
                    host: "hv".into(),
                    socket: "/s".into(),
                    source: io(),
                },
                C::Transient,
                "HOST_UNREACHABLE",
            ),
            (
                Error::Ssh {
                    host: "hv".into(),
                    source: russh::Error::Disconnect,
                },
                C::Transient,
                "SSH_FAILED",
            ),
            (
                Error::HostKeyUnknown {
                    host: "hv".into(),
                    fingerprint: "SHA256:x".into(),
                    known_hosts: "/kh".into(),
                },
                C::Permanent,
                "SSH_HOST_KEY_UNKNOWN",
            ),
            (
                Error::HostKeyChanged {
                    host: "hv".into(),
                    fingerprint: "SHA256:x".into(),
                    known_hosts: "/kh".into(),
                    line: 3,
                },
                C::Permanent,
                "SSH_HOST_KEY_CHANGED",
            ),
            (
                Error::SshAuthRejected {
                    host: "hv".into(),
                    user: "u".into(),
                    key_fingerprint: "SHA256:k".into(),
                },
                C::Permanent,
                "SSH_AUTH_REJECTED",
            ),
            (
                backing_off(ErrorClass::Transient),
                C::Transient,
                "SSH_BACKING_OFF",
            ),
            (
                backing_off(ErrorClass::Permanent),
                C::Permanent,
                "SSH_BACKING_OFF",
            ),
            (
                Error::ForwardRefused {
                    host: "hv".into(),
                    socket: "/s".into(),
                    reason: "denied".into(),
                },
                C::Transient,
                "LIBVIRT_FORWARD_REFUSED",
            ),
            (
                libvirt(ErrorClass::Transient, true),
                C::Transient,
                "LIBVIRT_CONNECTION_FAILED",
            ),
            (
                libvirt(ErrorClass::NotFound, false),
                C::Permanent,
                "LIBVIRT_OBJECT_MISSING",
            ),
            (
                libvirt(ErrorClass::Permanent, false),
                C::Permanent,
                "LIBVIRT_REJECTED",
            ),
            (
                libvirt(ErrorClass::Transient, false),
                C::Transient,
                "LIBVIRT_FAILED",
            ),
            (
                Error::DeadlineExceeded {
                    host: "hv".into(),
                    op: "virDomainCreate",
                    after: Duration::from_secs(1),
                },
                C::DeadlineExceeded,
                "LIBVIRT_DEADLINE",
            ),
            (
                Error::ConnectionCut {
                    host: "hv".into(),
                    op: "virDomainCreate",
                    cause: "x".into(),
                },
                C::Transient,
                "LIBVIRT_CONNECTION_CUT",
            ),
            (Error::io("relay", io()), C::Transient, "AGENT_IO_FAILED"),
            (
                Error::Worker {
                    host: "hv".into(),
                    op: "virDomainCreate",
                    reason: "panic".into(),
                },
                C::Transient,
                "AGENT_WORKER_FAILED",
            ),
            (image_http(404), C::Permanent, "IMAGE_NOT_FOUND"),
            (image_http(410), C::Permanent, "IMAGE_NOT_FOUND"),
            (image_http(403), C::Permanent, "IMAGE_FORBIDDEN"),
            (image_http(401), C::Permanent, "IMAGE_FORBIDDEN"),
            (image_http(500), C::Transient, "IMAGE_SERVER_ERROR"),
            (image_http(503), C::Transient, "IMAGE_SERVER_ERROR"),
            (image_http(429), C::Transient, "IMAGE_SERVER_ERROR"),
            (image_http(408), C::Transient, "IMAGE_SERVER_ERROR"),
            (image_http(400), C::Permanent, "IMAGE_HTTP_ERROR"),
            (image_http(304), C::Permanent, "IMAGE_HTTP_ERROR"),
            (
                Error::ImageFetch {
                    url: "u".into(),
                    reason: "refused".into(),
                    permanent: false,
                },
                C::Transient,
                "IMAGE_UNREACHABLE",
            ),
            (
                Error::ImageFetch {
                    url: "u".into(),
                    reason: "bad url".into(),
                    permanent: true,
                },
                C::Permanent,
                "IMAGE_URL_INVALID",
            ),
            (
                Error::ImageTruncated {
                    url: "u".into(),
                    received: 1,
                    expected: Some(2),
                    reason: "eof".into(),
                },
                C::Transient,
                "IMAGE_TRUNCATED",
            ),
            (
                Error::ImageChecksum {
                    url: "u".into(),
                    expected: "a".into(),
                    actual: "b".into(),
                },
                C::Permanent,
                "IMAGE_CHECKSUM_MISMATCH",
            ),
            (
                Error::ImageDownloading {
                    image: "debian".into(),
                    host: "hv".into(),
                    received: 1,
                    expected: Some(2),
                    retry_in: Duration::from_secs(7),
                },
                C::Transient,
                "IMAGE_DOWNLOADING",
            ),
            (
                Error::ImageFormat {
                    url: "u".into(),
                    problem: "libvirt found raw, the configuration says qcow2".into(),
                },
                C::Permanent,
                "IMAGE_FORMAT_MISMATCH",
            ),
            (
                Error::Libvirt {
                    host: "hv".into(),
                    op: "virStorageVolCreateXML",
                    failure: classify_libvirt_parts(
                        N::SystemError.into(),
                        D::Storage.into(),
                        "cannot create file: Read-only file system",
                        true,
                    ),
                },
                C::Transient,
                "LIBVIRT_HOST_ERROR",
            ),
            (
                Error::DomainNameTaken {
                    host: "hv".into(),
                    key: "k".into(),
                    domain: "egressproxy-k".into(),
                },
                C::AlreadyExists,
                "DOMAIN_NAME_TAKEN",
            ),
            (
                Error::DomainXmlInvalid {
                    domain: "egressproxy-k".into(),
                    reason: "bad".into(),
                },
                C::Permanent,
                "DOMAIN_XML_INVALID",
            ),
            (
                Error::HostNotReady {
                    host: "hv".into(),
                    failures: vec!["network: missing".into()],
                },
                C::Permanent,
                "HOST_NOT_READY",
            ),
            (
                Error::CreateInProgress {
                    host: "hv".into(),
                    key: "k".into(),
                    waited: Duration::from_secs(1),
                },
                C::Transient,
                "CREATE_IN_PROGRESS",
            ),
            (
                Error::KvmProbeRunning {
                    host: "hv".into(),
                    retry_in: Duration::from_secs(9),
                },
                C::Transient,
                "KVM_PROBE_RUNNING",
            ),
            (
                Error::Shared(std::sync::Arc::new(image_http(404))),
                C::Permanent,
                "IMAGE_NOT_FOUND",
            ),
            (
                Error::Shared(std::sync::Arc::new(image_http(503))),
                C::Transient,
                "IMAGE_SERVER_ERROR",
            ),
        ];
        table
    }

    #[test]
    fn every_error_maps_to_one_contract_class_and_reason() {
        use egressproxy_provider::ErrorClass as C;
        let backing_off = |last_class| Error::SshBackingOff {
            host: "hv".into(),
            retry_in: Duration::from_secs(3),
            last_error: "refused".into(),
            last_class,
        };
        let table = mapping_table();
        for (error, class, reason) in table {
            let mapped = error.to_provider_error();
            assert_eq!(
                (mapped.class, mapped.reason.as_str()),
                (class, reason),
                "{error}"
            );
            assert_eq!(mapped.message, error.to_string());
            // The agent's own class agrees wherever the contract has the same notion.
            match error.class() {
                ErrorClass::Transient => assert_eq!(class, C::Transient, "{error}"),
                ErrorClass::Permanent | ErrorClass::NotFound => {
                    assert_eq!(class, C::Permanent, "{error}")
                }
                ErrorClass::DeadlineExceeded => assert_eq!(class, C::DeadlineExceeded),
                ErrorClass::Conflict => assert_eq!(class, C::AlreadyExists, "{error}"),
            }
            // Round trip through the wire mapping.
            let status = mapped.to_status();
            assert_eq!(ProviderError::from_status(&status), mapped, "{error}");
        }
        assert_eq!(
            backing_off(ErrorClass::Transient)
                .to_provider_error()
                .retry_after,
            Some(Duration::from_secs(3))
        );
        let downloading = Error::ImageDownloading {
            image: "debian".into(),
            host: "hv".into(),
            received: 1,
            expected: None,
            retry_in: Duration::from_secs(7),
        };
        assert_eq!(
            downloading.to_provider_error().retry_after,
            Some(Duration::from_secs(7))
        );
    }

    /// Which libvirt errors are the transport's (the connection is dropped) and which
    /// libvirtd reports about the host on a healthy connection.
    #[test]
    fn libvirt_errors_classify_by_code_domain_and_liveness() {
        use virt::error::{ErrorDomain as D, ErrorNumber as N};
        let table: Vec<(N, D, bool, bool, ErrorClass, &str)> = vec![
            // (code, domain, alive) -> (transport, class, reason)
            // libvirtd's own OS errors (EACCES, ENOSPC, EROFS, qemu-img) on a live
            // connection: the connection stays, the host needs fixing, retried.
            (
                N::SystemError,
                D::Storage,
                true,
                false,
                ErrorClass::Transient,
                "LIBVIRT_HOST_ERROR",
            ),
            (
                N::SystemError,
                D::Qemu,
                true,
                false,
                ErrorClass::Transient,
                "LIBVIRT_HOST_ERROR",
            ),
            // The client's socket failed (EOF, reset): the RPC/remote layer reports it.
            (
                N::SystemError,
                D::Rpc,
                true,
                true,
                ErrorClass::Transient,
                "LIBVIRT_CONNECTION_FAILED",
            ),
            (
                N::SystemError,
                D::Remote,
                true,
                true,
                ErrorClass::Transient,
                "LIBVIRT_CONNECTION_FAILED",
            ),
            // Any error on a dead connection is the transport's.
            (
                N::SystemError,
                D::Storage,
                false,
                true,
                ErrorClass::Transient,
                "LIBVIRT_CONNECTION_FAILED",
            ),
            (
                N::NoDomain,
                D::Dom,
                false,
                true,
                ErrorClass::Transient,
                "LIBVIRT_CONNECTION_FAILED",
            ),
            (
                N::Rpc,
                D::None,
                true,
                true,
                ErrorClass::Transient,
                "LIBVIRT_CONNECTION_FAILED",
            ),
            (
                N::NoConnect,
                D::None,
                true,
                true,
                ErrorClass::Transient,
                "LIBVIRT_CONNECTION_FAILED",
            ),
            (
                N::NoDomain,
                D::Qemu,
                true,
                false,
                ErrorClass::NotFound,
                "LIBVIRT_OBJECT_MISSING",
            ),
            (
                N::NoStorageVolume,
                D::Storage,
                true,
                false,
                ErrorClass::NotFound,
                "LIBVIRT_OBJECT_MISSING",
            ),
            (
                N::XmlError,
                D::Dom,
                true,
                false,
                ErrorClass::Permanent,
                "LIBVIRT_REJECTED",
            ),
            (
                N::OperationInvalid,
                D::Qemu,
                true,
                false,
                ErrorClass::Transient,
                "LIBVIRT_FAILED",
            ),
        ];
        for (code, domain, alive, transport, class, reason) in table {
            let failure = classify_libvirt_parts(code.into(), domain.into(), "m", alive);
            let case = format!("{code:?} from {domain:?}, alive {alive}");
            assert_eq!(
                (failure.transport, failure.class),
                (transport, class),
                "{case}"
            );
            let error = Error::Libvirt {
                host: "hv".into(),
                op: "virStorageVolCreateXML",
                failure,
            };
            assert_eq!(error.drops_connection(), transport, "{case}");
            assert_eq!(error.to_provider_error().reason, reason, "{case}");
        }
    }

    /// A Create that waits past its deadline for another Create of the same key is told
    /// so (transient, CREATE_IN_PROGRESS), not that libvirt timed out.
    #[tokio::test]
    async fn a_busy_key_is_create_in_progress() {
        let locks = crate::provider::sync::KeyLocks::default();
        let soon = || tokio::time::Instant::now() + Duration::from_millis(50);
        let _first = locks.lock("hv", "k", soon()).await.unwrap();
        let err = locks.lock("hv", "k", soon()).await.unwrap_err();
        let mapped = err.to_provider_error();
        assert_eq!(
            (mapped.class, mapped.reason.as_str()),
            (
                egressproxy_provider::ErrorClass::Transient,
                "CREATE_IN_PROGRESS"
            ),
            "{err}"
        );
        assert!(err.to_string().contains("key k on host hv"), "{err}");
        // Another key is not held up.
        assert!(locks.lock("hv", "other", soon()).await.is_ok());
    }

    #[test]
    fn reported_libvirt_error_keeps_the_connection() {
        let err = Error::Libvirt {
            host: "hv".into(),
            op: "virDomainLookupByName",
            failure: LibvirtFailure {
                code: 42,
                code_name: "NoDomain".into(),
                message: "no domain".into(),
                transport: false,
                class: ErrorClass::NotFound,
            },
        };
        assert!(!err.drops_connection());
        assert_eq!(err.class(), ErrorClass::NotFound);
        assert_eq!(err.libvirt_code(), Some(42));
    }

    /// Errors the mapping tells apart that the table above leaves out: their contract
    /// class has no counterpart in [`ErrorClass`] (an instance, not a libvirt object, is
    /// missing) or they only exist on the contract's side.
    fn contract_only_table() -> Vec<(Error, egressproxy_provider::ErrorClass, &'static str)> {
        use egressproxy_provider::ErrorClass as C;
        let unreadable =
            || crate::libvirt::xml::volume::VolumeFacts::parse("<volume>").unwrap_err();
        let unbuildable = XmlError::Serialize(quick_xml::SeError::Custom("no".into()));
        vec![
            (
                Error::SpecMismatch {
                    host: "hv".into(),
                    key: "k".into(),
                },
                C::AlreadyExists,
                "SPEC_MISMATCH",
            ),
            (
                Error::InstanceNotFound {
                    id: "hv/k".into(),
                    detail: "no domain egressproxy-k on host hv".into(),
                },
                C::NotFound,
                "INSTANCE_NOT_FOUND",
            ),
            (
                Error::InstanceVanished {
                    domain: "egressproxy-k".into(),
                },
                C::Transient,
                "INSTANCE_VANISHED",
            ),
            (
                Error::CreateTaskFailed {
                    key: "k".into(),
                    reason: "panic".into(),
                },
                C::Transient,
                "AGENT_WORKER_FAILED",
            ),
            (
                Error::InvalidArgument {
                    field: "id",
                    reason: "bad".into(),
                },
                C::InvalidArgument,
                "INVALID_ARGUMENT",
            ),
            (
                Error::xml("domain egressproxy-k", unreadable()),
                C::Permanent,
                "LIBVIRT_XML_UNREADABLE",
            ),
            (
                Error::xml("volume XML for v", unbuildable),
                C::Permanent,
                "LIBVIRT_XML_UNBUILDABLE",
            ),
        ]
    }

    #[test]
    fn contract_only_errors_map_through_the_one_mapping() {
        for (error, class, reason) in contract_only_table() {
            let mapped = error.to_provider_error();
            assert_eq!(
                (mapped.class, mapped.reason.as_str()),
                (class, reason),
                "{error}"
            );
            assert_eq!(mapped.message, error.to_string());
        }
        // XML libvirt returned that cannot be read is not a transient I/O failure.
        let unreadable = Error::xml(
            "domain d",
            crate::libvirt::xml::domain::DomainFacts::parse("<domain").unwrap_err(),
        );
        assert_eq!(unreadable.class(), ErrorClass::Permanent);
    }

    /// The reason codes in the error table of docs/kvm-agent.md are exactly those the
    /// agent answers with.
    #[test]
    fn the_documented_error_table_lists_every_reason_and_no_other() {
        let doc =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/kvm-agent.md"))
                .unwrap();
        let section = doc
            .split("\n## Errors\n")
            .nth(1)
            .expect("docs/kvm-agent.md has an Errors section");
        let section = section.split("\n## ").next().unwrap();
        let documented: std::collections::BTreeSet<String> = section
            .lines()
            .filter(|line| line.starts_with("| `"))
            .flat_map(|line| {
                let first_column = line.split('|').nth(1).unwrap_or_default();
                first_column
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut produced: std::collections::BTreeSet<String> = mapping_table()
            .into_iter()
            .chain(contract_only_table())
            .map(|(_, _, reason)| reason.to_owned())
            .collect();
        // Answered by the guest layer's cloud-config check, not through this mapping.
        produced.insert("INVALID_CLOUD_CONFIG".to_owned());
        assert_eq!(
            documented, produced,
            "the error table of docs/kvm-agent.md and the code disagree"
        );
    }
}
