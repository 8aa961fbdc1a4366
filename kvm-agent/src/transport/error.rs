//! The transport layer's error: reaching a host (SSH, the relay, the local socket) and
//! calling libvirt on it (libvirt's own errors, deadlines, worker threads).
//!
//! [`TransportError::classify`] is the layer's one verdict on each error; a failure of the
//! transport itself also drops the connection ([`TransportError::drops_connection`]).

use std::path::PathBuf;
use std::time::Duration;

use crate::classification::{Classification, ErrorClass};
use crate::config::error::ConfigError;
use crate::transport::libvirt_error::{LibvirtFailure, SYSTEM_ERROR};

/// Errors of reaching a hypervisor and calling its libvirt.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
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
        /// russh's error (boxed: it is large, and every layer's error holds this one).
        #[source]
        source: Box<russh::Error>,
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

    /// The `known_hosts` file could not be read or parsed.
    #[error("host {host}: cannot read known_hosts {}", known_hosts.display())]
    KnownHostsUnreadable {
        /// Host name from the configuration.
        host: String,
        /// The `known_hosts` file consulted.
        known_hosts: PathBuf,
        /// russh's error (boxed: it is large, and rare).
        #[source]
        source: Box<russh::keys::Error>,
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

    /// The caller's deadline passed; the connection under the call was dropped (unless
    /// the deadline had passed before the call began: then nothing was sent on it).
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

    /// A host's configuration cannot be used where a dial reads it (an SSH address, a
    /// private key that is unreadable now): the configuration's own error.
    #[error(transparent)]
    Config(#[from] ConfigError),

    /// Local I/O of the agent itself failed (private socket directory, relay).
    #[error("{context}")]
    Io {
        /// What the agent was doing.
        context: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl TransportError {
    /// Local I/O of the agent itself failed while doing `context`.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    /// The layer's verdict: class, reason and retry hint.
    ///
    /// A libvirt object that does not exist (pool, network, volume) is `NotFound` here and
    /// `LIBVIRT_OBJECT_MISSING` on the wire. A host missing from the configuration is
    /// permanent: an endless retry would pin the operator's finalizer.
    pub fn classify(&self) -> Classification {
        use ErrorClass as C;
        use TransportError as E;
        let of = Classification::new;
        match self {
            E::UnknownHost { .. } => of(C::Permanent, "HOST_NOT_CONFIGURED"),
            E::SshConnect { .. }
            | E::SshHandshakeTimeout { .. }
            | E::SshSessionClosed { .. }
            | E::LocalSocket { .. } => of(C::Transient, "HOST_UNREACHABLE"),
            E::Ssh { .. } => of(C::Transient, "SSH_FAILED"),
            E::HostKeyUnknown { .. } => of(C::Permanent, "SSH_HOST_KEY_UNKNOWN"),
            E::HostKeyChanged { .. } => of(C::Permanent, "SSH_HOST_KEY_CHANGED"),
            E::SshAuthRejected { .. } => of(C::Permanent, "SSH_AUTH_REJECTED"),
            // A rejected host key stays permanent while the pool backs off; anything else
            // is worth retrying once the backoff is over.
            E::SshBackingOff {
                last_class: C::Permanent,
                ..
            } => of(C::Permanent, "SSH_BACKING_OFF"),
            E::SshBackingOff { retry_in, .. } => {
                of(C::Transient, "SSH_BACKING_OFF").retry_after(*retry_in)
            }
            E::ForwardRefused { .. } => of(C::Transient, "LIBVIRT_FORWARD_REFUSED"),
            E::Libvirt { failure, .. } => classify_failure(failure),
            E::DeadlineExceeded { .. } => of(C::DeadlineExceeded, "LIBVIRT_DEADLINE"),
            E::ConnectionCut { .. } => of(C::Transient, "LIBVIRT_CONNECTION_CUT"),
            E::Io { .. } | E::KnownHostsUnreadable { .. } => of(C::Transient, "AGENT_IO_FAILED"),
            E::Worker { .. } => of(C::Transient, "AGENT_WORKER_FAILED"),
            E::Config(e) => e.classify(),
        }
    }

    /// What a caller should do about this error (`NotFound`: the object it is about is
    /// missing).
    pub fn class(&self) -> ErrorClass {
        self.classify().class
    }

    /// Whether the libvirt connection the error happened on must be discarded.
    ///
    /// Errors libvirt reports about the operation keep a healthy connection; transport
    /// failures, deadline expiry and worker panics drop it.
    pub fn drops_connection(&self) -> bool {
        !matches!(self, TransportError::Libvirt { failure, .. } if !failure.transport)
    }

    /// The libvirt error code, when libvirt reported the error.
    pub fn libvirt_code(&self) -> Option<i32> {
        match self {
            TransportError::Libvirt { failure, .. } => Some(failure.code),
            _ => None,
        }
    }
}

/// The reason of a classified libvirt error.
fn classify_failure(failure: &LibvirtFailure) -> Classification {
    use ErrorClass as C;
    let of = Classification::new;
    match failure.class {
        _ if failure.transport => of(C::Transient, "LIBVIRT_CONNECTION_FAILED"),
        C::NotFound => of(C::NotFound, "LIBVIRT_OBJECT_MISSING"),
        C::DeadlineExceeded => of(C::DeadlineExceeded, "LIBVIRT_DEADLINE"),
        C::Transient if failure.code == SYSTEM_ERROR => of(C::Transient, "LIBVIRT_HOST_ERROR"),
        C::Transient => of(C::Transient, "LIBVIRT_FAILED"),
        C::Permanent
        | C::InvalidArgument
        | C::AlreadyExists
        | C::QuotaExhausted
        | C::Unimplemented => of(C::Permanent, "LIBVIRT_REJECTED"),
    }
}
