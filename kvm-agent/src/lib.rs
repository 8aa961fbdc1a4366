//! kvm-agent: an egressproxy `Provider` on libvirt reached over SSH.
//!
//! The crate is cut into layers. Each layer is a folder and imports only from the layers
//! below it (and from [`config`] and [`classification`], leaves which every layer shares;
//! the top-level [`error`] and [`startup`] modules sit above them all). A test
//! (`tests/layer_rule.rs`) reads the source of each lower layer and fails on an import
//! that points upwards, and on a module under `src/` it does not list; inside each
//! folder, too, no two modules name each other in a cycle:
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
//!   call), [`transport::libvirt_error`] (libvirt's errors classified once),
//!   [`transport::error`] (the layer's error type; a call's closure fails with the
//!   calling layer's own error, [`transport::call::CallFailure`]), libvirt's
//!   [`transport::event_loop`], [`transport::bulk`] uploads and the low-priority
//!   [`transport::bulk_runtime`] they run on.
//! - [`libvirt`]: [`libvirt::error`] (the layer's error type), [`libvirt::xml`] (domain,
//!   metadata, volume, capabilities),
//!   [`libvirt::naming`], [`libvirt::domains`], [`libvirt::addresses`],
//!   `libvirt::volumes` and [`libvirt::host`] (capabilities, check-host).
//! - [`guest`]: [`guest::cloud_init`], [`guest::seed`] and [`guest::iso9660`].
//! - [`images`]: the content-addressed base volume [`images::cache`] (with the volumes'
//!   names in `images::base_volume` and its settings in `images::cache_options`), image
//!   [`images::fetch`], `images::eviction` and [`images::error`] (the layer's error type).
//! - [`provider`]: the gRPC [`provider::service`] over [`provider::instances`], with
//!   [`provider::plan`], [`provider::create`], [`provider::state`] and `provider::sync`.
//! - `single_flight`: one detached task per key that callers wait on up to their own
//!   deadline (the base image download, the KVM probe); shared by the layers, depends on
//!   none of them.
//! - [`config`]: the YAML configuration and every check of the file alone (each duration
//!   within its range), with its own [`config::error::ConfigError`]; also how a URL is
//!   shown without its secrets ([`config::redact_url`]). A leaf: it imports no layer.
//! - [`startup`]: the configuration loaded and checked against the machine (private keys,
//!   `known_hosts`, the spool directory), all problems together; above the layers.
//! - [`metrics`]: the process's Prometheus metrics (gRPC calls, libvirt calls, the image
//!   cache, SSH sessions), recorded where the work happens; a leaf like
//!   [`classification`].
//! - [`classification`]: the vocabulary every layer classifies its own errors in, once
//!   ([`classification::Classification`]: the contract's class, the reason, a retry
//!   hint). A leaf: it imports no layer.
//! - [`error`]: the top-level [`Error`], which wraps each layer's error
//!   ([`TransportError`], [`config::error::ConfigError`], [`libvirt::LibvirtError`],
//!   [`images::ImageError`], [`guest::GuestError`]) with `#[from]`, and THE mapping of
//!   every error to the contract ([`Error::to_provider_error`]). No layer below the
//!   provider names it; the provider returns it, and only [`provider::service`], the
//!   gRPC edge, turns it into the contract's error.
//!
//! A Create, top to bottom: [`provider::service`] checks the request and calls
//! [`provider::instances::Instances::create`]; [`provider::plan`] resolves it against the
//! configuration; [`images::cache`] makes sure the base volume is on the host;
//! [`guest::seed`] builds the seed; [`provider::create`] runs the steps in order, each a
//! [`libvirt`] function run through [`transport::pool::HostPool::call`].

#![forbid(unsafe_code)]

pub use egressproxy_provider as contract;

pub mod classification;
pub mod config;
pub mod error;
pub mod guest;
pub mod images;
pub mod libvirt;
pub mod metrics;
pub mod provider;
pub(crate) mod single_flight;
pub mod startup;
pub mod transport;

pub use error::{Error, ErrorClass, TransportError};
