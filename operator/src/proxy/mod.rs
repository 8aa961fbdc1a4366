//! The `Proxy` resource: one VM through a provider, health-checked, replaced when lost.
//!
//! - [`controller`]: the watch loop that starts reconciles, and what else starts one:
//!   [`secret_watch`] (a cloud-init Secret a waiting Proxy names appears),
//!   [`instance_watch`] (a provider's stream says the instance changed) and the
//!   endpoints' own watch ([`crate::endpoints::owned_watch`]).
//! - [`reconcile`]: one Proxy's reconcile (observe → plan → act, and cleanup).
//! - [`gc`]: garbage collection of instances whose Proxy is gone or superseded.
//! - [`memory_sweep`]: the per-Proxy in-memory state swept against the cache.
//! - [`watch_report`]: the Events and gauge that say which namespaces' watches fail.

pub mod controller;
pub mod gc;
pub mod instance_watch;
pub mod memory_sweep;
pub mod reconcile;
pub mod secret_watch;
pub mod watch_report;
