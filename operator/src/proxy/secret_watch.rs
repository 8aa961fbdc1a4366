//! Watching the Secrets that Proxies take their cloud-init from, so that a Secret
//! created or fixed after its Proxy is picked up at once, not at the Proxy's next
//! retry (whose backoff grows to 5 minutes).
//!
//! 1. One watch of Secret *metadata* per watched namespace (or one for all): the
//!    operator never holds Secret data beyond the one Secret a Create reads, by name.
//! 2. Every Secret the watch sees (created, changed, listed) retries at once the
//!    Proxies of its namespace that name it in `spec.cloudInit.userDataSecretRef` and
//!    have no instance yet: a Secret is read only to create an instance, so a Proxy
//!    whose VM exists has no use for a change.
//! 3. A watch that fails (the operator may not list Secrets there) is logged with its
//!    namespace and retried with backoff; Proxies then still retry on their own backoff.

use futures::stream::BoxStream;
use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::ResourceExt;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};

use crate::crd::Proxy;
use crate::k8s::watch_scope::WatchScope;

/// The Proxies to retry because a Secret they wait for appeared or changed.
pub fn triggers(
    client: &kube::Client,
    scope: &WatchScope,
    proxies: Store<Proxy>,
) -> impl Stream<Item = ObjectRef<Proxy>> + Send + 'static {
    // An Api of PartialObjectMeta makes metadata-only requests: no Secret data.
    let apis: Vec<Api<PartialObjectMeta<Secret>>> = match scope {
        WatchScope::AllNamespaces => vec![Api::all(client.clone())],
        WatchScope::Namespaces(namespaces) => namespaces
            .iter()
            .map(|namespace| Api::namespaced(client.clone(), namespace))
            .collect(),
    };
    let watches: Vec<BoxStream<'static, _>> = apis
        .into_iter()
        .map(|api| {
            let namespace = api.namespace().unwrap_or("(all)").to_owned();
            watcher(api, watcher::Config::default())
                .default_backoff()
                .touched_objects()
                .inspect_err(move |error| {
                    tracing::warn!(%namespace, %error,
                        "cannot watch Secrets: a cloud-init Secret created or fixed later is \
                         noticed only at its Proxy's next retry; let the operator list and \
                         watch Secrets here");
                })
                .filter_map(|secret| futures::future::ready(secret.ok()))
                .boxed()
        })
        .collect();
    futures::stream::select_all(watches).flat_map(move |secret| {
        let namespace = secret.namespace().unwrap_or_default();
        let waiting = waiting_for(&proxies, &namespace, &secret.name_any());
        futures::stream::iter(waiting)
    })
}

/// The Proxies in `namespace` that take their user-data from Secret `name` and have no
/// instance yet.
fn waiting_for(proxies: &Store<Proxy>, namespace: &str, name: &str) -> Vec<ObjectRef<Proxy>> {
    proxies
        .state()
        .iter()
        .filter(|proxy| proxy.namespace().as_deref() == Some(namespace))
        .filter(|proxy| {
            proxy
                .spec
                .cloud_init
                .as_ref()
                .and_then(|c| c.user_data_secret_ref.as_ref())
                .is_some_and(|reference| reference.name == name)
        })
        .filter(|proxy| {
            proxy
                .status
                .as_ref()
                .is_none_or(|status| status.provider_id.is_none())
        })
        .map(|proxy| ObjectRef::from_obj(proxy.as_ref()))
        .collect()
}
