//! kvm-agent: an egressproxy `Provider` on libvirt reached over SSH.
//!
//! The crate is cut into layers. Each layer is a folder and imports only from the layers
//! below it (and from [`config`] and [`error`], which every layer shares):
//!
//! ```text
//!   provider    the gRPC Provider: Create, Get, List, Delete, ValidatePlacement
//!      │
//!      ├──────────────┬──────────────┐
//!      ▼              ▼              │
//!   images         guest             │
//!   base volumes   NoCloud seed      │
//!      │                             │
//!      ▼                             ▼
//!   libvirt     domains, volumes, XML, host checks (blocking, one connection)
//!      │
//!      ▼
//!   transport   SSH, relay, connections, the traced deadline-bounded call
//! ```
//!
//! - [`transport`]: `transport::ssh` sessions, the [`transport::relay`] under each
//!   libvirt connection, `transport::connection`, the per-host [`transport::pool`],
//!   [`transport::call`] (the one traced, deadline-bounded wrapper of every libvirt
//!   call), [`transport::libvirt_error`] (libvirt's errors classified once), libvirt's
//!   [`transport::event_loop`], and [`transport::bulk`] uploads.
//! - [`libvirt`]: [`libvirt::xml`] (domain, metadata, volume, capabilities),
//!   [`libvirt::naming`], [`libvirt::domains`], [`libvirt::addresses`],
//!   `libvirt::volumes` and [`libvirt::host`] (capabilities, check-host).
//! - [`guest`]: [`guest::cloud_init`], [`guest::seed`] and [`guest::iso9660`].
//! - [`images`]: the content-addressed base volume [`images::cache`], image
//!   [`images::fetch`] and `images::eviction`.
//! - [`provider`]: the gRPC [`provider::service`] over [`provider::instances`], with
//!   [`provider::plan`], [`provider::create`], [`provider::state`] and `provider::sync`.
//! - [`config`]: the YAML configuration, validated at start-up.
//! - [`error`]: the crate's error type and THE mapping of every error to the contract.
//!
//! A Create, top to bottom: [`provider::service`] checks the request and calls
//! [`provider::instances::Instances::create`]; [`provider::plan`] resolves it against the
//! configuration; [`images::cache`] makes sure the base volume is on the host;
//! [`guest::seed`] builds the seed; [`provider::create`] runs the steps in order, each a
//! [`libvirt`] function run through [`transport::pool::HostPool::call`].

pub use egressproxy_provider as contract;

pub mod config;
pub mod error;
pub mod guest;
pub mod images;
pub mod libvirt;
pub mod provider;
pub mod transport;

pub use error::{Error, ErrorClass, TransportError};
