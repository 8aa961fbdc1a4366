//! Garbage collection of orphaned instances.
//!
//! Every `interval`, for each provider: list the instances tagged with this cluster's
//! `egressproxy.dev/cluster` tag, and delete those whose `egressproxy.dev/uid` names no
//! existing Proxy and that are older than `grace` (which covers a Create whose Proxy is
//! not yet visible in the list). Instances without our cluster tag are never listed,
//! so never touched. A provider that fails (unreachable, or handing out a page token
//! twice) is skipped until the next sweep, and the log says why.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use kube::api::{Api, ListParams};

use crate::context::Context;
use crate::crd::Proxy;
use crate::reconcile::tags;

/// What one sweep did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Instances deleted.
    pub deleted: Vec<String>,
    /// Providers whose sweep failed.
    pub failed_providers: Vec<String>,
}

/// One sweep over every provider. `namespace` is the one namespace this operator
/// watches, if any: it then only judges instances tagged with that namespace, since
/// Proxies elsewhere are invisible to it.
pub async fn sweep(
    ctx: &Context,
    proxies: &Api<Proxy>,
    namespace: Option<&str>,
    grace: Duration,
) -> Result<SweepReport, kube::Error> {
    let live: HashSet<String> = proxies
        .list_metadata(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|proxy| proxy.metadata.uid)
        .collect();
    let mut selector = HashMap::from([(tags::CLUSTER.to_owned(), ctx.cluster_name.clone())]);
    if let Some(namespace) = namespace {
        selector.insert(tags::NAMESPACE.to_owned(), namespace.to_owned());
    }
    let now = std::time::SystemTime::now();
    let mut report = SweepReport::default();
    for provider in ctx.providers.iter() {
        let instances = match provider.list(&selector).await {
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

/// The error and its sources: the top level alone ("ListInstances failed") hides why.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Sweeps every `interval` forever.
pub async fn run(
    ctx: &Context,
    proxies: Api<Proxy>,
    namespace: Option<&str>,
    interval: Duration,
    grace: Duration,
) {
    loop {
        tokio::time::sleep(interval).await;
        if let Err(error) = sweep(ctx, &proxies, namespace, grace).await {
            tracing::warn!(error = %with_causes(&error), "garbage collection: cannot list Proxies");
        }
    }
}
