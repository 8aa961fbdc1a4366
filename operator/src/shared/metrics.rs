//! Prometheus metrics of the operator, served on `/metrics`:
//!
//! - `egressproxy_reconciles_total`: reconciles run;
//! - `egressproxy_reconcile_errors_total{class}`: failed reconcile steps by class
//!   (transient, quota, permanent);
//! - `egressproxy_provider_call_duration_seconds{provider,method,code}`: provider calls;
//! - `egressproxy_proxies{phase}`: Proxies by phase;
//! - `egressproxy_status_writes_total`: status patches (stays flat when nothing changes);
//! - `egressproxy_service_writes_total`: applies, patches and deletes of Proxies'
//!   Services and EndpointSlices (flat when nothing changes, like status writes);
//! - `egressproxy_is_leader`: 1 on the replica that acts;
//! - `egressproxy_provider_config_reloads_total{result}`: provider config file changes,
//!   `applied` or `rejected` (invalid: the previous config stays);
//! - `egressproxy_namespace_watch_up{namespace}`: 1 while the watch of Proxies in the
//!   namespace works (`""` for a cluster-wide watch), 0 while it fails;
//! - `egressproxy_provider_watch_up{provider}`: 1 while the operator's stream of the
//!   provider's instances (WatchInstances) is open, 0 while it is broken (its Proxies
//!   are polled meanwhile); absent for a provider that does not offer it;
//! - `egressproxy_provider_watch_events_total{provider,type}`: events those streams
//!   sent, by type (`UPDATED`, `DELETED`, `SYNCED`, `RESTARTED`);
//! - `egressproxy_tracked_proxies{map}`: Proxies with an entry in each per-Proxy map
//!   kept in memory; it falls back to the number of live Proxies after deletes
//!   (a leak shows here);
//! - `egressproxy_allocator_trims_total`: times the operator handed freed memory back
//!   to the system after Proxies were forgotten ([`super::memory`]);
//!   `egressproxy_allocator_trim_pending`: 1 from a Proxy forgotten until the trim that
//!   follows.
//!
//! The phase gauge is kept incrementally: a phase change moves one Proxy from one
//! label to another, in constant time, and a deleted Proxy leaves every label.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::crd::Phase;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabels {
    provider: String,
    method: String,
    code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NamespaceLabels {
    namespace: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderLabels {
    provider: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WatchEventLabels {
    provider: String,
    r#type: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MapLabels {
    map: String,
}

fn phase_labels(phase: Phase) -> PhaseLabels {
    PhaseLabels {
        phase: format!("{phase:?}"),
    }
}

fn call_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// Every metric, and the registry that encodes them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    reconciles: Counter,
    errors: Family<ClassLabels, Counter>,
    provider_calls: Family<CallLabels, Histogram, fn() -> Histogram>,
    proxies: Family<PhaseLabels, Gauge>,
    status_writes: Counter,
    service_writes: Counter,
    allocator_trims: Counter,
    allocator_trim_pending: Gauge,
    is_leader: Gauge,
    config_reloads: Family<ReloadLabels, Counter>,
    tracked: Family<MapLabels, Gauge>,
    namespace_watch_up: Family<NamespaceLabels, Gauge>,
    provider_watch_up: Family<ProviderLabels, Gauge>,
    provider_watch_events: Family<WatchEventLabels, Counter>,
    phases: Mutex<HashMap<String, Phase>>,
    /// The providers with a `provider_watch_up` label.
    watched_providers: Mutex<std::collections::BTreeSet<String>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("egressproxy");
        let metrics = Metrics {
            reconciles: Counter::default(),
            errors: Family::default(),
            provider_calls: Family::new_with_constructor(call_histogram),
            proxies: Family::default(),
            status_writes: Counter::default(),
            service_writes: Counter::default(),
            allocator_trims: Counter::default(),
            allocator_trim_pending: Gauge::default(),
            is_leader: Gauge::default(),
            config_reloads: Family::default(),
            tracked: Family::default(),
            namespace_watch_up: Family::default(),
            provider_watch_up: Family::default(),
            provider_watch_events: Family::default(),
            phases: Mutex::default(),
            watched_providers: Mutex::default(),
            registry: Registry::default(),
        };
        registry.register("reconciles", "Reconciles run", metrics.reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Failed reconcile steps by class",
            metrics.errors.clone(),
        );
        registry.register(
            "provider_call_duration_seconds",
            "Provider call latency by provider, method and gRPC code",
            metrics.provider_calls.clone(),
        );
        registry.register("proxies", "Proxies by phase", metrics.proxies.clone());
        registry.register(
            "status_writes",
            "Status patches written",
            metrics.status_writes.clone(),
        );
        registry.register(
            "service_writes",
            "Writes and deletes of Proxies' Services and EndpointSlices",
            metrics.service_writes.clone(),
        );
        registry.register(
            "allocator_trims",
            "Times freed memory was handed back to the system after Proxies were forgotten",
            metrics.allocator_trims.clone(),
        );
        registry.register(
            "allocator_trim_pending",
            "1 from a Proxy forgotten until the allocator trim that follows",
            metrics.allocator_trim_pending.clone(),
        );
        registry.register(
            "is_leader",
            "1 when this replica holds the leader lease",
            metrics.is_leader.clone(),
        );
        registry.register(
            "provider_config_reloads",
            "Provider config file changes, applied or rejected",
            metrics.config_reloads.clone(),
        );
        registry.register(
            "namespace_watch_up",
            "1 while the watch of Proxies in the namespace works, 0 while it fails",
            metrics.namespace_watch_up.clone(),
        );
        registry.register(
            "provider_watch_up",
            "1 while the stream of the provider's instances is open, 0 while it is broken",
            metrics.provider_watch_up.clone(),
        );
        registry.register(
            "provider_watch_events",
            "Events of the streams of providers' instances, by type",
            metrics.provider_watch_events.clone(),
        );
        registry.register(
            "tracked_proxies",
            "Proxies with an entry in each per-Proxy map kept in memory",
            metrics.tracked.clone(),
        );
        Metrics {
            registry,
            ..metrics
        }
    }
}

impl Metrics {
    /// Counts one reconcile.
    pub fn reconciled(&self) {
        self.reconciles.inc();
    }

    /// Counts one failed reconcile step of `class`.
    pub fn failed(&self, class: &str) {
        self.errors
            .get_or_create(&ClassLabels {
                class: class.to_owned(),
            })
            .inc();
    }

    /// Records one provider call.
    pub fn provider_call(&self, provider: &str, method: &str, code: tonic::Code, took: Duration) {
        let labels = CallLabels {
            provider: provider.to_owned(),
            method: method.to_owned(),
            code: format!("{code:?}"),
        };
        self.provider_calls
            .get_or_create(&labels)
            .observe(took.as_secs_f64());
    }

    /// Counts one status write.
    pub fn status_written(&self) {
        self.status_writes.inc();
    }

    /// Counts `writes` writes or deletes of Services and EndpointSlices.
    pub fn service_writes(&self, writes: u32) {
        self.service_writes.inc_by(u64::from(writes));
    }

    /// Sets whether memory freed by forgotten Proxies awaits a trim.
    pub fn set_allocator_trim_pending(&self, pending: bool) {
        self.allocator_trim_pending.set(i64::from(pending));
    }

    /// Counts one trim of the allocator.
    pub fn allocator_trimmed(&self) {
        self.allocator_trims.inc();
    }

    /// Sets whether this replica leads.
    pub fn set_leader(&self, leader: bool) {
        self.is_leader.set(i64::from(leader));
    }

    /// Counts one change of the provider config file, `applied` or rejected.
    pub fn provider_config_reloaded(&self, applied: bool) {
        let result = if applied { "applied" } else { "rejected" };
        self.config_reloads
            .get_or_create(&ReloadLabels {
                result: result.to_owned(),
            })
            .inc();
    }

    /// Records a Proxy's phase (`None` once it is gone), moving it between labels.
    pub fn set_phase(&self, uid: &str, phase: Option<Phase>) {
        let mut phases = self.phases.lock().unwrap_or_else(|p| p.into_inner());
        let previous = match phase {
            Some(phase) => phases.insert(uid.to_owned(), phase),
            None => {
                let removed = phases.remove(uid);
                super::tables::shrink_when_sparse(&mut phases);
                removed
            }
        };
        if previous == phase {
            return;
        }
        // A label whose count falls to zero is removed, as if never set: the phases
        // lock serialises every change, so nothing increments it meanwhile.
        if let Some(previous) = previous {
            let labels = phase_labels(previous);
            if self.proxies.get_or_create(&labels).dec() <= 1 {
                self.proxies.remove(&labels);
            }
        }
        if let Some(phase) = phase {
            self.proxies.get_or_create(&phase_labels(phase)).inc();
        }
        self.tracked
            .get_or_create(&MapLabels {
                map: "phase".into(),
            })
            .set(i64::try_from(phases.len()).unwrap_or(i64::MAX));
    }

    /// The UIDs of the Proxies with a recorded phase.
    pub fn tracked_uids(&self) -> Vec<String> {
        let phases = self.phases.lock().unwrap_or_else(|p| p.into_inner());
        phases.keys().cloned().collect()
    }

    /// Records how many Proxies have an entry in the per-Proxy map `map`.
    pub fn set_tracked(&self, map: &str, size: usize) {
        self.tracked
            .get_or_create(&MapLabels {
                map: map.to_owned(),
            })
            .set(i64::try_from(size).unwrap_or(i64::MAX));
    }

    /// Records whether the watch of Proxies in `namespace` works.
    pub fn set_namespace_watch_up(&self, namespace: &str, up: bool) {
        self.namespace_watch_up
            .get_or_create(&NamespaceLabels {
                namespace: namespace.to_owned(),
            })
            .set(i64::from(up));
    }

    /// Records whether the stream of `provider`'s instances is open.
    pub fn set_provider_watch_up(&self, provider: &str, up: bool) {
        self.watched_providers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(provider.to_owned());
        self.provider_watch_up
            .get_or_create(&ProviderLabels {
                provider: provider.to_owned(),
            })
            .set(i64::from(up));
    }

    /// Drops `provider`'s watch gauge: it offers no watch, or is no longer configured.
    pub fn forget_provider_watch(&self, provider: &str) {
        self.watched_providers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(provider);
        self.provider_watch_up.remove(&ProviderLabels {
            provider: provider.to_owned(),
        });
    }

    /// The providers with a watch gauge.
    pub fn watched_providers(&self) -> Vec<String> {
        let watched = self
            .watched_providers
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        watched.iter().cloned().collect()
    }

    /// Counts one event of `provider`'s stream.
    pub fn provider_watch_event(
        &self,
        provider: &str,
        type_: egressproxy_provider::pb::WatchEventType,
    ) {
        let name = type_.as_str_name().trim_start_matches("WATCH_EVENT_TYPE_");
        self.provider_watch_events
            .get_or_create(&WatchEventLabels {
                provider: provider.to_owned(),
                r#type: name.to_owned(),
            })
            .inc();
    }

    /// The metrics in the Prometheus text format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deleted_proxy_leaves_every_phase_and_the_map() {
        let metrics = Metrics::default();
        for uid in ["a", "b"] {
            metrics.set_phase(uid, Some(Phase::Provisioning));
            metrics.set_phase(uid, Some(Phase::Ready));
            metrics.set_phase(uid, Some(Phase::Deleting));
            metrics.set_phase(uid, None);
        }
        metrics.set_phase("c", Some(Phase::Ready));
        let text = metrics.encode();
        for phase in ["Provisioning", "Deleting"] {
            assert!(!text.contains(&format!("phase=\"{phase}\"")), "{text}");
        }
        assert!(
            text.contains("egressproxy_proxies{phase=\"Ready\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("egressproxy_tracked_proxies{map=\"phase\"} 1"),
            "{text}"
        );
        assert_eq!(metrics.tracked_uids(), ["c"]);
    }

    #[test]
    fn phases_are_counted_and_forgotten() {
        let metrics = Metrics::default();
        metrics.set_phase("a", Some(Phase::Ready));
        metrics.set_phase("b", Some(Phase::Ready));
        metrics.set_phase("c", Some(Phase::Provisioning));
        metrics.set_phase("c", None);
        metrics.provider_call(
            "kvm",
            "CreateInstance",
            tonic::Code::Ok,
            Duration::from_millis(3),
        );
        let text = metrics.encode();
        assert!(
            text.contains("egressproxy_proxies{phase=\"Ready\"} 2"),
            "{text}"
        );
        assert!(!text.contains("phase=\"Provisioning\""), "{text}");
        assert!(text.contains("egressproxy_provider_call_duration_seconds_count{provider=\"kvm\",method=\"CreateInstance\",code=\"Ok\"} 1"), "{text}");
    }
}
