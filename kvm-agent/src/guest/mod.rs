//! What the guest receives at first boot: the NoCloud seed.
//!
//! - [`cloud_init`]: the guest-agent bootstrap merged into the user's cloud-init.
//! - [`network_config`]: the seed's `network-config` for an instance with a static address.
//! - [`seed`]: the seed's `meta-data`, `user-data`, `vendor-data` and `network-config` as
//!   an ISO image.
//! - [`iso9660`]: the ISO 9660 writer the seed is built with, in memory.
//! - [`GuestError`]: cloud-init documents the agent cannot use, classified.

pub mod cloud_init;
mod error;
pub mod iso9660;
pub mod network_config;
pub mod seed;

pub use error::GuestError;
