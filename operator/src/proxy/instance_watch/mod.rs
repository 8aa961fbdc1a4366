//! Learning from the providers when an instance changes, instead of waiting for the
//! next poll: for every configured provider that offers WatchInstances, one stream of
//! this cluster's instances, and a reconcile at once of the Proxy that owns an
//! instance that changed in a way it cares about.
//!
//! 1. [`run`] keeps one follower ([`follow`]) per configured provider; a reload of the
//!    provider config restarts them all, and each resumes from its last token.
//! 2. Each change is mapped to its Proxy by the instance's tags (namespace, name, and
//!    the UID, which must match the Proxy in the store: a Proxy deleted and created
//!    again under the same name does not own the old one's instance).
//! 3. [`relevance`] decides whether the change is worth a reconcile now; the Proxy's
//!    reconcile then asks GetInstance as always, so a watch only ever makes a
//!    reconcile come sooner, never decides what it does.
//! 4. Polling stays: a provider without the capability, and a watch that is broken,
//!    leave every Proxy to its periodic reconcile (the poll while it provisions).
//!
//! The gauge `egressproxy_provider_watch_up{provider}` says whether each provider's
//! stream is open, and `egressproxy_provider_watch_events_total{provider,type}` counts
//! what the streams sent.

pub mod follow;
pub mod relevance;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use kube::ResourceExt;
use kube::runtime::reflector::{ObjectRef, Store};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use self::follow::{Followed, Seen};
use self::relevance::{Change, worth_reconciling};
use crate::context::Context;
use crate::crd::Proxy;
use crate::proxy::reconcile::tags;

/// Changes waiting for the controller before the followers wait for it.
const BUFFER: usize = 1024;

/// The followers' changes, and the Proxies they reconcile.
#[derive(Debug)]
pub struct InstanceWatch {
    changes: mpsc::Sender<Seen>,
    seen: mpsc::Receiver<Seen>,
}

impl Default for InstanceWatch {
    fn default() -> Self {
        let (changes, seen) = mpsc::channel(BUFFER);
        InstanceWatch { changes, seen }
    }
}

impl InstanceWatch {
    /// Splits into the followers' side ([`run`]) and the Proxies to reconcile, as the
    /// controller's `reconcile_on` takes them.
    pub fn split(
        self,
        proxies: Store<Proxy>,
    ) -> (
        mpsc::Sender<Seen>,
        impl Stream<Item = ObjectRef<Proxy>> + Send + 'static,
    ) {
        let triggers = tokio_stream::wrappers::ReceiverStream::new(self.seen)
            .filter_map(move |seen| futures::future::ready(owner_to_reconcile(&proxies, &seen)));
        (self.changes, triggers)
    }
}

/// Keeps one follower per configured provider until dropped (step 1 of the module
/// docs).
pub async fn run(ctx: Arc<Context>, changes: mpsc::Sender<Seen>) {
    let mut followed: HashMap<String, Arc<Mutex<Followed>>> = HashMap::new();
    let mut reloads = ctx.providers.changes();
    loop {
        reloads.mark_unchanged();
        let mut followers = JoinSet::new();
        for provider in ctx.providers.iter() {
            let name = provider.name().to_owned();
            let state = followed.entry(name.clone()).or_default().clone();
            followers.spawn(follow::follow(ctx.clone(), name, state, changes.clone()));
        }
        let names: Vec<String> = ctx.providers.iter().map(|p| p.name().to_owned()).collect();
        followed.retain(|name, _| names.contains(name));
        for name in ctx.metrics.watched_providers() {
            if !names.contains(&name) {
                ctx.metrics.forget_provider_watch(&name);
            }
        }
        if reloads.changed().await.is_err() {
            // The providers went with the context; keep the followers until the
            // controller, which owns this future, stops.
            std::future::pending::<()>().await;
        }
        // Dropping the set stops every follower; the next ones resume.
        drop(followers);
    }
}

/// The Proxy that owns the instance `seen` names, when the change is worth reconciling
/// it now.
fn owner_to_reconcile(proxies: &Store<Proxy>, seen: &Seen) -> Option<ObjectRef<Proxy>> {
    let (instance, change) = match seen {
        Seen::Updated(instance) => (instance, Change::Updated(instance)),
        Seen::Gone(instance) => (instance, Change::Gone(&instance.id)),
    };
    let tag = |key: &str| instance.tags.get(key).map(String::as_str);
    let reference = ObjectRef::<Proxy>::new(tag(tags::NAME)?).within(tag(tags::NAMESPACE)?);
    let proxy = proxies.get(&reference)?;
    if proxy.uid().as_deref() != tag(tags::UID) {
        return None;
    }
    worth_reconciling(&proxy, change).then_some(reference)
}
