//! The egressproxy operator: reconciles `Proxy` resources through `Provider` services.
//!
//! - [`crd`]: the `Proxy` and `ProxyPool` resources.
//! - [`pool`]: ProxyPools: members made from a template, scaled, rolled and spread,
//!   behind one Service.
//! - [`providers`]: the configured providers, their clients and handshake, and the
//!   reload of their config file.
//! - [`controller`]: the watch loop; [`reconcile`]: one Proxy's reconcile;
//!   [`secret_watch`]: the cloud-init Secrets that retry the Proxies waiting for them;
//!   [`instance_watch`]: the providers' streams of instance changes, which reconcile a
//!   Proxy as soon as its instance changes; [`owned_watch`]: the Proxies' Services and
//!   EndpointSlices, which reconcile a Proxy whose objects someone changed.
//! - [`proxy_service`]: the Service a Proxy is reached by and its EndpointSlice.
//! - [`watch_scope`]: the namespaces watched; [`merged_watch`]: several namespaces'
//!   watches as one stream; [`proxy_cache`]: the one store of Proxies they fill, which
//!   the controller, garbage collection and the memory sweep read;
//!   [`watch_health`]: which watches have listed and which fail, and
//!   [`watch_report`]: the Events and gauge that say so.
//! - [`status`]: conditions, the phase derived from them, server-side-apply writes.
//! - [`events`]: Events about Proxies, one per distinct note.
//! - [`health_check`]: does the proxy really proxy? [`egress_echo`]: which source
//!   address does a destination see through it?
//! - [`metrics`]: Prometheus metrics; [`http`]: `/metrics`, `/healthz`, `/readyz`;
//!   [`kube_client`]: the Kubernetes client, with a bounded connection pool;
//!   [`liveness`]: whether the control loop still processes requests (`/healthz`).
//! - [`leader`]: leader election on a Lease; [`gc`]: garbage collection of orphans.
//! - [`backoff`]: per-object exponential backoff with jitter; [`limits`]: the bounds of
//!   every duration setting.
//! - [`context`]: state shared by reconciles; [`memory_sweep`]: its per-Proxy maps swept
//!   against the store; [`error`]: the crate's error type.
//! - [`uninstall_check`]: the chart's pre-delete hook, refusing to uninstall while
//!   Proxies exist.
//! - [`cluster_name`]: the `egressproxy.dev/cluster` tag's value (the flag, or the
//!   cluster's own identity).

pub mod backoff;
pub mod cluster_name;
pub mod context;
pub mod controller;
pub mod crd;
pub mod egress_echo;
pub mod error;
pub mod events;
pub mod gc;
pub mod health_check;
pub mod http;
pub mod instance_watch;
pub mod kube_client;
pub mod leader;
pub mod limits;
pub mod liveness;
pub mod memory_sweep;
pub mod merged_watch;
pub mod metrics;
pub mod owned_watch;
pub mod pool;
pub mod providers;
pub mod proxy_cache;
pub mod proxy_service;
pub mod reconcile;
pub mod secret_watch;
pub mod status;
pub mod uninstall_check;
pub mod watch_health;
pub mod watch_report;
pub mod watch_scope;
