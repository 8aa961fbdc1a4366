//! The top layer: the `Provider` contract on the layers below.
//!
//! - [`service`]: the gRPC service (`kvm-agent serve`): requests in, the one error mapping out.
//! - [`instances`]: Create, Get, List and Delete across hosts, each through
//!   [`HostPool::call`](crate::transport::pool::HostPool::call).
//! - [`plan`]: Create's request checked and resolved against the configuration.
//! - [`create`]: Create's steps in order, idempotent, with a test fault hook.
//! - [`room`]: each host's room, and the host a new instance goes to.
//! - [`locations`]: ListLocations: every host and zone with what it accepts and its room.
//! - [`state`]: libvirt states and guest addresses in the contract's terms.
//! - [`tags`]: UpdateInstanceTags, compare-and-set of an instance's tags.
//! - `sync`: per-key locks, so one Create, Delete or tag update per key runs at a time.
//! - [`watch`]: WatchInstances, from a sweep of every host each second.

pub mod create;
pub mod instances;
pub mod locations;
pub mod plan;
pub mod room;
pub mod service;
pub mod state;
pub(crate) mod sync;
pub mod tags;
pub mod watch;
