//! Garbage collection of orphaned instances.
//!
//! Every `interval`, for each provider: list the instances tagged with this cluster's
//! `egressproxy.dev/cluster` tag, and delete those whose `egressproxy.dev/uid` names no
//! existing Proxy and that are older than `grace` (which covers a Create whose Proxy is
//! not yet visible in the list). Instances without our cluster tag are never listed,
//! so never touched. An operator that watches a list of namespaces lists only the
//! instances tagged with one of them (one list per namespace): Proxies elsewhere are
//! invisible to it, so it cannot judge their instances. A provider that fails
//! (unreachable, handing out a page token twice, or paging past the contract's limit) is
//! skipped until the next sweep, and the log says why.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use egressproxy_provider::pb;
use kube::api::ListParams;

use crate::context::Context;
use crate::error::with_causes;
use crate::providers::Provider;
use crate::reconcile::tags;
use crate::watch_scope::WatchScope;

/// What one sweep did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Instances deleted.
    pub deleted: Vec<String>,
    /// Providers whose sweep failed.
    pub failed_providers: Vec<String>,
}

/// One sweep over every provider, judging only the instances of Proxies in `scope`.
pub async fn sweep(
    ctx: &Context,
    scope: &WatchScope,
    grace: Duration,
) -> Result<SweepReport, kube::Error> {
    let mut live = HashSet::new();
    for proxies in scope.apis(&ctx.client) {
        let listed = proxies.list_metadata(&ListParams::default()).await?;
        live.extend(listed.items.into_iter().filter_map(|p| p.metadata.uid));
    }
    let cluster = (tags::CLUSTER.to_owned(), ctx.cluster_name.clone());
    let selectors: Vec<HashMap<String, String>> = match scope {
        WatchScope::AllNamespaces => vec![HashMap::from([cluster])],
        WatchScope::Namespaces(namespaces) => namespaces
            .iter()
            .map(|namespace| {
                let namespace = (tags::NAMESPACE.to_owned(), namespace.clone());
                HashMap::from([cluster.clone(), namespace])
            })
            .collect(),
    };
    let now = std::time::SystemTime::now();
    let mut report = SweepReport::default();
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
        for instance in instances {
            let Some(uid) = instance.tags.get(tags::UID) else {
                continue;
            };
            if live.contains(uid) {
                continue;
            }
            let created = instance
                .create_time
                .and_then(|t| std::time::SystemTime::try_from(t).ok());
            let age = created
                .and_then(|created| now.duration_since(created).ok())
                .unwrap_or_default();
            if age < grace {
                continue;
            }
            match provider.delete(&instance.id).await {
                Ok(()) => {
                    tracing::info!(provider = provider.name(), instance = %instance.id, %uid, "deleted orphaned instance");
                    report.deleted.push(instance.id);
                }
                Err(error) => {
                    tracing::warn!(instance = %instance.id, error = %with_causes(&error),
                        "garbage collection: delete failed")
                }
            }
        }
    }
    Ok(report)
}

/// The instances that match any of `selectors`.
async fn list_all(
    provider: &Provider,
    selectors: &[HashMap<String, String>],
) -> crate::error::Result<Vec<pb::Instance>> {
    let mut instances = Vec::new();
    for selector in selectors {
        instances.extend(provider.list(selector).await?);
    }
    Ok(instances)
}

/// Sweeps every `interval` forever.
pub async fn run(ctx: &Context, scope: &WatchScope, interval: Duration, grace: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        if let Err(error) = sweep(ctx, scope, grace).await {
            tracing::warn!(error = %with_causes(&error), "garbage collection: cannot list Proxies");
        }
    }
}
