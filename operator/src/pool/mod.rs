//! ProxyPools: `replicas` member Proxies made from one template, behind one Service.
//!
//! - [`plan`]: what a pool does next (pure, table-tested): scale, roll a template
//!   change within `maxSurge`/`maxUnavailable`, spread.
//! - [`member`]: how members are named, labelled, built and recognised.
//! - [`spread`]: where new members go (a fixed list, or the provider's locations).
//! - [`reconcile`]: one pool's pass (observe → plan → act → Service → status).
//! - [`controller`]: the watches that start passes.
//!
//! The pool never touches a VM: each member is an ordinary Proxy, whose own controller
//! creates, health-checks and replaces its VM. The pool only decides which Proxies
//! exist and which of them its Service lists.

pub mod controller;
pub mod member;
pub mod plan;
pub mod reconcile;
pub mod spread;

pub use controller::run;
