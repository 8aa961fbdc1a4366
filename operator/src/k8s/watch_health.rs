//! What is known of each watch the operator runs on Proxies: whether it has listed its
//! namespace (so its Proxies are in the store), and whether it is failing and why.
//!
//! Garbage collection asks it before judging a namespace's instances: a namespace not
//! listed yet has no Proxies in the store, and every instance of it would look orphaned.
//! The controller reports a failing watch as a Warning Event about the operator and as
//! the `egressproxy_namespace_watch_up` gauge.

use std::collections::BTreeMap;
use std::sync::Mutex;

use kube::runtime::watcher;
use tokio::sync::watch;

/// The key of the watch of every namespace (an operator without `--namespace`).
pub const ALL_NAMESPACES: &str = "";

/// One watch's state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NamespaceWatch {
    /// Whether it has listed its namespace at least once.
    pub listed: bool,
    /// Its last error, until it lists or receives an event again.
    pub failing: Option<String>,
}

/// The state of every watch, by namespace ([`ALL_NAMESPACES`] for a cluster-wide one).
#[derive(Debug)]
pub struct WatchHealth {
    watches: Mutex<BTreeMap<String, NamespaceWatch>>,
    /// Bumped on every change of a watch's state.
    changes: watch::Sender<u64>,
}

impl WatchHealth {
    /// Nothing listed yet, for the watches `keys` names: one per namespace, or
    /// [`ALL_NAMESPACES`] for a watch of all.
    pub fn new(keys: impl IntoIterator<Item = String>) -> Self {
        WatchHealth {
            watches: Mutex::new(
                keys.into_iter()
                    .map(|key| (key, NamespaceWatch::default()))
                    .collect(),
            ),
            changes: watch::Sender::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, NamespaceWatch>> {
        self.watches.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records what the watch `key` produced.
    pub fn saw<K>(&self, key: &str, event: &Result<watcher::Event<K>, watcher::Error>) {
        let mut watches = self.lock();
        let Some(state) = watches.get_mut(key) else {
            return;
        };
        let before = state.clone();
        match event {
            Ok(watcher::Event::InitDone) => {
                state.listed = true;
                state.failing = None;
            }
            Ok(_) => state.failing = None,
            Err(error) => state.failing = Some(error.to_string()),
        }
        if *state != before {
            drop(watches);
            self.changes.send_modify(|n| *n += 1);
        }
    }

    /// Whether the watch `key` has listed its namespace.
    pub fn listed(&self, key: &str) -> bool {
        self.lock().get(key).is_some_and(|state| state.listed)
    }

    /// Every watch's state.
    pub fn snapshot(&self) -> BTreeMap<String, NamespaceWatch> {
        self.lock().clone()
    }

    /// Ticks whenever a watch's state changes.
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ConfigMap;

    #[test]
    fn a_namespace_is_listed_at_its_first_init_done_and_failing_until_it_recovers() {
        let health = WatchHealth::new(["a".to_owned(), "b".to_owned()]);
        let mut changes = health.changes();
        let error: Result<watcher::Event<ConfigMap>, _> = Err(watcher::Error::NoResourceVersion);
        health.saw("b", &error);
        assert!(changes.has_changed().unwrap());
        changes.mark_unchanged();
        health.saw("b", &error);
        assert!(
            !changes.has_changed().unwrap(),
            "the same state is no change"
        );
        health.saw::<ConfigMap>("a", &Ok(watcher::Event::InitDone));
        assert!(health.listed("a"));
        assert!(!health.listed("b"));
        assert!(
            !health.listed("c"),
            "a namespace outside the scope is never listed"
        );
        let snapshot = health.snapshot();
        assert!(snapshot["b"].failing.is_some());
        health.saw::<ConfigMap>("b", &Ok(watcher::Event::Init));
        assert_eq!(health.snapshot()["b"], NamespaceWatch::default());
    }
}
