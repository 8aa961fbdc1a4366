//! WatchInstances for the agent: what libvirt says about the agent's domains, told to
//! the contract crate's [`WatchHub`], which serves every stream (snapshot, resume
//! tokens, restarts).
//!
//! 1. **One sweeper** ([`InstanceWatch::sweep_forever`]) lists every host's domains
//!    every [`SWEEP_INTERVAL`], the hosts side by side, each on its pooled connection, and tells the hub
//!    each instance as Get would answer it (the hub publishes only what changed), and
//!    that an instance is gone when its host's listing no longer has it. libvirt's
//!    domain events would be sooner, but virt 0.5 offers no safe way to register them
//!    (ADR 0021).
//! 2. **Addresses**: the guest agent, leases and ARP push nothing, so they are asked
//!    only for the running domains still without an address (PROVISIONING); a domain
//!    with one keeps it between sweeps, and every [`FULL_SWEEP_EVERY`]th sweep asks
//!    every domain again (a lease that changed).
//! 3. **A host that does not answer** (within `SWEEP_CALL_TIMEOUT`) is skipped:
//!    nothing is reported gone that could not be seen, and it is swept again only after
//!    a wait that grows from 30 s to 5 minutes, so the sweep does not dial a host that
//!    is down every second (callers' own calls would wait on those dials).
//! 4. Create, Delete and UpdateInstanceTags tell the hub their outcome at once
//!    ([`InstanceWatch::created`], [`InstanceWatch::deleted`],
//!    [`InstanceWatch::updated`]), so a stream sees them before the next sweep.
//! 5. **A sweep never undoes what a call told.** A listing taken before a Create,
//!    Delete or tag update answered, but read after it, would tell the hub the old
//!    instance again (a tag update undone until the next sweep). What a call told after
//!    a sweep's listing began wins over that sweep for that instance.
//! 6. **Half-made states are not news.** A domain that Create has defined but not yet
//!    started, or that Delete has stopped but not yet undefined, reads as shut off; a
//!    caller told STOPPED would replace a VM that is fine. An instance that a sweep
//!    finds STOPPED where the hub said otherwise is read again under its key's lock
//!    (which Create and Delete hold), and not at all while one of them runs.
//! 7. **The image cache's size** rides on the full sweeps: a host whose listing answered
//!    is asked what its cache holds (`ImageCache::usage`, one bounded call), for the
//!    `kvm_agent_image_cache_*` gauges. A host that does not answer loses its samples
//!    until it does, and is asked no more often than it is swept.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use egressproxy_provider::pb;
use egressproxy_provider::watch::WatchHub;

use crate::libvirt::domains::{self, NicKind};
use crate::provider::instances::Instances;
use crate::provider::state::to_contract_instance;
use crate::transport::call::LibvirtOp;

/// Time between two sweeps of every host.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// Every this many sweeps, the addresses of every running domain are asked again.
pub const FULL_SWEEP_EVERY: u32 = 30;

/// The hub the agent's streams are served from, and what its sweeps learned.
#[derive(Debug, Clone, Default)]
pub struct InstanceWatch {
    hub: WatchHub,
    /// When a call last told the hub about each instance (step 5 of the module docs).
    told: Arc<Mutex<HashMap<String, Instant>>>,
}

/// Deadline of one host's listing: a stalled host fails the sweep soon, and the
/// connection under it is dropped, rather than holding it for a caller's whole timeout.
const SWEEP_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long what a call told is remembered against sweeps: longer than a sweep's
/// listing may take ([`SWEEP_CALL_TIMEOUT`]) with its reports after it.
const TOLD_KEPT: Duration = Duration::from_secs(60);
/// First wait before a host whose sweep failed is swept again; it doubles up to
/// [`MAX_HOST_RETRY`]. Callers' own calls still reach it meanwhile; the sweep only
/// stops dialling a host that is down every second (and holding its dial lock, which
/// those calls would wait on).
const FIRST_HOST_RETRY: Duration = Duration::from_secs(30);
/// Longest wait before a failed host is swept again.
const MAX_HOST_RETRY: Duration = Duration::from_secs(300);

/// What one host's last sweep found.
#[derive(Debug, Default)]
struct HostSeen {
    /// The ids of its instances.
    ids: HashSet<String>,
    /// The addresses of its running domains that have one, by domain name.
    addresses: HashMap<String, Vec<IpAddr>>,
    /// Sweeps of it that failed in a row.
    failures: u32,
    /// Not swept again before this, after a failure.
    retry_at: Option<Instant>,
}

impl InstanceWatch {
    /// The hub that serves WatchInstances.
    pub fn hub(&self) -> &WatchHub {
        &self.hub
    }

    /// A Create's answer.
    pub fn created(&self, instance: &pb::Instance) {
        self.told(&instance.id);
        self.hub.updated(instance.clone());
    }

    /// An UpdateInstanceTags' answer: the instance with its new tags.
    pub fn updated(&self, instance: &pb::Instance) {
        self.told(&instance.id);
        self.hub.updated(instance.clone());
    }

    /// Instance `id` was deleted.
    pub fn deleted(&self, id: &str) {
        self.told(id);
        self.hub.deleted(id);
    }

    /// Notes that a call told the hub about `id` now; forgets what no sweep running now
    /// can have listed before.
    fn told(&self, id: &str) {
        let now = Instant::now();
        let mut told = self.told.lock().unwrap_or_else(|p| p.into_inner());
        told.retain(|_, at| now.duration_since(*at) < TOLD_KEPT);
        told.insert(id.to_owned(), now);
    }

    /// Whether a call told the hub about `id` after `listed_at`, when a sweep began the
    /// listing it is about to report.
    fn told_since(&self, id: &str, listed_at: Instant) -> bool {
        let told = self.told.lock().unwrap_or_else(|p| p.into_inner());
        told.get(id).is_some_and(|at| *at >= listed_at)
    }

    /// What a sweep whose listing began at `listed_at` found of `instance`, unless a
    /// call told newer since (step 5 of the module docs).
    fn swept(&self, instance: pb::Instance, listed_at: Instant) {
        if !self.told_since(&instance.id, listed_at) {
            self.hub.updated(instance);
        }
    }

    /// Sweeps every host of `instances` every `interval` for ever (step 1 of the module
    /// docs).
    pub async fn sweep_forever(self, instances: Instances, interval: Duration) {
        let mut seen: HashMap<String, HostSeen> = HashMap::new();
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        for sweep in 0u32.. {
            ticks.tick().await;
            let full = sweep % FULL_SWEEP_EVERY == 0;
            // The hosts side by side: one that hangs until its call's deadline holds
            // back only its own instances.
            let this = &self;
            let instances = &instances;
            let sweeps: Vec<_> = instances
                .config()
                .hosts
                .iter()
                .map(|host| {
                    let mut last = seen.remove(&host.name).unwrap_or_default();
                    if full {
                        last.addresses.clear();
                    }
                    async move {
                        let nic = NicKind::of(&host.attachment());
                        let answered = this.sweep_host(instances, &host.name, nic, &mut last).await;
                        if full {
                            measure_image_cache(instances, &host.name, answered).await;
                        }
                        (host.name.clone(), last)
                    }
                })
                .collect();
            seen.extend(futures::future::join_all(sweeps).await);
        }
    }

    /// Lists `host`'s domains and tells the hub what changed since `last`; whether the
    /// host answered.
    async fn sweep_host(
        &self,
        instances: &Instances,
        host: &str,
        nic: NicKind,
        last: &mut HostSeen,
    ) -> bool {
        let Ok(pool) = instances.pool().host(host) else {
            return false;
        };
        if last.retry_at.is_some_and(|at| Instant::now() < at) {
            return false;
        }
        let known = last.addresses.clone();
        let listed_at = Instant::now();
        let found = pool
            .call(
                LibvirtOp::new("virConnectListAllDomains"),
                Instant::now() + SWEEP_CALL_TIMEOUT,
                move |conn| domains::list_instances_knowing(conn, &[], nic, &known),
            )
            .await;
        let snapshots = match found {
            Ok(snapshots) => snapshots,
            Err(error) => {
                last.failures = last.failures.saturating_add(1);
                let wait = FIRST_HOST_RETRY
                    .saturating_mul(1 << last.failures.saturating_sub(1).min(8))
                    .min(MAX_HOST_RETRY);
                last.retry_at = Some(Instant::now() + wait);
                tracing::debug!(%host, %error, retry_in = ?wait,
                    "watch sweep skipped a host that did not answer");
                return false;
            }
        };
        let mut now = HostSeen::default();
        for snapshot in snapshots {
            if !snapshot.addresses.is_empty() {
                now.addresses
                    .insert(snapshot.domain.clone(), snapshot.addresses.clone());
            }
            let instance = to_contract_instance(host, snapshot);
            now.ids.insert(instance.id.clone());
            if self.newly_stopped(&instance) {
                self.confirm(instances, &instance.id).await;
            } else {
                self.swept(instance, listed_at);
            }
        }
        for gone in last.ids.difference(&now.ids) {
            if !self.told_since(gone, listed_at) {
                self.hub.deleted(gone);
            }
        }
        *last = now;
        true
    }

    /// Whether `instance` reads STOPPED where the hub last said otherwise (or said
    /// nothing): a sweep that ran while a Create had defined but not yet started its
    /// domain, or while a Delete had stopped but not yet undefined it, sees it shut off.
    fn newly_stopped(&self, instance: &pb::Instance) -> bool {
        instance.state() == pb::InstanceState::Stopped
            && self
                .hub
                .current(&instance.id)
                .is_none_or(|last| last.state() != pb::InstanceState::Stopped)
    }

    /// Reads instance `id` again once no Create or Delete of its key runs, and tells the
    /// hub that; while one runs, tells nothing (its answer will).
    async fn confirm(&self, instances: &Instances, id: &str) {
        match instances.read_settled(id).await {
            Some(Ok(Some(instance))) => self.hub.updated(instance),
            Some(Ok(None)) => self.hub.deleted(id),
            Some(Err(error)) => {
                tracing::debug!(instance.id = %id, %error, "watch sweep could not read a stopped instance again");
            }
            None => {}
        }
    }
}

/// Records what the image cache holds on `host` (step 7 of the module docs); a host
/// that did not answer its sweep is not asked, and loses its samples.
async fn measure_image_cache(instances: &Instances, host: &str, answered: bool) {
    let held = match instances.pool().host(host) {
        Ok(pool) if answered => {
            let deadline = Instant::now() + SWEEP_CALL_TIMEOUT;
            match instances.image_cache().usage(&pool, deadline).await {
                Ok(usage) => Some((usage.images, usage.bytes)),
                Err(error) => {
                    tracing::debug!(%host, %error, "could not measure the image cache");
                    None
                }
            }
        }
        _ => None,
    };
    crate::metrics::global().image_cache_held(host, held);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instance(id: &str, owner: &str) -> pb::Instance {
        pb::Instance {
            id: id.to_owned(),
            tags: [("owner".to_owned(), owner.to_owned())].into(),
            ..Default::default()
        }
    }

    /// A sweep that listed before a tag update answered, and reports after it, does not
    /// put the old tags back; one that listed after does report.
    #[tokio::test]
    async fn a_sweep_listed_before_a_call_does_not_undo_what_the_call_told() {
        let watch = InstanceWatch::default();
        let listed_before = Instant::now();
        watch.updated(&instance("hv/k", "new"));
        watch.swept(instance("hv/k", "old"), listed_before);
        assert_eq!(watch.hub.current("hv/k").unwrap().tags["owner"], "new");

        let listed_after = Instant::now() + Duration::from_millis(1);
        watch.swept(instance("hv/k", "newer"), listed_after);
        assert_eq!(watch.hub.current("hv/k").unwrap().tags["owner"], "newer");

        // Nor does it bring back what a Delete told gone.
        let listed_before = Instant::now();
        watch.deleted("hv/k");
        watch.swept(instance("hv/k", "newer"), listed_before);
        assert!(watch.hub.current("hv/k").is_none());
    }
}
