//! Telling people about the watches of Proxies: whenever a watch's state changes, the
//! `egressproxy_namespace_watch_up` gauge follows it, and a failing watch is a Warning
//! Event about the operator (`NamespaceNotWatched`, naming the namespace and the
//! error), so that one namespace the operator may not watch is visible with
//! `kubectl get events` where the operator runs, while the other namespaces are served.
//! A watch that recovers is logged.

use std::sync::Arc;

use crate::context::Context;
use crate::k8s::events::EventType;
use crate::k8s::watch_health::{ALL_NAMESPACES, WatchHealth};

/// Reports every change of `health`, for ever.
pub async fn run(ctx: Arc<Context>, health: Arc<WatchHealth>) {
    let mut changes = health.changes();
    let mut reported = health.snapshot();
    for (namespace, watch) in &reported {
        ctx.metrics
            .set_namespace_watch_up(namespace, watch.failing.is_none());
    }
    while changes.changed().await.is_ok() {
        let now = health.snapshot();
        for (namespace, watch) in &now {
            let before = reported.get(namespace);
            ctx.metrics
                .set_namespace_watch_up(namespace, watch.failing.is_none());
            match (&watch.failing, before.and_then(|b| b.failing.as_ref())) {
                (Some(error), previous) if previous != Some(error) => {
                    let note = format!(
                        "cannot watch Proxies in {}: {error}; its Proxies are not reconciled until \
                         the operator may list and watch them there (check its Role), the other \
                         namespaces are served",
                        shown(namespace)
                    );
                    ctx.publish_about_operator(EventType::Warning, "NamespaceNotWatched", &note)
                        .await;
                }
                (None, Some(_)) => {
                    tracing::info!(namespace = %shown(namespace), "watching Proxies again")
                }
                _ => {}
            }
        }
        reported = now;
    }
}

fn shown(namespace: &str) -> &str {
    if namespace == ALL_NAMESPACES {
        "every namespace"
    } else {
        namespace
    }
}
