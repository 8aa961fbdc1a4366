//! ProxyPools: `replicas` member Proxies made from one template, behind one Service.
//!
//! - [`plan`]: what a pool does next (pure, table-tested): scale, roll a template
//!   change within `maxSurge`/`maxUnavailable`, spread.
//! - [`member`]: how members are named, labelled, built and recognised.
//! - [`spread`]: where new members go (a fixed list, or the provider's locations).
//! - [`spare_plan`]: what a pool does with its spares, and which spare a new member
//!   adopts (pure, table-tested).
//! - [`spares`]: the spares at the provider: found, checked, created, retired.
//! - [`spare_pass`]: a pass's work on its spares, and their status.
//! - [`finalizer`]: deleting the spares with the pool.
//! - [`reconcile`]: one pool's pass (observe → plan → act → Service → status).
//! - [`controller`]: the watches that start passes.
//!
//! The pool never touches a member's VM: each member is an ordinary Proxy, whose own
//! controller creates, health-checks and replaces its VM. The pool decides which
//! Proxies exist and which of them its Service lists. The one VM it handles itself is
//! a spare (`spec.spares`): booted in advance, in no Service, until a new member
//! adopts it (the member's controller takes it over by a compare-and-set of its tags).

pub mod controller;
pub mod finalizer;
pub mod member;
pub mod plan;
pub mod reconcile;
pub mod spare_pass;
pub mod spare_plan;
pub mod spares;
pub mod spread;

pub use controller::run;
