//! The Service controller: keeps each Proxy's Service and EndpointSlices what the
//! Proxy's cached status asks ([`service::sync`]), apart from the Proxy's reconcile.
//!
//! 1. **Triggers**: every change of a Proxy the watch delivers (its status included:
//!    turning Ready, a new address), every successful reconcile of it (so a poll repairs
//!    what drifted while the watch of the objects failed), and a Service or slice
//!    someone else changed ([`crate::endpoints::owned_watch`]). kube-runtime's queue merges the triggers of
//!    one Proxy, and each run reads the Proxy from the shared store as it is then, so a
//!    Proxy that changed several times while waiting is published once, as it is now.
//! 2. **Run**: [`service::sync`] against that copy. The Proxy's own writes come first
//!    (the status is saved by its reconcile, the Service follows from the cache), so
//!    the watch of the objects always compares them with a Proxy that wants them.
//!    A Proxy being deleted is left to its cleanup, which withdraws its objects before
//!    its VM goes (doing it here too would double those requests); what a Proxy that
//!    never had an instance leaves goes with it by its owner references. A sync and a
//!    cleanup's withdrawal of one Proxy never overlap
//!    ([`one_writer`](crate::k8s::published::Published::one_writer)), and a sync reads
//!    the Proxy from the store again once it holds that lock, so a sync that began
//!    before the deletion cannot bring the objects back after the withdrawal.
//! 3. **Bound**: at most [`Context::max_concurrent_service_syncs`] run at once. Creating
//!    a ClusterIP Service is among the costliest writes an apiserver takes (it
//!    allocates the address, and Kubernetes' allocator counts every address in use on
//!    each allocation); a burst of new Proxies then waits on its Services here, in a
//!    queue of its own, instead of holding the reconciles that make other Proxies
//!    Ready.
//! 4. **Failure**: logged, counted under `egressproxy_reconcile_errors_total`, and
//!    retried with a per-Proxy backoff that a success resets.

use std::sync::Arc;

use futures::{Stream, StreamExt};
use kube::ResourceExt;
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::reflector::{ObjectRef, Store};

use crate::context::Context;
use crate::crd::Proxy;
use crate::endpoints::service;
use crate::shared::error::{Error, Result};

/// Runs the Service controller until `triggers` ends (it never does while the Proxy
/// watch runs; the caller drops this future to stop it). `proxies` is the store the
/// Proxy controller fills.
pub async fn run(
    ctx: Arc<Context>,
    proxies: Store<Proxy>,
    triggers: impl Stream<Item = ObjectRef<Proxy>> + Send + 'static,
) {
    let config = controller::Config::default().concurrency(ctx.max_concurrent_service_syncs);
    let publisher = Arc::new(Publisher {
        ctx,
        proxies: proxies.clone(),
    });
    // Every trigger comes from `triggers`: the Proxy watch is the other controller's.
    Controller::for_stream(futures::stream::pending(), proxies)
        .with_config(config)
        .reconcile_on(triggers)
        .run(publish, error_policy, publisher)
        .for_each(|result| async move {
            if let Err(error) = result {
                tracing::debug!(%error, "Service sync error");
            }
        })
        .await;
}

/// What a sync needs: the shared context, and the store to read the Proxy from once it
/// is the only writer of its objects.
struct Publisher {
    ctx: Arc<Context>,
    proxies: Store<Proxy>,
}

/// Makes the objects of `proxy` what its status asks.
async fn publish(proxy: Arc<Proxy>, publisher: Arc<Publisher>) -> Result<Action> {
    let ctx = &publisher.ctx;
    let uid = proxy.uid().unwrap_or_default();
    let _one_writer = ctx.published.one_writer(&uid).await;
    // Read again: a cleanup that held the lock has withdrawn the objects of a Proxy
    // that the copy handed in may not yet show deleted.
    let Some(proxy) = publisher.proxies.get(&ObjectRef::from_obj(proxy.as_ref())) else {
        return Ok(Action::await_change());
    };
    if proxy.metadata.deletion_timestamp.is_some() || proxy.uid().as_ref() != Some(&uid) {
        return Ok(Action::await_change());
    }
    let status = proxy.status.clone().unwrap_or_default();
    service::sync(ctx, &proxy, &status).await?;
    ctx.publish_backoff.reset(&uid);
    Ok(Action::await_change())
}

fn error_policy(proxy: Arc<Proxy>, error: &Error, publisher: Arc<Publisher>) -> Action {
    let ctx = &publisher.ctx;
    tracing::warn!(proxy = %proxy.name_any(), namespace = proxy.namespace().unwrap_or_default(),
        error = %error.describe(), "cannot write the Proxy's Service");
    ctx.metrics.failed(error.class_label());
    Action::requeue(ctx.publish_delay(&proxy.uid().unwrap_or_default()))
}
