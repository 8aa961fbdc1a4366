//! What every reconcile shares: clients, configured providers, and the per-Proxy state
//! kept in memory (backoff attempts, health-check failures, cached Events, the phase
//! gauge). What must survive a restart (the instance being replaced) is in status.
//!
//! Every per-Proxy entry is keyed by the Proxy's UID and dropped when the Proxy goes:
//! its reconcile state by [`Context::forget_reconcile_state`] once its cleanup finished,
//! the rest by [`Context::forget_proxy`] when the watch sees it deleted (or
//! [`Context::forget_proxies_except`] finds it gone), so memory follows the live Proxies,
//! not every Proxy ever seen.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Resource;

use crate::crd::Proxy;
use crate::k8s::events::{EventPublisher, EventType};
use crate::k8s::own_writes::OwnWrites;
use crate::k8s::published::Published;
use crate::providers::Providers;
use crate::shared::backoff::Backoff;
use crate::shared::liveness::Liveness;
use crate::shared::memory::Trimmer;
use crate::shared::metrics::Metrics;
use crate::shared::tables::shrink_when_sparse;

/// Default interval of the slow retry after a permanent error whose cause lies
/// outside the Proxy's spec.
pub const DEFAULT_PERMANENT_RETRY: Duration = Duration::from_secs(300);

/// Default of `--max-concurrent-reconciles`: enough to keep a provider and the
/// apiserver busy (a reconcile mostly waits on them), few enough that a provider
/// config change, which reconciles every Proxy, does not send thousands of calls at
/// once.
pub const DEFAULT_MAX_CONCURRENT_RECONCILES: u16 = 32;

/// Default of `--max-concurrent-service-syncs`: the Services of a burst of new Proxies
/// are written a few at a time, so that the apiserver's work on them (a ClusterIP
/// allocation each) does not crowd out the writes that make Proxies Ready.
pub const DEFAULT_MAX_CONCURRENT_SERVICE_SYNCS: u16 = 4;

/// Shared state of the controller.
pub struct Context {
    /// Kubernetes client.
    pub client: kube::Client,
    /// Configured providers.
    pub providers: Providers,
    /// Value of the `egressproxy.dev/cluster` tag on every instance this operator makes.
    pub cluster_name: String,
    /// Backoff after failed reconciles.
    pub retry_backoff: Backoff,
    /// Backoff after failed writes of a Proxy's Service or EndpointSlices.
    pub publish_backoff: Backoff,
    /// Poll interval while an instance provisions.
    pub poll_backoff: Backoff,
    /// Backoff between replacements of a stopped or vanished instance.
    pub replace_backoff: Backoff,
    /// Interval of the slow retry after a permanent error whose cause lies outside
    /// the Proxy's spec (the provider's configuration, its images).
    pub permanent_retry: Duration,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// Most reconciles running at once.
    pub max_concurrent_reconciles: u16,
    /// Most Service syncs running at once ([`crate::endpoints::publisher`]).
    pub max_concurrent_service_syncs: u16,
    /// The operator itself, as Events about it (not about one Proxy) name it: its Pod
    /// (`POD_NAME` in `POD_NAMESPACE`, as the chart sets them).
    pub operator: ObjectReference,
    /// The control loop's liveness, which the controller beats.
    pub liveness: Arc<Liveness>,
    /// Consecutive health check failures per Proxy UID.
    pub health_failures: Mutex<HashMap<String, u32>>,
    /// What was last written of each Proxy's Service and EndpointSlices.
    pub published: Published,
    /// Each Proxy's last status write, until a reconcile's copy is at least as new.
    pub own_writes: OwnWrites,
    /// The last reconcile trigger (a hash of what makes a Proxy worth reconciling)
    /// seen per Proxy UID.
    triggers: Mutex<HashMap<String, u64>>,
    /// Serialises [`Context::report_memory`], so a report read before a
    /// `forget_reconcile_state` cannot be written after that one's own report.
    reporting: Mutex<()>,
    events: EventPublisher,
    /// Gives freed memory back once Proxies stop being forgotten; `main` spawns its
    /// task.
    pub trimmer: Trimmer,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("providers", &self.providers)
            .field("cluster_name", &self.cluster_name)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// A context with the default backoff settings.
    pub fn new(
        client: kube::Client,
        providers: Providers,
        cluster_name: String,
        metrics: Arc<Metrics>,
    ) -> Self {
        Context {
            events: EventPublisher::new(client.clone(), std::env::var("POD_NAME").ok()),
            client,
            providers,
            cluster_name,
            retry_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(300)),
            publish_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(300)),
            // A booting VM is polled at most 2 s apart: GetInstance is cheap, and a longer
            // cap showed up directly in apply → Ready (a guest boots in 30-45 s here, so a
            // 10 s poll alone could add a quarter to it).
            poll_backoff: Backoff::new(Duration::from_millis(500), Duration::from_secs(2)),
            replace_backoff: Backoff::new(Duration::from_secs(2), Duration::from_secs(300)),
            permanent_retry: DEFAULT_PERMANENT_RETRY,
            health_failures: Mutex::default(),
            published: Published::default(),
            own_writes: OwnWrites::default(),
            triggers: Mutex::default(),
            reporting: Mutex::default(),
            trimmer: Trimmer::new(metrics.clone()),
            liveness: Arc::default(),
            metrics,
            max_concurrent_reconciles: DEFAULT_MAX_CONCURRENT_RECONCILES,
            max_concurrent_service_syncs: DEFAULT_MAX_CONCURRENT_SERVICE_SYNCS,
            operator: operator_pod(),
        }
    }

    /// Publishes an Event about the operator itself.
    pub async fn publish_about_operator(&self, type_: EventType, reason: &str, note: &str) {
        self.events
            .publish(&self.operator, type_, reason, note)
            .await;
    }

    /// The same, beating `liveness` (the one `/healthz` reads).
    pub fn with_liveness(mut self, liveness: Arc<Liveness>) -> Self {
        self.liveness = liveness;
        self
    }

    /// Publishes an Event about any object (a pool, for example); a failure to publish
    /// is logged, not fatal.
    pub async fn publish_about(
        &self,
        regarding: &k8s_openapi::api::core::v1::ObjectReference,
        type_: EventType,
        reason: &str,
        note: &str,
    ) {
        self.events.publish(regarding, type_, reason, note).await;
    }

    /// Publishes an Event about `proxy`; a failure to publish is logged, not fatal.
    pub async fn publish(&self, proxy: &Proxy, type_: EventType, reason: &str, note: &str) {
        self.events
            .publish(&proxy.object_ref(&()), type_, reason, note)
            .await;
    }

    /// Records the Proxy's current reconcile trigger; whether it differs from the last
    /// one seen (a Proxy seen for the first time has changed).
    pub fn trigger_changed(&self, uid: &str, trigger: u64) -> bool {
        lock(&self.triggers).insert(uid.to_owned(), trigger) != Some(trigger)
    }

    /// The delay before retrying a failed reconcile of the Proxy with `uid`: its
    /// growing backoff while the watch still has the Proxy, else the first delay with
    /// nothing recorded. A reconcile can fail after the watch saw its Proxy go (its last
    /// write meets a 404); an entry recorded then would never be forgotten.
    pub fn retry_delay(&self, uid: &str) -> Duration {
        self.delay_of(&self.retry_backoff, uid)
    }

    /// The delay before retrying a failed Service sync of the Proxy with `uid`, by the
    /// same rule as [`Context::retry_delay`].
    pub fn publish_delay(&self, uid: &str) -> Duration {
        self.delay_of(&self.publish_backoff, uid)
    }

    fn delay_of(&self, backoff: &Backoff, uid: &str) -> Duration {
        // Holding the triggers lock orders this against `forget_proxy`, which removes the
        // trigger before it drops the backoff.
        let triggers = lock(&self.triggers);
        if triggers.contains_key(uid) {
            backoff.next(uid)
        } else {
            backoff.first_delay()
        }
    }

    /// Drops every in-memory entry of the Proxy with `uid`: it left the watch.
    pub fn forget_proxy(&self, uid: &str) {
        let mut triggers = lock(&self.triggers);
        triggers.remove(uid);
        shrink_when_sparse(&mut triggers);
        drop(triggers);
        self.forget_reconcile_state(uid);
    }

    /// Drops the Proxy's reconcile state once its cleanup is done. Its last trigger
    /// stays until the watch sees it deleted, so the status write and finalizer
    /// removal that follow do not look like changes worth another reconcile.
    pub fn forget_reconcile_state(&self, uid: &str) {
        self.retry_backoff.reset(uid);
        self.publish_backoff.reset(uid);
        self.poll_backoff.reset(uid);
        self.replace_backoff.reset(uid);
        self.clear_health_failures(uid);
        self.published.forget(uid);
        self.own_writes.forget(uid);
        self.events.forget(uid);
        self.metrics.set_phase(uid, None);
        self.report_memory();
        self.trimmer.mark();
    }

    /// Forgets the Proxy's consecutive health check failures.
    pub fn clear_health_failures(&self, uid: &str) {
        let mut failures = lock(&self.health_failures);
        failures.remove(uid);
        shrink_when_sparse(&mut failures);
    }

    /// Drops the entries of every Proxy that `live` (the UIDs of the Proxies the store
    /// holds) does not name, whichever map holds them: Proxies deleted while no watch
    /// event could say so (a restart, a relist), and entries written by work that
    /// finished after its Proxy was forgotten. The UIDs with entries are collected
    /// before `live` is asked, so a Proxy that arrives meanwhile (and records entries)
    /// is not judged on a picture that predates it.
    pub fn forget_proxies_except(&self, live: impl FnOnce() -> HashSet<String>) {
        let known = self.tracked_uids();
        let live = live();
        for uid in known.difference(&live) {
            self.forget_proxy(uid);
        }
    }

    /// Every UID with an entry in any per-Proxy map.
    fn tracked_uids(&self) -> HashSet<String> {
        let mut known: HashSet<String> = self.metrics.tracked_uids().into_iter().collect();
        known.extend(lock(&self.triggers).keys().cloned());
        for backoff in [
            &self.retry_backoff,
            &self.publish_backoff,
            &self.poll_backoff,
            &self.replace_backoff,
        ] {
            known.extend(backoff.keys());
        }
        known.extend(lock(&self.health_failures).keys().cloned());
        known.extend(self.published.uids());
        known.extend(self.own_writes.uids());
        known.extend(self.events.tracked_uids());
        known
    }

    /// Publishes the sizes of the per-Proxy maps as gauges (a leak shows there).
    pub fn report_memory(&self) {
        let _one_at_a_time = lock(&self.reporting);
        let sizes = [
            ("retry_backoff", self.retry_backoff.len()),
            ("publish_backoff", self.publish_backoff.len()),
            ("poll_backoff", self.poll_backoff.len()),
            ("replace_backoff", self.replace_backoff.len()),
            ("health_failures", lock(&self.health_failures).len()),
            ("published", self.published.len()),
            ("own_writes", self.own_writes.len()),
            ("events", self.events.tracked()),
        ];
        for (map, size) in sizes {
            self.metrics.set_tracked(map, size);
        }
    }
}

/// The operator's Pod, from the environment the chart gives it.
fn operator_pod() -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some(std::env::var("POD_NAME").unwrap_or_else(|_| "egressproxy-operator".into())),
        namespace: Some(std::env::var("POD_NAMESPACE").unwrap_or_else(|_| "default".into())),
        ..ObjectReference::default()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
