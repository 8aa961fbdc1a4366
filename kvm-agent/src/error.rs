//! The crate's top-level error, and THE mapping of every error to the contract.
//!
//! Each layer has its own error type and classifies its own errors once
//! ([`Classification`], from the shared leaf [`crate::classification`]: the contract's
//! class, the reason code, a retry hint): [`TransportError`] (SSH, relay, libvirt,
//! deadlines, workers), [`ConfigError`], the libvirt layer's [`LibvirtError`] (the
//! transport's errors, XML libvirt returned that the agent cannot read, which is its own
//! case and never an I/O failure, and the KVM probe still running), the image layer's
//! [`ImageError`] (HTTP, checksum, format, spooling, and the libvirt layer's errors of its
//! base volumes) and the guest layer's [`GuestError`]. No layer names this module: [`Error`]
//! wraps each with `#[from]`, adds the provider's own errors, and
//! [`Error::to_provider_error`] turns any of them into the contract's error: the only
//! place a [`ProviderError`] is built. A layer's error reaches the contract only as an
//! [`Error`] (`From<LayerError> for ProviderError` goes through it).

use std::time::Duration;

use egressproxy_provider::ProviderError;

pub use crate::classification::{Classification, ErrorClass};
pub use crate::config::error::{ConfigError, ConfigProblem};
pub use crate::guest::GuestError;
pub use crate::images::ImageError;
pub use crate::libvirt::LibvirtError;
use crate::transport::call::CallError;
pub use crate::transport::error::TransportError;
pub use crate::transport::libvirt_error::{
    LibvirtFailure, classify_libvirt, classify_libvirt_parts,
};

/// When a Create refused because its identity's earlier instance exists may try again:
/// the caller deletes that instance first, which takes about a second.
pub const ADDRESS_IDENTITY_IN_USE_RETRY: Duration = Duration::from_secs(2);

/// Errors of the kvm-agent.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),

    /// Reaching a host or calling its libvirt failed.
    #[error(transparent)]
    Transport(#[from] TransportError),

    /// Asking libvirt failed: the transport's failures (SSH, relay, libvirt's own errors,
    /// deadlines), XML the agent cannot read or build, or the KVM probe still running.
    #[error(transparent)]
    Libvirt(#[from] LibvirtError),

    /// A request's cloud-init documents cannot be used.
    #[error(transparent)]
    Guest(#[from] GuestError),

    /// Fetching an image or keeping its base volume on a host failed.
    #[error(transparent)]
    Image(#[from] ImageError),

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

    /// No host the Create may go to has room for its machine type.
    #[error(
        "no room for machine type {machine_type} in {asked}: {}; free room (delete instances, \
         raise capacity.maxInstances, lower capacity.reservedMemoryMiB) or place elsewhere \
         (ListLocations shows the room of every host)",
        lacks.join("; ")
    )]
    NoRoom {
        /// The machine type, with its size (`small (1 vCPU, 1024 MiB)`).
        machine_type: String,
        /// The location asked for, in words (`zone z1`, `any host`).
        asked: String,
        /// What each candidate host lacks (`hv1: 512 MiB free`).
        lacks: Vec<String>,
    },

    /// Another Create, Delete or tag update of the same key in this agent (or another
    /// Create choosing a static address on the same host) still ran when the caller's
    /// deadline passed; its outcome decides this one's.
    #[error(
        "key {key} on host {host}: another Create, Delete or tag update of the same key (or \
         another Create choosing a static address on the host) is in progress (waited \
         {waited:?}); retry"
    )]
    CreateInProgress {
        /// Host name from the configuration.
        host: String,
        /// The instance key.
        key: String,
        /// How long the caller waited.
        waited: Duration,
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

    /// An instance of the request's address identity (under another key) exists: two
    /// instances with one address would take each other's traffic.
    #[error(
        "address identity {identity} is held by instance {holder}: delete it, and retry \
         once it is gone"
    )]
    AddressIdentityInUse {
        /// The identity.
        identity: String,
        /// The id of the instance that holds it.
        holder: String,
    },

    /// Another identity's instance has the MAC derived from this identity (32 bits of a
    /// digest collided), so the two would share a DHCP reservation.
    #[error(
        "address identity {identity} derives the same MAC as identity {other}, which an \
         instance on host {host} holds: use another identity"
    )]
    IdentityMacShared {
        /// The identity asked for.
        identity: String,
        /// The identity already using the MAC.
        other: String,
        /// Host name from the configuration.
        host: String,
    },

    /// The requested address is not in the static block of the host the instance goes to.
    #[error(
        "requested_address {requested} is not in the range host {host} offers \
         ({range}): ask for an address in it, or leave requested_address unset"
    )]
    AddressNotInRange {
        /// The address asked for.
        requested: String,
        /// Host name from the configuration.
        host: String,
        /// The host's block, `first-last/prefix`.
        range: String,
    },

    /// The requested address is held by an instance of another identity (or of none).
    #[error(
        "requested_address {requested} is held by instance {holder}: ask for another \
         address, or retry once that instance is gone"
    )]
    AddressTaken {
        /// The address asked for.
        requested: String,
        /// The id of the instance that holds it.
        holder: String,
    },

    /// Every address of the host's static block is held by an instance.
    #[error(
        "host {host}: every address of its static range ({range}) is held by an instance; \
         delete instances or widen hosts[].staticAddresses"
    )]
    StaticAddressesExhausted {
        /// Host name from the configuration.
        host: String,
        /// The host's block, `first-last/prefix`.
        range: String,
    },

    /// The instance a request names does not exist.
    #[error("instance {id} does not exist ({detail})")]
    InstanceNotFound {
        /// The instance id as requested.
        id: String,
        /// Why it is missing (no such domain, or an id this provider cannot have made).
        detail: String,
    },

    /// UpdateInstanceTags found the instance's tags neither the expected nor the new
    /// ones: another caller changed them since the caller read them.
    #[error(
        "instance {id}: its tags are no longer the expected_tags (another caller changed \
         them); nothing was changed: read the instance again and decide anew"
    )]
    TagsChanged {
        /// The instance id as requested.
        id: String,
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

    /// The request breaks a rule the contract crate checks for every provider
    /// (`egressproxy_provider::validation`, `paging`): that crate's answer, which the one
    /// mapping passes on whole (its reason included).
    #[error("{}", .0.message)]
    ContractRule(Box<ProviderError>),

    /// The task running Create's steps panicked or was cancelled.
    #[error("Create of key {key} stopped unexpectedly: {reason}")]
    CreateTaskFailed {
        /// The instance key.
        key: String,
        /// Panic or cancellation message.
        reason: String,
    },
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
            Error::Libvirt(e) => e.classify(),
            Error::Image(e) => e.classify(),
            // The provider's own.
            Error::DomainNameTaken { .. } => of(C::AlreadyExists, "DOMAIN_NAME_TAKEN"),
            Error::DomainXmlInvalid { .. } => of(C::Permanent, "DOMAIN_XML_INVALID"),
            Error::HostNotReady { .. } => of(C::Permanent, "HOST_NOT_READY"),
            Error::CreateInProgress { .. } => of(C::Transient, "CREATE_IN_PROGRESS"),
            Error::NoRoom { .. } => of(C::QuotaExhausted, "CAPACITY_EXHAUSTED")
                .retry_after(egressproxy_provider::locations::NO_ROOM_RETRY),
            Error::SpecMismatch { .. } => of(C::AlreadyExists, "SPEC_MISMATCH"),
            Error::InstanceNotFound { .. } => of(C::NotFound, "INSTANCE_NOT_FOUND"),
            Error::AddressIdentityInUse { .. } => of(C::Transient, "ADDRESS_IDENTITY_IN_USE")
                .retry_after(ADDRESS_IDENTITY_IN_USE_RETRY),
            Error::IdentityMacShared { .. } => of(C::Permanent, "IDENTITY_MAC_SHARED"),
            Error::AddressNotInRange { .. } => of(C::InvalidArgument, "ADDRESS_NOT_IN_RANGE"),
            Error::AddressTaken { .. } => of(C::AlreadyExists, "ADDRESS_TAKEN"),
            Error::StaticAddressesExhausted { .. } => of(C::QuotaExhausted, "ADDRESSES_EXHAUSTED")
                .retry_after(crate::libvirt::error::ADDRESSES_EXHAUSTED_RETRY),
            Error::TagsChanged { .. } => of(C::Permanent, "TAGS_CHANGED"),
            Error::InstanceVanished { .. } => of(C::Transient, "INSTANCE_VANISHED"),
            Error::InvalidArgument { .. } | Error::InvalidFields { .. } => {
                of(C::InvalidArgument, "INVALID_ARGUMENT")
            }
            Error::CreateTaskFailed { .. } => of(C::Transient, "AGENT_WORKER_FAILED"),
            // The contract crate's own reason goes out with it (`to_provider_error`).
            Error::ContractRule(e) => of(e.class, e.class.default_reason()),
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
            Error::Libvirt(e) => e.drops_connection(),
            Error::Image(e) => e.drops_connection(),
            _ => true,
        }
    }

    /// The libvirt error code, when libvirt reported the error.
    pub fn libvirt_code(&self) -> Option<i32> {
        match self {
            Error::Transport(e) => e.libvirt_code(),
            Error::Libvirt(e) => e.libvirt_code(),
            Error::Image(e) => e.libvirt_code(),
            _ => None,
        }
    }

    fn is_instance_missing(&self) -> bool {
        matches!(self, Error::InstanceNotFound { .. })
    }

    /// The request fields at fault, for an invalid argument.
    fn field_violations(&self) -> Vec<(String, String)> {
        match self {
            Error::InvalidArgument { field, reason } => vec![((*field).to_owned(), reason.clone())],
            Error::InvalidFields { violations } => violations.clone(),
            Error::Guest(e) => e.field_violations(),
            Error::AddressNotInRange { .. } => {
                vec![("requested_address".to_owned(), self.to_string())]
            }
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
        if let Error::ContractRule(error) = self {
            return (**error).clone();
        }
        let Classification {
            class,
            reason,
            retry_after,
        } = self.classify();
        let class = match class {
            ErrorClass::NotFound if !self.is_instance_missing() => ErrorClass::Permanent,
            class => class,
        };
        let retry_after = retry_after
            .filter(|_| matches!(class, ErrorClass::Transient | ErrorClass::QuotaExhausted));
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

/// The gRPC edge: an error leaves the agent as the contract's, through the one mapping.
impl From<Error> for tonic::Status {
    fn from(error: Error) -> Self {
        error.to_provider_error().into()
    }
}

/// What the contract crate's request checks answer, kept whole
/// ([`Error::ContractRule`]).
impl From<ProviderError> for Error {
    fn from(error: ProviderError) -> Self {
        Error::ContractRule(Box::new(error))
    }
}

/// A layer's error reaches the contract the same way: as an [`Error`], through
/// [`Error::to_provider_error`].
macro_rules! to_the_contract_through_the_mapping {
    ($($layer:ty),*) => {$(
        impl From<$layer> for ProviderError {
            fn from(error: $layer) -> Self {
                Error::from(error).to_provider_error()
            }
        }
    )*};
}

to_the_contract_through_the_mapping!(
    ConfigError,
    TransportError,
    LibvirtError,
    ImageError,
    GuestError
);

impl CallError for Error {
    fn libvirt_code(&self) -> Option<i32> {
        Error::libvirt_code(self)
    }
}

#[cfg(test)]
mod tests;
