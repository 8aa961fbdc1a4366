//! What the operator asks of a running proxy over the network.
//!
//! - [`address`]: which of an instance's addresses to check.
//! - [`health_check`]: does the proxy really proxy?
//! - [`egress_echo`]: which source address does a destination see through it?

pub mod address;
pub mod egress_echo;
pub mod health_check;
