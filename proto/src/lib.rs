//! The egressproxy `Provider` contract (v1) and what every provider builds on.
//!
//! - [`pb`]: the generated messages, client and server traits of
//!   `egressproxy.provider.v1` (and the reference provider's test controls).
//! - [`error`]: [`ProviderError`], the contract's one error taxonomy, and its mapping to
//!   and from `tonic::Status` (the table in `provider.proto` and `docs/contract.md`).
//! - [`server`]: serve a `Provider` with reflection, health, TLS/mTLS, W3C trace context
//!   and graceful shutdown.
//! - [`client`]: connect to a provider, with trace context and a deadline on every call.
//! - [`probe`]: a running provider's health and instances, for exec probes and
//!   `helm test`.
//! - [`paging`] and [`locations`]: ListInstances' and ListLocations' pages, filters and
//!   room, as the contract states them.
//! - [`watch`]: WatchInstances' streams, resume tokens and history ([`watch::WatchHub`]).
//! - [`telemetry`]: logging and OpenTelemetry export configured by `OTEL_*` variables.
//! - [`reference`](mod@reference): an in-memory provider with fault injection, the example to copy.
//! - [`conformance`]: checks any provider must pass, run against a live endpoint.

#![forbid(unsafe_code)]

pub mod client;
pub mod conformance;
mod deadline;
pub mod error;
pub mod locations;
pub mod paging;
pub mod probe;
pub mod reference;
pub mod server;
pub mod system_tls;
pub mod telemetry;
mod trace_context;
pub mod validation;
pub mod watch;

pub use deadline::parse_grpc_timeout;

/// The guide `docs/writing-a-provider.md`, compiled so its Rust snippets stay true.
#[cfg(doctest)]
#[doc = include_str!("../../docs/writing-a-provider.md")]
pub struct WritingAProviderGuide;
pub use error::{ErrorClass, ProviderError};

/// The contract version this crate implements. Providers report it from
/// `GetPluginInfo`; callers refuse a provider whose major version differs.
pub const CONTRACT_VERSION: &str = "1.5.0";

/// Generated protobuf and gRPC code.
#[allow(unreachable_pub, missing_debug_implementations, clippy::all)]
pub mod pb {
    /// `egressproxy.provider.v1`: the contract.
    pub mod provider {
        pub mod v1 {
            tonic::include_proto!("egressproxy.provider.v1");
        }
    }
    /// `egressproxy.reference.v1`: the reference provider's test controls.
    pub mod reference {
        pub mod v1 {
            tonic::include_proto!("egressproxy.reference.v1");
        }
    }
    pub use provider::v1::*;

    /// Redacted: cloud-init input may hold secrets, so only its sizes are shown.
    impl std::fmt::Debug for CloudInit {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let redacted = |bytes: &[u8]| format!("<{} bytes redacted>", bytes.len());
            f.debug_struct("CloudInit")
                .field("user_data", &format_args!("{}", redacted(&self.user_data)))
                .field("vendor_data", &self.vendor_data.as_deref().map(redacted))
                .finish()
        }
    }

    /// Encoded `FileDescriptorSet` of every proto file, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/descriptor.bin"));
}
