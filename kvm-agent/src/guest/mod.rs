//! What the guest receives at first boot: the NoCloud seed.
//!
//! - [`cloud_init`]: the guest-agent bootstrap merged into the user's cloud-init.
//! - [`seed`]: the seed's `meta-data`, `user-data` and `vendor-data` as an ISO image.
//! - [`iso9660`]: the ISO 9660 writer the seed is built with, in memory.

pub mod cloud_init;
pub mod iso9660;
pub mod seed;
