//! The tags the operator sets on instances: who owns one, read back by ListInstances
//! (garbage collection, a pool's spares) and by the instance watch.
//!
//! A member or lone Proxy's instance carries [`CLUSTER`], [`NAMESPACE`], [`NAME`] and
//! [`UID`]. A pool's spare carries [`CLUSTER`], [`NAMESPACE`], [`POOL`], [`POOL_UID`],
//! [`ROLE`], [`TEMPLATE_HASH`] and [`PLACED_AT`], and no [`UID`]: the Proxy garbage collection, which
//! judges instances by their Proxy's UID, never takes a spare for an orphan. Adopting
//! a spare replaces its tags with the member's in one compare-and-set.

/// The operator's `--cluster-name`.
pub const CLUSTER: &str = "egressproxy.dev/cluster";
/// The Proxy's (or the spare's pool's) namespace.
pub const NAMESPACE: &str = "egressproxy.dev/namespace";
/// The Proxy's name.
pub const NAME: &str = "egressproxy.dev/name";
/// The Proxy's UID.
pub const UID: &str = "egressproxy.dev/uid";
/// The name of the pool a spare belongs to.
pub const POOL: &str = "egressproxy.dev/pool";
/// The UID of the pool a spare belongs to.
pub const POOL_UID: &str = "egressproxy.dev/pool-uid";
/// What a pool's instance is for: [`ROLE_SPARE`] (a member may adopt it) or
/// [`ROLE_RETIRING`] (the pool deletes it; nobody may adopt it any more).
pub const ROLE: &str = "egressproxy.dev/role";
/// The hash of the pool template a spare was made from.
pub const TEMPLATE_HASH: &str = "egressproxy.dev/template-hash";
/// Where a spare was placed: `host/NAME` or `zone/NAME` (a spread target), or
/// `template` (the template's own placement). A member adopts only a spare placed where
/// it would be created.
pub const PLACED_AT: &str = "egressproxy.dev/placed-at";
/// [`ROLE`] of a booted instance waiting for a member to adopt it.
pub const ROLE_SPARE: &str = "spare";
/// [`ROLE`] of a spare the pool is deleting.
pub const ROLE_RETIRING: &str = "retiring";
