//! Events about Proxies, as `kubectl describe proxy` shows them.
//!
//! 1. An Event is keyed by its Proxy, type, reason **and note**. Repeating the same
//!    key within [`SERIES_WINDOW`] bumps that Event's series (`x4 over 85s`); a new
//!    note is a new Event. (kube-runtime's `Recorder` keys by reason alone and keeps the
//!    first note, so "created instance A" would still be shown after B and C replaced it.)
//! 2. The cache that makes series is per Proxy and small: at most
//!    [`MAX_CACHED_PER_PROXY`] entries, expired ones pruned on each publish, and all of
//!    a Proxy's entries dropped by [`EventPublisher::forget`] when the Proxy goes. So
//!    memory follows the live Proxies, not every Proxy ever seen.
//! 3. A failure to publish is logged, never fatal to a reconcile. An Event whose
//!    creation failed is not remembered, so the next identical publish creates it; a
//!    repeat whose Event is gone (expired, deleted) creates a new Event.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Api, Patch, PatchParams, PostParams};

use crate::shared::tables::shrink_when_sparse;

/// Repeats within this window join the earlier Event's series.
pub const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);
/// Distinct recent Events remembered per Proxy.
pub const MAX_CACHED_PER_PROXY: usize = 16;

/// The controller's name in every Event.
const CONTROLLER: &str = "egressproxy-operator";

/// `Normal` or `Warning`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// Something expected happened.
    Normal,
    /// Something a person may need to look at.
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

#[derive(Debug)]
struct Sent {
    type_: EventType,
    reason: String,
    note: String,
    name: String,
    count: i32,
    last: jiff::Timestamp,
}

enum Remembered {
    Repeat(String, i32),
    New(String),
}

/// The name of a new Event about `regarding`, unique by the time it is made.
fn event_name(regarding: &ObjectReference, now: jiff::Timestamp) -> String {
    let object = regarding.name.as_deref().unwrap_or(CONTROLLER);
    format!("{object}.{:x}", now.as_nanosecond())
}

/// Publishes Events, folding exact repeats into series.
pub struct EventPublisher {
    client: kube::Client,
    instance: String,
    recent: Mutex<HashMap<String, Vec<Sent>>>,
}

impl std::fmt::Debug for EventPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventPublisher")
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl EventPublisher {
    /// A publisher reporting as `instance` (the pod name, else the controller name).
    pub fn new(client: kube::Client, instance: Option<String>) -> Self {
        EventPublisher {
            client,
            instance: instance.unwrap_or_else(|| CONTROLLER.to_owned()),
            recent: Mutex::default(),
        }
    }

    /// Publishes an Event about the object `regarding` (whose UID keys the cache).
    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        note: &str,
    ) {
        let namespace = regarding.namespace.clone().unwrap_or_default();
        let now = jiff::Timestamp::now();
        let events: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        let uid = regarding.uid.clone().unwrap_or_default();
        let result = match self.remember(regarding, type_, reason, note, now) {
            Remembered::Repeat(name, count) => {
                let patch = serde_json::json!({"series": EventSeries {
                    count,
                    last_observed_time: MicroTime(now),
                }});
                match events
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    // The Event is gone (expired, or deleted): the repeat starts anew.
                    Err(kube::Error::Api(status)) if status.code == 404 => {
                        let name = self.restart(&uid, &name, regarding, now);
                        let event = self.event(regarding, type_, reason, note, name, now);
                        self.create(&events, &uid, event).await
                    }
                    other => other.map(drop),
                }
            }
            Remembered::New(name) => {
                let event = self.event(regarding, type_, reason, note, name, now);
                self.create(&events, &uid, event).await
            }
        };
        if let Err(error) = result {
            tracing::warn!(object = ?regarding.name, %error, reason, "cannot publish event");
        }
    }

    /// Creates `event`; when that fails, forgets it, so that the next identical
    /// publish creates it instead of patching an Event that does not exist.
    async fn create(&self, events: &Api<Event>, uid: &str, event: Event) -> kube::Result<()> {
        let name = event.metadata.name.clone().unwrap_or_default();
        let result = events.create(&PostParams::default(), &event).await;
        if result.is_err() {
            let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(sent) = recent.get_mut(uid) {
                sent.retain(|s| s.name != name);
                if sent.is_empty() {
                    recent.remove(uid);
                    shrink_when_sparse(&mut recent);
                }
            }
        }
        result.map(drop)
    }

    /// A new Event, named `name`.
    fn event(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        note: &str,
        name: String,
        now: jiff::Timestamp,
    ) -> Event {
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: regarding.namespace.clone(),
                ..ObjectMeta::default()
            },
            action: Some("Reconcile".into()),
            reason: Some(reason.to_owned()),
            note: Some(note.to_owned()),
            type_: Some(type_.as_str().to_owned()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            reporting_controller: Some(CONTROLLER.to_owned()),
            reporting_instance: Some(self.instance.clone()),
            ..Event::default()
        }
    }

    /// Starts the series of the remembered Event `name` over under a new name: its
    /// Event no longer exists. Returns the new name.
    fn restart(
        &self,
        uid: &str,
        name: &str,
        regarding: &ObjectReference,
        now: jiff::Timestamp,
    ) -> String {
        let fresh = event_name(regarding, now);
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(sent) = recent
            .get_mut(uid)
            .and_then(|sent| sent.iter_mut().find(|s| s.name == name))
        {
            sent.name = fresh.clone();
            sent.count = 1;
        }
        fresh
    }

    /// Records a publish: a repeat's earlier Event name and new count, or the name
    /// of a new Event.
    fn remember(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &str,
        note: &str,
        now: jiff::Timestamp,
    ) -> Remembered {
        let uid = regarding.uid.clone().unwrap_or_default();
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let sent = recent.entry(uid).or_default();
        let window = jiff::SignedDuration::try_from(SERIES_WINDOW).unwrap_or_default();
        sent.retain(|s| now.duration_since(s.last) < window);
        if let Some(earlier) = sent
            .iter_mut()
            .find(|s| s.type_ == type_ && s.reason == reason && s.note == note)
        {
            earlier.count = earlier.count.saturating_add(1);
            earlier.last = now;
            return Remembered::Repeat(earlier.name.clone(), earlier.count);
        }
        if sent.len() >= MAX_CACHED_PER_PROXY {
            sent.remove(0);
        }
        let name = event_name(regarding, now);
        sent.push(Sent {
            type_,
            reason: reason.to_owned(),
            note: note.to_owned(),
            name: name.clone(),
            count: 1,
            last: now,
        });
        Remembered::New(name)
    }

    /// Drops every cached Event of the object with `uid`.
    pub fn forget(&self, uid: &str) {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        recent.remove(uid);
        shrink_when_sparse(&mut recent);
    }

    /// The UIDs of the objects with cached Events.
    pub fn tracked_uids(&self) -> Vec<String> {
        let recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        recent.keys().cloned().collect()
    }

    /// Objects with cached Events (for the memory gauges).
    pub fn tracked(&self) -> usize {
        self.recent.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}
