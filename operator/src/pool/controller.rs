//! Running the pool controller: one kube-runtime controller per watched namespace (or
//! one for all), each watching the pools and what they own, selected by the pool label:
//! their member Proxies (so a member's status change, Ready or not, reaches its pool at
//! once), and their Services and EndpointSlices (so a hand edit is repaired).
//! Pools are few, so a controller per namespace costs little, and needs none of the
//! merged watch the Proxy controller uses for thousands of Proxies.

use std::sync::Arc;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::{Controller, controller, watcher};

use super::member::POOL_LABEL;
use super::reconcile::{error_policy, reconcile};
use crate::context::Context;
use crate::crd::{Proxy, ProxyPool};
use crate::k8s::watch_scope::WatchScope;

/// Runs the pool controller on the pools in `scope` until `shutdown` completes.
pub async fn run(
    ctx: Arc<Context>,
    scope: WatchScope,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let shutdown = shutdown.boxed().shared();
    let namespaces: Vec<Option<String>> = match &scope {
        WatchScope::AllNamespaces => vec![None],
        WatchScope::Namespaces(names) => names.iter().cloned().map(Some).collect(),
    };
    let controllers = namespaces.into_iter().map(|namespace| {
        let api = |client: &kube::Client| -> (Api<ProxyPool>, Api<Proxy>, Api<Service>, Api<EndpointSlice>) {
            match &namespace {
                None => (
                    Api::all(client.clone()),
                    Api::all(client.clone()),
                    Api::all(client.clone()),
                    Api::all(client.clone()),
                ),
                Some(ns) => (
                    Api::namespaced(client.clone(), ns),
                    Api::namespaced(client.clone(), ns),
                    Api::namespaced(client.clone(), ns),
                    Api::namespaced(client.clone(), ns),
                ),
            }
        };
        let (pools, proxies, services, slices) = api(&ctx.client);
        let owned = watcher::Config::default().labels(POOL_LABEL);
        let config = controller::Config::default().concurrency(ctx.max_concurrent_reconciles.min(16));
        Controller::new(pools, watcher::Config::default())
            .with_config(config)
            .owns(proxies, owned.clone())
            .owns(services, owned.clone())
            .owns(slices, owned)
            .graceful_shutdown_on(shutdown.clone())
            .run(reconcile, error_policy, ctx.clone())
            .for_each(move |result| {
                let namespace = namespace.clone().unwrap_or_else(|| "(all)".to_owned());
                async move {
                    match result {
                        Ok((pool, _)) => tracing::debug!(pool = %pool.name, "pool reconciled"),
                        // A failed pass is logged by the error policy; a failing watch
                        // (no permission in a namespace) only here.
                        Err(controller::Error::QueueError(error)) => tracing::warn!(%namespace, %error,
                            "cannot watch ProxyPools or their members: check the operator's permissions in this namespace"),
                        Err(error) => tracing::debug!(%error, "pool reconcile error"),
                    }
                }
            })
    });
    futures::future::join_all(controllers).await;
}
