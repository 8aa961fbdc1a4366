//! What the agent asks of libvirt, as blocking functions on one connection.
//!
//! Each function here runs inside a [`HostPool::call`](crate::transport::pool::HostPool::call)
//! closure, so it is traced and bounded by a deadline by the layer below.
//! - [`xml`]: domain, volume and capabilities XML, built from and parsed into serde structs.
//! - [`naming`]: the names of every domain and volume the agent creates, from the key.
//! - [`domains`]: finding, reading, listing, defining, starting and deleting domains.
//! - [`tags`]: UpdateInstanceTags' compare-and-set of the tags in a domain's metadata.
//! - [`addresses`]: where a guest's addresses come from, and which of them are usable.
//! - `volumes`: an instance's overlay and seed volumes.
//! - [`identity_mac`]: the MAC of an instance's NIC, derived from its address identity.
//! - [`reservations`]: the DHCP host reservations that give an identity its address on
//!   a libvirt network, and their sweep.
//! - [`static_addresses`]: addresses from a bridge host's static block, with the domains'
//!   metadata as the allocation table.
//! - [`error`]: the layer's error type, [`LibvirtError`], which every function here
//!   fails with (through [`CallFailure`](crate::transport::call::CallFailure)).
//! - [`host`]: what a hypervisor can run ([`host::capabilities`]) and whether it is ready
//!   for the agent ([`host::check`]).

pub mod addresses;
pub mod domains;
pub mod error;
pub mod host;
pub mod identity_mac;
pub mod naming;
pub mod reservations;
pub mod static_addresses;
pub mod tags;
pub(crate) mod volumes;
pub mod xml;

pub use error::LibvirtError;
