//! What the operator asks of a running proxy over the network.
//!
//! - [`address`]: which of an instance's addresses to check.
//! - [`address_fields`]: an address's scope and family, read as the contract says.
//! - [`health_check`]: does the proxy really proxy?
//! - [`egress_echo`]: which source address does a destination see through it?

pub mod address;
pub mod address_fields;
pub mod egress_echo;
pub mod health_check;
