//! Watching the Services and EndpointSlices the operator keeps for Proxies
//! ([`crate::endpoints::service`]), so that a hand edit or a deletion is repaired at once,
//! not at the Proxy's next poll.
//!
//! 1. One watch per watched namespace (or one for all) of each kind, selected by the
//!    label the operator sets on its own objects: other Services are never listed.
//! 2. A change syncs the owning Proxy's objects again (its controller reference) only
//!    when the object no longer is what the cached Proxy wants, or is gone while
//!    wanted: the operator's own writes, which match, start nothing.
//!    Such a change is reported to [`crate::k8s::published`] first: a changed slice
//!    that the last sync wrote is written again whole by the next sync
//!    ([`rewrite_slice`](crate::k8s::published::Published::rewrite_slice); in a burst
//!    of new Proxies, their first empty slices arrive after they turned Ready, and
//!    reading everything again for each would double the sync's requests); anything
//!    else makes that sync read the objects again instead of trusting what it last
//!    wrote.
//! 3. A failing watch (no permission in a namespace) is logged with its namespace and
//!    retried with backoff; drift there is then repaired at the Proxy's next poll.

use std::sync::Arc;

use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;

use crate::context::Context;
use crate::crd::Proxy;
use crate::endpoints::service::{
    MANAGED_BY, MANAGED_BY_LABEL, SLICE_MANAGED_BY, SLICE_MANAGED_BY_LABEL, desired,
    service_matches, slice_matches,
};
use crate::k8s::watch_scope::WatchScope;

/// The Proxies whose Service or EndpointSlice drifted from what they want.
pub fn triggers(
    ctx: Arc<Context>,
    scope: &WatchScope,
    proxies: Store<Proxy>,
) -> impl Stream<Item = ObjectRef<Proxy>> + Send + 'static {
    let services = watch::<Service>(
        ctx.clone(),
        scope,
        &format!("{MANAGED_BY_LABEL}={MANAGED_BY}"),
        proxies.clone(),
        false,
        |proxy, service, gone| {
            let wanted = desired(proxy, &proxy.status.clone().unwrap_or_default());
            match wanted {
                Some(wanted) => gone || !service_matches(&wanted.service, service),
                None => !gone,
            }
        },
    );
    let slices = watch::<EndpointSlice>(
        ctx,
        scope,
        &format!("{SLICE_MANAGED_BY_LABEL}={SLICE_MANAGED_BY}"),
        proxies,
        true,
        |proxy, slice, gone| {
            let wanted = desired(proxy, &proxy.status.clone().unwrap_or_default());
            match wanted {
                Some(wanted) => match wanted
                    .slices
                    .iter()
                    .find(|w| w.name_any() == slice.name_any())
                {
                    Some(wanted) => gone || !slice_matches(wanted, slice),
                    None => !gone,
                },
                // A slice of no Service at all.
                None => !gone,
            }
        },
    );
    futures::stream::select(services, slices)
}

/// The watches of kind `K` selected by `labels` in `scope`, mapped to the owning
/// Proxies for which `drifted(proxy, object, deleted)` holds.
fn watch<K>(
    ctx: Arc<Context>,
    scope: &WatchScope,
    labels: &str,
    proxies: Store<Proxy>,
    rewritable: bool,
    drifted: fn(&Proxy, &K, bool) -> bool,
) -> BoxStream<'static, ObjectRef<Proxy>>
where
    K: Resource<DynamicType = (), Scope = kube::core::NamespaceResourceScope>
        + Clone
        + DeserializeOwned
        + std::fmt::Debug
        + Send
        + 'static,
{
    let client = &ctx.client;
    let apis: Vec<Api<K>> = match scope {
        WatchScope::AllNamespaces => vec![Api::all(client.clone())],
        WatchScope::Namespaces(namespaces) => namespaces
            .iter()
            .map(|namespace| Api::namespaced(client.clone(), namespace))
            .collect(),
    };
    let config = watcher::Config::default().labels(labels);
    let kind = K::kind(&()).into_owned();
    let watches: Vec<BoxStream<'static, _>> = apis
        .into_iter()
        .map(|api| {
            let namespace = api.namespace().unwrap_or("(all)").to_owned();
            let kind = kind.clone();
            let ctx = ctx.clone();
            watcher(api, config.clone())
                .default_backoff()
                .filter_map(move |event| {
                    let changed = match event {
                        Ok(watcher::Event::Apply(object) | watcher::Event::InitApply(object)) => {
                            Some((object, false))
                        }
                        Ok(watcher::Event::Delete(object)) => Some((object, true)),
                        Ok(watcher::Event::InitDone) => {
                            // A (re)list names no object deleted while the watch was
                            // down, and a sync may have run before it: trust nothing
                            // remembered from before.
                            ctx.published.all_drifted();
                            None
                        }
                        Ok(_) => None,
                        Err(error) => {
                            ctx.published.all_drifted();
                            tracing::warn!(%namespace, %error, kind = %kind,
                                "cannot watch the Proxies' {kind}s: one changed by hand is \
                                 repaired only at its Proxy's next poll; let the operator list \
                                 and watch them here");
                            None
                        }
                    };
                    futures::future::ready(changed)
                })
                .boxed()
        })
        .collect();
    futures::stream::select_all(watches)
        .filter_map(move |(object, gone)| {
            let owner = owning_proxy(&object);
            let proxy = owner.as_ref().and_then(|owner| proxies.get(owner));
            let trigger = proxy.filter(|proxy| drifted(proxy, &object, gone));
            if let Some(proxy) = &trigger {
                // Before the sync it asks for: a changed slice that the last sync wrote
                // is written again whole; anything else is read again first.
                let uid = proxy.uid().unwrap_or_default();
                let rewritten =
                    rewritable && !gone && ctx.published.rewrite_slice(&uid, &object.name_any());
                if !rewritten {
                    ctx.published.drifted(&uid);
                }
            }
            futures::future::ready(trigger.map(|proxy| ObjectRef::from_obj(proxy.as_ref())))
        })
        .boxed()
}

/// The Proxy that `object`'s controller reference names, in its namespace.
fn owning_proxy<K: Resource>(object: &K) -> Option<ObjectRef<Proxy>> {
    let owner = object
        .meta()
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == Proxy::kind(&()))?;
    Some(ObjectRef::new(&owner.name).within(&object.namespace()?))
}
