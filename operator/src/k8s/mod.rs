//! The Kubernetes plumbing every resource uses; nothing here knows how a Proxy is
//! reconciled.
//!
//! - [`client`]: the Kubernetes client, with a bounded connection pool.
//! - [`watch_scope`]: the namespaces watched; [`merged_watch`]: several namespaces'
//!   watches as one stream; [`proxy_cache`]: the one store of Proxies they fill;
//!   [`watch_health`]: which watches have listed and which fail.
//! - [`published`]: what was last written of each Proxy's Service and EndpointSlices,
//!   so that a reconcile wanting the same again reads nothing.
//! - [`own_writes`]: each Proxy's last status write, so that no reconcile works from
//!   a copy older than it.
//! - [`status`]: conditions, the phase derived from them, server-side-apply writes.
//! - [`events`]: Events, one per distinct note.
//! - [`leader`]: leader election on a Lease.
//! - [`cloud_init`]: a Proxy spec's cloud-init input, inline or from its Secret.
//! - [`cluster_name`]: the `egressproxy.dev/cluster` tag's value (the flag, or the
//!   cluster's own identity).

pub mod client;
pub mod cloud_init;
pub mod cluster_name;
pub mod events;
pub mod leader;
pub mod merged_watch;
pub mod own_writes;
pub mod proxy_cache;
pub mod published;
pub mod status;
pub mod watch_health;
pub mod watch_scope;
