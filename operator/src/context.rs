//! What every reconcile shares: clients, configured providers, backoff state.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Resource, ResourceExt};

use crate::backoff::Backoff;
use crate::crd::Proxy;
use crate::metrics::Metrics;
use crate::providers::Providers;

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
    /// Poll interval while an instance provisions.
    pub poll_backoff: Backoff,
    /// Backoff between replacements of a stopped or vanished instance.
    pub replace_backoff: Backoff,
    /// Prometheus metrics.
    pub metrics: Arc<Metrics>,
    /// Consecutive health check failures per Proxy UID.
    pub health_failures: Mutex<HashMap<String, u32>>,
    recorder: Recorder,
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
        let reporter = Reporter {
            controller: "egressproxy-operator".into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        Context {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            providers,
            cluster_name,
            retry_backoff: Backoff::new(Duration::from_secs(1), Duration::from_secs(300)),
            poll_backoff: Backoff::new(Duration::from_millis(500), Duration::from_secs(10)),
            replace_backoff: Backoff::new(Duration::from_secs(2), Duration::from_secs(300)),
            health_failures: Mutex::default(),
            metrics,
        }
    }

    /// Publishes an Event about `proxy`; a failure to publish is logged, not fatal.
    pub async fn publish(&self, proxy: &Proxy, type_: EventType, reason: &str, note: String) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &proxy.object_ref(&())).await {
            tracing::warn!(proxy = %proxy.name_any(), %error, reason, "cannot publish event");
        }
    }
}
