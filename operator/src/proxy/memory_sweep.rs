//! The periodic sweep of the per-Proxy maps against the reflector's store.
//!
//! Entries go with their Proxy when its cleanup finishes or the watch sees it deleted
//! ([`Context::forget_proxy`]). Work that finishes after that (a provider call that returns
//! once the Proxy is gone, a write that meets a 404) could record an entry again, for a
//! UID that no event will ever name. Every [`INTERVAL`], once the store has its first
//! list, every entry of a UID the store does not hold is dropped, so such an entry
//! lives at most that long.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kube::ResourceExt;
use kube::runtime::reflector::Store;

use crate::context::Context;
use crate::crd::Proxy;

/// How often the per-Proxy maps are swept.
pub const INTERVAL: Duration = Duration::from_secs(60);

/// Sweeps every `interval`, for ever.
pub async fn run(ctx: Arc<Context>, store: Store<Proxy>, interval: Duration) {
    if store.wait_until_ready().await.is_err() {
        return;
    }
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        ctx.forget_proxies_except(|| live_uids(&store));
        ctx.report_memory();
    }
}

/// The UIDs of the Proxies `store` holds.
pub fn live_uids(store: &Store<Proxy>) -> HashSet<String> {
    store
        .state()
        .iter()
        .filter_map(|proxy| proxy.uid())
        .collect()
}
