//! kvm-agent: an egressproxy `Provider` on libvirt reached over SSH.
//!
//! The transport, bottom-up:
//! - [`config`]: the YAML configuration, validated at start-up.
//! - [`ssh`]: keys, host key verification, one SSH session per host.
//! - [`forward`]: the relay under each libvirt connection (SSH channel or local socket).
//! - [`connection`]: one libvirt connection over its relay; never blocks the runtime.
//! - [`event_loop`]: libvirt's event loop thread, which libvirt keepalive needs.
//! - [`pool`]: per-host connection reuse, serialized dials, redial on transport failure.
//! - [`libvirt_call`]: the one traced, deadline-bounded wrapper of every libvirt call.
//! - [`volume_upload`]: streaming a volume's content on a dedicated connection.
//! - [`bulk_runtime`]: the low-priority runtime bulk streams run on.
//! - [`error`]: the crate's error type and the classification of libvirt and SSH errors.
//!
//! The Provider on top:
//! - [`naming`]: domain, volume and host names and instance ids from keys.
//! - [`create_plan`]: Create's request checked and resolved against the config.
//! - [`cloud_init`]: the guest-agent bootstrap merged into the user's cloud-init.
//! - [`iso9660`] and [`seed`]: the NoCloud seed image, built in memory.
//! - [`domain_xml`] and [`volume_xml`]: libvirt XML from serde structs; metadata parsed back.
//! - [`instance_state`]: libvirt states and guest addresses in the contract's terms.
//! - [`instance_ops`]: read, list and delete on one libvirt connection (blocking).
//! - [`create_ops`]: Create's steps on one libvirt connection (blocking), each repeatable.
//! - [`instance_create`]: Create's steps in order, idempotent, with a test fault hook.
//! - [`instances`]: Create, Get, List and Delete across hosts, through
//!   [`pool::HostPool::call`].
//! - [`image_fetch`]: an image's HTTP(S) or `file://` body, streamed through SHA-256.
//! - [`image_cache`]: content-addressed base volumes, downloaded once per host and image.
//! - [`host_capabilities`]: UEFI firmware and the KVM probe (`domainType: auto`).
//! - [`host_check`]: `kvm-agent check-host` and ValidatePlacement's report.
//! - [`provider_service`]: the gRPC Provider service (`kvm-agent serve`) over [`instances`].

pub use egressproxy_provider as contract;

pub mod bulk_runtime;
pub mod cloud_init;
pub mod config;
pub mod connection;
pub mod create_ops;
pub mod create_plan;
pub mod domain_xml;
pub mod error;
pub mod event_loop;
pub mod forward;
pub mod host_capabilities;
pub mod host_check;
pub mod image_cache;
pub mod image_fetch;
pub mod instance_create;
pub mod instance_ops;
pub mod instance_state;
pub mod instances;
pub mod iso9660;
pub mod libvirt_call;
pub mod naming;
pub mod pool;
pub mod provider_service;
pub mod seed;
pub mod ssh;
pub mod volume_upload;
pub mod volume_xml;

pub use error::{Error, ErrorClass};
