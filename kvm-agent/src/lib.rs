//! kvm-agent: an egressproxy `Provider` on libvirt reached over SSH.
//!
//! The transport and the Provider implementation land with their issues.

pub use egressproxy_provider as contract;
