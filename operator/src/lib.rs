//! The egressproxy operator: reconciles `Proxy` and `ProxyPool` resources through
//! `Provider` services.
//!
//! A folder per resource, and below them what they share. Imports point down this list
//! only (the layer rule in `tests/layer_rule.rs` enforces it):
//!
//! - [`proxy`]: the `Proxy` resource: its controller, reconcile (observe → plan → act,
//!   cleanup), garbage collection, and the watches that start its reconciles.
//! - [`pool`]: the `ProxyPool` resource: members made from a template, scaled, rolled
//!   and spread, behind one Service.
//! - [`endpoints`]: the Service and EndpointSlices a Proxy or a pool is reached by.
//! - [`context`]: the state shared by reconciles (clients, providers, per-Proxy maps).
//! - [`providers`]: the configured providers, their clients and handshake, and the
//!   reload of their config file.
//! - [`k8s`]: the Kubernetes plumbing: client, watches and the Proxy cache, status
//!   writes, Events, leader election, the cluster's name.
//! - [`probe`]: what is asked of a running proxy (health check, egress address).
//! - [`shared`]: error, backoff, limits, metrics, the HTTP endpoints, liveness, the
//!   allocator trim that hands freed memory back after a burst of deletes, and the
//!   shrinking of maps whose entries went.
//! - [`crd`]: the `Proxy` and `ProxyPool` resources' types.
//!
//! [`uninstall_check`] is the chart's pre-delete hook, refusing to uninstall while
//! Proxies exist.

pub mod context;
pub mod crd;
pub mod endpoints;
pub mod k8s;
pub mod pool;
pub mod probe;
pub mod providers;
pub mod proxy;
pub mod shared;
pub mod uninstall_check;
