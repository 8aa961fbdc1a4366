//! What the guest receives at first boot: the NoCloud seed.
//!
//! - [`cloud_init`]: the guest-agent bootstrap merged into the user's cloud-init.
//! - [`seed`]: the seed's `meta-data`, `user-data` and `vendor-data` as an ISO image.
//! - [`iso9660`]: the ISO 9660 writer the seed is built with, in memory.
//! - [`GuestError`]: cloud-init documents the agent cannot use, classified.

pub mod cloud_init;
mod error;
pub mod iso9660;
pub mod seed;

pub use error::GuestError;
