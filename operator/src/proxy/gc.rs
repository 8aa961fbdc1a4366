//! Garbage collection of orphaned and superseded instances.
//!
//! Every `interval`, for each provider:
//! 1. List the instances tagged with this cluster's `egressproxy.dev/cluster` tag: all
//!    of them, or, for an operator that watches a list of namespaces, those tagged with
//!    one of its namespaces (one list per namespace; Proxies elsewhere are invisible to
//!    it, so it cannot judge their instances). A namespace whose Proxies have not been
//!    listed yet is skipped: its Proxies are not in the cache, and every instance of
//!    it would look orphaned. Instances without our cluster tag are never listed, so
//!    never touched.
//! 2. Then read the Proxies from the controller's cache (the reflector's store; no
//!    list from the API). Reading them after the instances means that every listed
//!    instance was created while its Proxy was already in the cache, so a Proxy
//!    created during the sweep cannot make its instance look orphaned.
//! 3. Delete, when older than `grace`: an instance whose `egressproxy.dev/uid` names no
//!    cached Proxy (orphaned), a pool's spare whose pool is gone (no pool of its
//!    namespace and name, or one with another UID, read from the apiserver: a pool's
//!    own finalizer deletes its spares, so this only finds those of a pool whose
//!    finalizer was removed by hand), and an instance of a cached Proxy made under a key the
//!    Proxy has moved past: a key `<uid>-<n>` with `n` below the Proxy's
//!    `status.replacements`, and not its recorded instance (superseded: a VM that
//!    vanished, was replaced, and came back). Replacements only grow, so a cached
//!    status that lags the API only ever spares an instance, never condemns one.
//!
//! A provider that fails (unreachable, handing out a page token twice, or paging past
//! the contract's limit) is skipped until the next sweep, and the log says why.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use egressproxy_provider::pb;
use kube::{Api, ResourceExt};

use crate::context::Context;
use crate::crd::{Proxy, ProxyPool};
use crate::k8s::proxy_cache::ProxyCache;
use crate::k8s::watch_scope::WatchScope;
use crate::providers::Provider;
use crate::proxy::reconcile::tags;
use crate::shared::error::with_causes;

/// What one sweep did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Instances deleted.
    pub deleted: Vec<String>,
    /// Providers whose sweep failed.
    pub failed_providers: Vec<String>,
    /// Namespaces not judged because their Proxies were not listed yet.
    pub unlisted_namespaces: Vec<String>,
}

/// One sweep over every provider, judging only the instances of Proxies in `cache`.
pub async fn sweep(ctx: &Context, cache: &ProxyCache, grace: Duration) -> SweepReport {
    let mut report = SweepReport::default();
    let cluster = (tags::CLUSTER.to_owned(), ctx.cluster_name.clone());
    let selectors: Vec<HashMap<String, String>> = match cache.scope() {
        WatchScope::AllNamespaces if cache.listed("") => vec![HashMap::from([cluster])],
        WatchScope::AllNamespaces => {
            report.unlisted_namespaces.push("(all)".to_owned());
            Vec::new()
        }
        WatchScope::Namespaces(namespaces) => {
            let (listed, unlisted): (Vec<&String>, Vec<&String>) = namespaces
                .iter()
                .partition(|namespace| cache.listed(namespace));
            report.unlisted_namespaces = unlisted.into_iter().cloned().collect();
            listed
                .into_iter()
                .map(|namespace| {
                    let namespace = (tags::NAMESPACE.to_owned(), namespace.clone());
                    HashMap::from([cluster.clone(), namespace])
                })
                .collect()
        }
    };
    if !report.unlisted_namespaces.is_empty() {
        tracing::info!(namespaces = ?report.unlisted_namespaces,
            "garbage collection: skipping namespaces whose Proxies are not listed yet");
    }
    if selectors.is_empty() {
        return report;
    }
    for provider in ctx.providers.iter() {
        let instances = match list_all(provider, &selectors).await {
            Ok(instances) => instances,
            Err(error) => {
                tracing::warn!(provider = provider.name(), error = %with_causes(&error),
                    "garbage collection: cannot list instances");
                report.failed_providers.push(provider.name().to_owned());
                continue;
            }
        };
        let proxies = by_uid(cache);
        let now = std::time::SystemTime::now();
        for instance in instances {
            let Some(uid) = instance.tags.get(tags::UID) else {
                if age(&instance, now) >= grace && orphaned_spare(ctx, &instance).await {
                    match provider.delete(&instance.id).await {
                        Ok(()) => {
                            tracing::info!(provider = provider.name(), instance = %instance.id,
                                "deleted the spare of a pool that is gone");
                            report.deleted.push(instance.id);
                        }
                        Err(error) => tracing::warn!(instance = %instance.id,
                            error = %with_causes(&error), "garbage collection: delete failed"),
                    }
                }
                continue;
            };
            let why = match proxies.get(uid.as_str()) {
                None => "orphaned",
                Some(proxy) if superseded(proxy, &instance) => "superseded",
                Some(_) => continue,
            };
            if age(&instance, now) < grace {
                continue;
            }
            match provider.delete(&instance.id).await {
                Ok(()) => {
                    tracing::info!(provider = provider.name(), instance = %instance.id, %uid,
                        "deleted {why} instance");
                    report.deleted.push(instance.id);
                }
                Err(error) => {
                    tracing::warn!(instance = %instance.id, error = %with_causes(&error),
                        "garbage collection: delete failed")
                }
            }
        }
    }
    report
}

/// The cached Proxies by UID.
fn by_uid(cache: &ProxyCache) -> HashMap<String, Arc<Proxy>> {
    cache
        .store()
        .state()
        .into_iter()
        .filter_map(|proxy| Some((proxy.uid()?, proxy)))
        .collect()
}

/// Whether `instance`, tagged with `proxy`'s UID, was made under a key the Proxy has
/// moved past (and is not the one it records).
fn superseded(proxy: &Proxy, instance: &pb::Instance) -> bool {
    let Some(status) = &proxy.status else {
        return false;
    };
    if status.provider_id.as_deref() == Some(instance.id.as_str()) {
        return false;
    }
    let serial = proxy.uid().and_then(|uid| {
        let rest = instance.key.strip_prefix(&uid)?.strip_prefix('-')?;
        rest.parse::<u32>().ok()
    });
    serial.is_some_and(|serial| serial < status.replacements)
}

/// Whether `instance` is a pool's spare (or a retiring one) whose pool is gone: no pool
/// of its namespace and name, or one with another UID (deleted and made again). A read
/// that fails judges nothing.
async fn orphaned_spare(ctx: &Context, instance: &pb::Instance) -> bool {
    let tag = |key: &str| instance.tags.get(key).map(String::as_str);
    if !matches!(
        tag(tags::ROLE),
        Some(tags::ROLE_SPARE | tags::ROLE_RETIRING)
    ) {
        return false;
    }
    let (Some(namespace), Some(name), Some(uid)) =
        (tag(tags::NAMESPACE), tag(tags::POOL), tag(tags::POOL_UID))
    else {
        return false;
    };
    let pools: Api<ProxyPool> = Api::namespaced(ctx.client.clone(), namespace);
    match pools.get_opt(name).await {
        Ok(None) => true,
        Ok(Some(pool)) => pool.uid().as_deref() != Some(uid),
        Err(error) => {
            tracing::warn!(instance = %instance.id, %error,
                "garbage collection: cannot read the pool of a spare");
            false
        }
    }
}

/// How long ago the provider says it created `instance` (zero when it does not say).
fn age(instance: &pb::Instance, now: std::time::SystemTime) -> Duration {
    instance
        .create_time
        .and_then(|t| std::time::SystemTime::try_from(t).ok())
        .and_then(|created| now.duration_since(created).ok())
        .unwrap_or_default()
}

/// The instances that match any of `selectors`.
async fn list_all(
    provider: &Provider,
    selectors: &[HashMap<String, String>],
) -> crate::shared::error::Result<Vec<pb::Instance>> {
    let mut instances = Vec::new();
    let mut seen = HashSet::new();
    for selector in selectors {
        for instance in provider.list(selector).await? {
            if seen.insert(instance.id.clone()) {
                instances.push(instance);
            }
        }
    }
    Ok(instances)
}

/// Sweeps every `interval` forever.
pub async fn run(ctx: &Context, cache: &ProxyCache, interval: Duration, grace: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        sweep(ctx, cache, grace).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxy(replacements: u32, provider_id: &str) -> Proxy {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "egressproxy.dev/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": "p", "uid": "u"},
            "spec": {"provider": "r", "placement": {"machineType": "s", "image": "i"}},
            "status": {"replacements": replacements, "providerId": provider_id},
        }))
        .unwrap()
    }

    fn instance(id: &str, key: &str) -> pb::Instance {
        pb::Instance {
            id: id.into(),
            key: key.into(),
            ..pb::Instance::default()
        }
    }

    #[test]
    fn only_keys_the_proxy_has_moved_past_are_superseded() {
        let live = proxy(2, "i-2");
        assert!(superseded(&live, &instance("i-0", "u-0")));
        assert!(superseded(&live, &instance("i-1", "u-1")));
        // The current key: in use, or being created right now.
        assert!(!superseded(&live, &instance("i-3", "u-2")));
        // A key ahead of a cached status that lags the API.
        assert!(!superseded(&live, &instance("i-4", "u-3")));
        // The recorded instance, whatever its key.
        assert!(!superseded(&live, &instance("i-2", "u-0")));
        // Keys that are not this Proxy's.
        assert!(!superseded(&live, &instance("i-5", "other-0")));
        assert!(!superseded(&live, &instance("i-6", "u-x")));
        assert!(!superseded(&live, &instance("i-7", "u0")));
    }
}
