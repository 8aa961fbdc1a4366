//! The egressproxy operator: reconciles `Proxy` resources through `Provider` services.
//!
//! The controller itself lands with the operator issue; until then this crate only
//! re-exports the contract it is built on, so the workspace layout is in place.

pub use egressproxy_provider as contract;
