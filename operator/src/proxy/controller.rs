//! Running the Proxy controller: watch Proxies, reconcile each, and skip status-only
//! updates (our own status writes) so a write never triggers a pointless reconcile.
//! A reload of the provider config reconciles every Proxy once; a cloud-init Secret
//! that appears or changes reconciles the Proxies waiting for it ([`secret_watch`]); an
//! instance that a provider's watch reports changed reconciles its Proxy
//! ([`instance_watch`]).
//! Every change of a Proxy, its status included, and every successful reconcile also go
//! to the Service controller ([`publisher`]), which keeps the Proxy's Service and
//! EndpointSlices from the same store in a queue of its own; a Service or EndpointSlice
//! changed by someone else goes there too ([`owned_watch`]).
//! A Proxy that leaves the watch (deleted, or missing from a relist) loses every
//! in-memory entry the operator kept for it, and [`memory_sweep`] drops whatever work
//! finishing late recorded for it afterwards.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use kube::ResourceExt;
use kube::runtime::{Controller, WatchStreamExt, controller, reflector, watcher};

use crate::context::Context;
use crate::crd::Proxy;
use crate::k8s::proxy_cache::ProxyCache;
use crate::k8s::watch_scope::WatchScope;
use crate::proxy::instance_watch::{self, InstanceWatch};
use crate::proxy::reconcile::{ABANDON_ANNOTATION, RETRY_ANNOTATION, error_policy, reconcile};
use crate::shared::liveness::Liveness;
use crate::{
    endpoints::owned_watch, endpoints::publisher, proxy::memory_sweep, proxy::secret_watch,
    proxy::watch_report,
};

/// What makes a Proxy worth reconciling: its spec (generation), its deletion, the
/// abandon annotation and the retry-now annotation. Not its finalizers: the reconcile
/// adds its own while it runs, and a second reconcile on that change would work from
/// a copy without the status the first one is about to write.
fn reconcile_trigger(proxy: &Proxy) -> u64 {
    let mut hasher = DefaultHasher::new();
    proxy.metadata.generation.hash(&mut hasher);
    proxy
        .metadata
        .deletion_timestamp
        .is_some()
        .hash(&mut hasher);
    proxy
        .annotations()
        .get(ABANDON_ANNOTATION)
        .hash(&mut hasher);
    proxy.annotations().get(RETRY_ANNOTATION).hash(&mut hasher);
    hasher.finish()
}

/// Runs the controller on the Proxies in `scope` until `shutdown` completes.
pub async fn run(
    ctx: Arc<Context>,
    scope: WatchScope,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let (cache, writer) = ProxyCache::new(scope);
    run_with_cache(ctx, cache, writer, shutdown).await;
}

/// Runs the controller, filling `cache` through `writer`: the cache garbage collection
/// reads is then the controller's own.
pub async fn run_with_cache(
    ctx: Arc<Context>,
    cache: ProxyCache,
    writer: reflector::store::Writer<Proxy>,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) {
    let reader = cache.store().clone();
    // kube-runtime holds reconciles until the store has its first list; a shutdown that
    // ends the watch before then would leave that wait, and the controller, hanging.
    let ready = reader.clone();
    let shutdown = async move {
        shutdown.await;
        let _ = ready.wait_until_ready().await;
    };
    let store = reader.clone();
    let forgetting = ctx.clone();
    // Unbounded, but drained at once into the Service controller's queue, which keeps
    // one entry per Proxy.
    let (to_publish, publish_triggers) = futures::channel::mpsc::unbounded();
    let publish_after_reconcile = to_publish.clone();
    let filtering = ctx.clone();
    let stream = cache
        .scope()
        .watch(
            &ctx.client,
            watcher::Config::default(),
            cache.health().clone(),
            reader.clone(),
        )
        .reflect(writer)
        .inspect(move |event| match event {
            Ok(watcher::Event::Apply(proxy) | watcher::Event::InitApply(proxy)) => {
                let _ = to_publish.unbounded_send(reflector::ObjectRef::from_obj(proxy));
            }
            Ok(watcher::Event::Delete(proxy)) => {
                forgetting.forget_proxy(&proxy.uid().unwrap_or_default());
            }
            Ok(watcher::Event::InitDone) => {
                forgetting.forget_proxies_except(|| memory_sweep::live_uids(&store));
            }
            _ => {}
        })
        .applied_objects()
        // The triggers seen are kept per UID in the context (not in kube-runtime's
        // predicate cache, which keeps deleted objects for an hour), so they go
        // with the Proxy like every other per-Proxy entry.
        .try_filter(move |proxy| {
            let uid = proxy.uid().unwrap_or_default();
            futures::future::ready(filtering.trigger_changed(&uid, reconcile_trigger(proxy)))
        });
    // A provider config reload may fix Proxies that wait for a provider: retry them all
    // at once rather than at their next (possibly minutes away) backoff.
    let provider_changes = futures::stream::unfold(ctx.providers.changes(), |mut changes| async {
        changes.changed().await.ok()?;
        Some(((), changes))
    });
    let ctx_for_reports = ctx.clone();
    let liveness = ctx.liveness.clone();
    let sweeper = memory_sweep::run(ctx.clone(), reader.clone(), memory_sweep::INTERVAL);
    let secrets = secret_watch::triggers(&ctx.client, cache.scope(), reader.clone());
    let owned = owned_watch::triggers(ctx.clone(), cache.scope(), reader.clone());
    let services = publisher::run(
        ctx.clone(),
        reader.clone(),
        futures::stream::select(publish_triggers, owned),
    );
    let (instance_changes, instances) = InstanceWatch::default().split(reader.clone());
    let followers = instance_watch::run(ctx.clone(), instance_changes);
    let config = controller::Config::default().concurrency(ctx.max_concurrent_reconciles);
    let controller = Controller::for_stream(stream, reader)
        .with_config(config)
        .reconcile_all_on(provider_changes)
        .reconcile_on(secrets)
        .reconcile_on(instances)
        // Requests that pass through the queue like a Proxy's, so that an idle controller
        // still shows it processes requests (`liveness`).
        .reconcile_on(Liveness::probes())
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(move |result| {
            liveness.beat();
            // Each reconcile that succeeds (a poll among them; a failed one is retried
            // until one does) also has the Proxy's objects checked:
            // nothing is read or written when they are as last made, and what drifted
            // while their watch failed is repaired.
            if let Ok((object, _)) = &result {
                let _ = publish_after_reconcile.unbounded_send(object.clone());
            }
            async move {
                match result {
                    Ok((object, action)) => {
                        tracing::debug!(proxy = %object.name, ?action, "reconciled")
                    }
                    Err(error) if Liveness::is_probe(&error) => {}
                    Err(error) => tracing::debug!(%error, "reconcile error"),
                }
            }
        });
    let reporter = watch_report::run(ctx_for_reports, cache.health().clone());
    // The sweeper, the reporter, the followers and the Service controller never end;
    // the controller ends on shutdown, and takes them along.
    tokio::select! {
        () = controller => {}
        () = services => {}
        () = sweeper => {}
        () = reporter => {}
        () = followers => {}
    }
}
