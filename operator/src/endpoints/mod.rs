//! How workloads reach proxies: a Service without a selector and EndpointSlices that
//! list the Ready addresses, for one Proxy or for a whole ProxyPool.
//!
//! - [`service`]: the objects one owner wants, built and applied with server-side
//!   apply, writing only what differs; withdrawn when the owner goes.
//! - [`publisher`]: the Proxies' Service controller, which syncs them from each
//!   Proxy's cached status in a queue of its own, bounded apart from the reconciles.
//! - [`owned_watch`]: the watch of those objects, so that a change someone else makes
//!   syncs the owner again, which restores them.

pub mod owned_watch;
pub mod publisher;
pub mod service;
