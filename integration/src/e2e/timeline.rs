//! What a benchmark reads from objects of one kind, followed by a watch, with the moment
//! each change arrived: a benchmark waits on the change it needs and measures between
//! changes, never by polling and sleeping.
//!
//! 1. [`follow`] starts a watch of an `Api` into a reflector store and, at each event,
//!    reads a value from the whole store (the addresses a pool's EndpointSlices list,
//!    each member's readiness); a value that differs from the last one is recorded with
//!    [`Instant::now`].
//! 2. [`Timeline::first_after`] waits for the first recorded change at or after a
//!    moment whose value satisfies a predicate (the first change, not the latest: a
//!    burst of changes between two wake-ups does not hide the moment asked about), and
//!    [`Timeline::now_or_next`] for the current value to satisfy one;
//!    [`Timeline::since`] lists the changes for what a benchmark reports.
//!
//! The times are when this process received each event: what a client watching the
//! apiserver sees, which is what a user's kube-proxy or controller would see too.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::runtime::reflector::store::Writer;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

/// Every change of a value read from a store, with the moment it arrived.
#[derive(Debug, Clone)]
pub struct Timeline<T> {
    history: watch::Receiver<Vec<(Instant, T)>>,
}

/// Follows `api` (module doc, step 1); `read` turns the store's objects into the value
/// to record. The watch runs until the runtime stops.
pub fn follow<K, T>(
    api: Api<K>,
    dyntype: K::DynamicType,
    read: impl Fn(&[Arc<K>]) -> T + Send + 'static,
) -> Timeline<T>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + Hash + Clone + Send + Sync,
    T: PartialEq + Send + Sync + 'static,
{
    let writer = Writer::new(dyntype);
    let reader = writer.as_reader();
    let (record, history) = watch::channel(Vec::new());
    tokio::spawn(async move {
        let mut events = watcher(api, watcher::Config::default())
            .default_backoff()
            .reflect(writer)
            .boxed();
        while events.next().await.is_some() {
            let now = read(&reader.state());
            record.send_if_modified(|changes: &mut Vec<(Instant, T)>| {
                let changed = changes.last().is_none_or(|(_, last)| *last != now);
                if changed {
                    changes.push((Instant::now(), now));
                }
                changed
            });
        }
    });
    Timeline { history }
}

impl<T: Clone> Timeline<T> {
    /// The first change at or after `after` whose value satisfies `done`, waiting up to
    /// `within` for it; `what` names it in the error.
    pub async fn first_after(
        &self,
        what: &str,
        within: Duration,
        after: Instant,
        done: impl Fn(&T) -> bool,
    ) -> anyhow::Result<(Instant, T)> {
        let found = |changes: &[(Instant, T)]| {
            changes
                .iter()
                .find(|(at, value)| *at >= after && done(value))
                .cloned()
        };
        self.wait(what, within, found).await
    }

    /// The current value once it satisfies `done` (at once if it does), with the moment
    /// it arrived, waiting up to `within`.
    pub async fn now_or_next(
        &self,
        what: &str,
        within: Duration,
        done: impl Fn(&T) -> bool,
    ) -> anyhow::Result<(Instant, T)> {
        let found = |changes: &[(Instant, T)]| changes.last().filter(|(_, v)| done(v)).cloned();
        self.wait(what, within, found).await
    }

    /// Every change at or after `after`, oldest first.
    pub fn since(&self, after: Instant) -> Vec<(Instant, T)> {
        self.history
            .borrow()
            .iter()
            .filter(|(at, _)| *at >= after)
            .cloned()
            .collect()
    }

    /// The current value, if any event arrived yet.
    pub fn latest(&self) -> Option<T> {
        self.history.borrow().last().map(|(_, value)| value.clone())
    }

    async fn wait(
        &self,
        what: &str,
        within: Duration,
        found: impl Fn(&[(Instant, T)]) -> Option<(Instant, T)>,
    ) -> anyhow::Result<(Instant, T)> {
        let mut history = self.history.clone();
        let changes = tokio::time::timeout(within, history.wait_for(|c| found(c).is_some()))
            .await
            .map_err(|_| anyhow::anyhow!("timed out after {within:?} waiting for {what}"))?
            .map_err(|_| anyhow::anyhow!("the watch ended while waiting for {what}"))?;
        found(&changes).ok_or_else(|| anyhow::anyhow!("{what}: found, then not"))
    }
}
