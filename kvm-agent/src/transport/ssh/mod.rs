//! SSH to a hypervisor: keys, host key verification, the session, the socket forward.
//!
//! - [`keys`]: loading the client's private key (ed25519, RSA) with actionable errors.
//! - [`known_hosts`]: strict host key verification, or an explicit, loudly logged opt-out.
//! - [`session`]: one authenticated russh session per host, with a handshake deadline
//!   and SSH keepalives that close a dead session.

pub(crate) mod keys;
pub(crate) mod known_hosts;
pub(crate) mod session;

pub(crate) use session::SshSession;
