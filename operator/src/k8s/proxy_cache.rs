//! The operator's one cache of Proxies: the reflector store the controller reconciles
//! from, which garbage collection and the memory sweep read too (none of them lists
//! Proxies from the API), and what is known of the watches that feed it.
//!
//! The cache keeps only what the operator reads: the watch drops the rest before an
//! object is stored ([`crate::k8s::watch_scope::trim`]).

use std::sync::Arc;

use kube::runtime::reflector::{self, Store};

use crate::crd::Proxy;
use crate::k8s::watch_health::{ALL_NAMESPACES, WatchHealth};
use crate::k8s::watch_scope::WatchScope;

/// The Proxies in scope as the watch last saw them. Cheap to clone; clones share it.
#[derive(Clone)]
pub struct ProxyCache {
    scope: WatchScope,
    store: Store<Proxy>,
    health: Arc<WatchHealth>,
}

impl std::fmt::Debug for ProxyCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyCache")
            .field("scope", &self.scope)
            .field("proxies", &self.store.len())
            .finish_non_exhaustive()
    }
}

impl ProxyCache {
    /// An empty cache of the Proxies in `scope`, and the writer that fills it (see
    /// [`WatchScope::watch`] for the stream to feed it with).
    pub fn new(scope: WatchScope) -> (ProxyCache, reflector::store::Writer<Proxy>) {
        let (store, writer) = reflector::store();
        let health = Arc::new(WatchHealth::new(scope.watch_keys()));
        (
            ProxyCache {
                scope,
                store,
                health,
            },
            writer,
        )
    }

    /// The namespaces it covers.
    pub fn scope(&self) -> &WatchScope {
        &self.scope
    }

    /// The reflector's store.
    pub fn store(&self) -> &Store<Proxy> {
        &self.store
    }

    /// The state of the watches that feed it.
    pub fn health(&self) -> &Arc<WatchHealth> {
        &self.health
    }

    /// Whether the Proxies of `namespace` have been listed, so that the cache holds
    /// every one of them (as of its watch).
    pub fn listed(&self, namespace: &str) -> bool {
        match &self.scope {
            WatchScope::AllNamespaces => self.health.listed(ALL_NAMESPACES),
            WatchScope::Namespaces(_) => self.health.listed(namespace),
        }
    }

    /// Waits until every namespace has been listed (tests and tools; the operator
    /// itself never waits for all).
    pub async fn wait_until_listed(&self) {
        let mut changes = self.health.changes();
        loop {
            let snapshot = self.health.snapshot();
            if snapshot.values().all(|watch| watch.listed) {
                return;
            }
            if changes.changed().await.is_err() {
                return;
            }
        }
    }
}
