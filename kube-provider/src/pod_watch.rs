//! WatchInstances from a watch of the provider's pods: the apiserver tells every change,
//! and the contract crate's [`WatchHub`] serves the streams (snapshot, SYNCED, resume
//! tokens, slow readers).
//!
//! 1. A task started with the provider watches the pods carrying the ownership label
//!    (kube's `watcher`, which relists after an expired watch and backs off on errors)
//!    and tells the hub each pod as Get would answer it, or that it is gone.
//! 2. The provider also tells the hub what its own Create and Delete wrote, before it
//!    answers, so a stream opened after a Create returned holds that instance even when
//!    the watch has not delivered it yet (the hub publishes only what differs, so the
//!    watch's copy of the same change adds nothing).
//! 3. After each (re)list, an instance the hub knows that the list does not hold is read
//!    once more and told gone only if the apiserver has no such pod: a list taken just
//!    before a Create must not report its instance DELETED.
//! 4. A stream opens only after the first list is complete: a snapshot taken before
//!    it would claim that instances do not exist. While no list has succeeded and the
//!    last attempt failed (the apiserver is down, RBAC lacks `watch`), WatchInstances
//!    answers UNAVAILABLE with that failure instead of waiting for its deadline.
//!
//! The hub lives in memory: a stream resumed with a token from before a restart starts
//! with RESTARTED, as the contract allows. Pods whose record cannot be read are never
//! published (as List leaves them out).

use std::collections::BTreeSet;

use egressproxy_provider::watch::{DEFAULT_HISTORY, WatchHub, WatchStream};
use egressproxy_provider::{ProviderError, pb};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use tokio::sync::watch as signal;

use crate::instance;
use crate::record::{MANAGED_BY, MANAGED_BY_LABEL};

/// The hub, the task that feeds it, and whether its first list is complete.
#[derive(Debug)]
pub struct PodWatch {
    hub: WatchHub,
    listing: signal::Receiver<Listing>,
    task: tokio::task::JoinHandle<()>,
}

/// How far the watch has come.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Listing {
    /// The first list has not ended yet.
    Waiting,
    /// No list has succeeded yet, and the last attempt failed so.
    Failing(String),
    /// A list has completed: the hub knows every instance.
    Listed,
}

impl Drop for PodWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PodWatch {
    /// Starts watching `pods` (the provider's namespace). Needs a Tokio runtime.
    pub fn start(pods: Api<Pod>) -> Self {
        let hub = WatchHub::new(DEFAULT_HISTORY);
        let (listing_tx, listing) = signal::channel(Listing::Waiting);
        let feeder = hub.clone();
        let task = tokio::spawn(async move {
            let config =
                watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}"));
            let events = watcher::watcher(pods.clone(), config).default_backoff();
            let mut events = std::pin::pin!(events);
            let mut listing = BTreeSet::new();
            while let Some(event) = events.next().await {
                match event {
                    Ok(Event::Init) => listing.clear(),
                    Ok(Event::InitApply(pod)) => {
                        listing.extend(pod.metadata.name.clone());
                        publish(&feeder, &pod);
                    }
                    Ok(Event::InitDone) => {
                        let known = feeder.known();
                        let unlisted = known.iter().filter(|i| !listing.contains(&i.id));
                        for instance in unlisted {
                            confirm_gone(&feeder, &pods, &instance.id).await;
                        }
                        listing_tx.send_replace(Listing::Listed);
                    }
                    Ok(Event::Apply(pod)) => publish(&feeder, &pod),
                    Ok(Event::Delete(pod)) => {
                        if let Some(name) = &pod.metadata.name {
                            feeder.deleted(name);
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "the watch of proxy pods failed; it retries");
                        listing_tx.send_if_modified(|listing| {
                            let failing = *listing != Listing::Listed;
                            if failing {
                                *listing = Listing::Failing(error.to_string());
                            }
                            failing
                        });
                    }
                }
            }
        });
        PodWatch { hub, listing, task }
    }

    /// Tells the streams about `pod`, as the provider's own write left it.
    pub fn wrote(&self, pod: &Pod) {
        publish(&self.hub, pod);
    }

    /// Tells the streams that instance `id` is gone.
    pub fn gone(&self, id: &str) {
        self.hub.deleted(id);
    }

    /// WatchInstances' stream, once the first list is complete.
    pub async fn stream(
        &self,
        request: &pb::WatchInstancesRequest,
    ) -> Result<WatchStream, ProviderError> {
        let mut listing = self.listing.clone();
        let now = listing
            .wait_for(|listing| *listing != Listing::Waiting)
            .await
            .map_err(|_| ProviderError::transient("the watch of proxy pods has stopped"))?
            .clone();
        match now {
            Listing::Failing(error) => Err(ProviderError::transient(format!(
                "cannot watch the proxy pods yet (it retries): {error}"
            ))
            .with_reason("KUBE_UNAVAILABLE")),
            _ => self.hub.watch(request),
        }
    }
}

/// Tells the hub instance `id` is gone if the apiserver has no such pod, else what it is.
async fn confirm_gone(hub: &WatchHub, pods: &Api<Pod>, id: &str) {
    match pods.get_opt(id).await {
        Ok(None) => hub.deleted(id),
        Ok(Some(pod)) => publish(hub, &pod),
        Err(error) => {
            tracing::warn!(%error, instance.id = id, "keeping an unlisted instance that cannot be read")
        }
    }
}

fn publish(hub: &WatchHub, pod: &Pod) {
    match instance::instance(pod) {
        Ok(instance) => hub.updated(instance),
        Err(error) => {
            tracing::warn!(%error, "not publishing a pod that is not a readable instance")
        }
    }
}
