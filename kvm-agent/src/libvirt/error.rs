//! The libvirt layer's error: the transport's failures, XML the agent cannot read or
//! build, and the KVM probe's answer not being there yet.
//!
//! Every blocking function of this layer fails with
//! [`CallFailure<LibvirtError>`](crate::transport::call::CallFailure), so a
//! [`HostPool::call`](crate::transport::pool::HostPool::call) of it returns a
//! `LibvirtError`. [`LibvirtError::classify`] is the layer's one verdict on each.

use std::sync::Arc;
use std::time::Duration;

use crate::classification::{Classification, ErrorClass};
use crate::libvirt::xml::XmlError;
use crate::transport::call::CallError;
use crate::transport::error::TransportError;

/// When a Create refused for want of a free address may try again: addresses come free
/// only as instances of other identities are deleted.
pub const ADDRESSES_EXHAUSTED_RETRY: Duration = Duration::from_secs(60);

/// Errors of asking libvirt for something.
#[derive(Debug, thiserror::Error)]
pub enum LibvirtError {
    /// Reaching the host or calling its libvirt failed.
    #[error(transparent)]
    Transport(#[from] TransportError),

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

    /// The `domainType: auto` KVM probe of the host (up to 15 s, under its own deadline)
    /// still ran when the caller's deadline passed; a later call gets its answer.
    #[error("host {host}: the KVM probe (domainType: auto) is still running; retry")]
    KvmProbeRunning {
        /// Host name from the configuration.
        host: String,
        /// When the probe should be done at the latest (the retry hint).
        retry_in: Duration,
    },

    /// The network has no IPv4 DHCP range, so an address identity cannot be given an
    /// address from it.
    #[error(
        "network {network} has no IPv4 DHCP range: an address identity needs one to reserve \
         an address from (add <dhcp><range .../></dhcp> to the network)"
    )]
    NoDhcpRange {
        /// The network's name.
        network: String,
    },

    /// Every address of the network's DHCP ranges is reserved for another identity.
    #[error(
        "network {network}: every address of its DHCP ranges is reserved for another \
         address identity; delete instances of other identities or widen the range"
    )]
    AddressesExhausted {
        /// The network's name.
        network: String,
    },

    /// A domain of the agent could not be read while choosing a static address: the
    /// domains' metadata is the allocation table, and an incomplete table could hand out
    /// that domain's address.
    #[error(
        "cannot choose a static address: a domain of the agent could not be read (it may \
         hold any address of the range); retry"
    )]
    AllocationTableUnreadable,

    /// The failure of work shared by several callers (one KVM probe), as each of them
    /// sees it: message, class and reason are the underlying error's.
    #[error(transparent)]
    Shared(Arc<LibvirtError>),
}

impl LibvirtError {
    /// XML that could not be read or built, while doing `context`.
    pub fn xml(context: impl Into<String>, error: XmlError) -> Self {
        Self::Xml {
            context: context.into(),
            error,
        }
    }

    /// The layer's verdict: class, reason and retry hint.
    pub fn classify(&self) -> Classification {
        match self {
            LibvirtError::Transport(e) => e.classify(),
            LibvirtError::Xml { error, .. } => error.classify(),
            LibvirtError::KvmProbeRunning { retry_in, .. } => {
                Classification::new(ErrorClass::Transient, "KVM_PROBE_RUNNING")
                    .retry_after(*retry_in)
            }
            LibvirtError::NoDhcpRange { .. } => {
                Classification::new(ErrorClass::Permanent, "NETWORK_WITHOUT_DHCP")
            }
            LibvirtError::AddressesExhausted { .. } => {
                Classification::new(ErrorClass::QuotaExhausted, "ADDRESSES_EXHAUSTED")
                    .retry_after(ADDRESSES_EXHAUSTED_RETRY)
            }
            LibvirtError::AllocationTableUnreadable => {
                Classification::new(ErrorClass::Transient, "ALLOCATION_TABLE_UNREADABLE")
            }
            LibvirtError::Shared(error) => error.classify(),
        }
    }

    /// What a caller should do about this error (`NotFound`: the object it is about is
    /// missing).
    pub fn class(&self) -> ErrorClass {
        self.classify().class
    }

    /// Whether the libvirt connection the error happened on must be discarded.
    pub fn drops_connection(&self) -> bool {
        match self {
            LibvirtError::Transport(e) => e.drops_connection(),
            LibvirtError::Shared(error) => error.drops_connection(),
            // libvirt answered: the connection is fine.
            LibvirtError::NoDhcpRange { .. }
            | LibvirtError::AddressesExhausted { .. }
            | LibvirtError::AllocationTableUnreadable => false,
            _ => true,
        }
    }

    /// The libvirt error code, when libvirt reported the error.
    pub fn libvirt_code(&self) -> Option<i32> {
        match self {
            LibvirtError::Transport(e) => e.libvirt_code(),
            LibvirtError::Shared(error) => error.libvirt_code(),
            _ => None,
        }
    }
}

impl CallError for LibvirtError {
    fn libvirt_code(&self) -> Option<i32> {
        LibvirtError::libvirt_code(self)
    }
}
