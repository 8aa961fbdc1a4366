//! Cleanup of a Proxy being deleted.
//!
//! It runs only for a Proxy that carries the finalizer, which is added just before the
//! first call that may create an instance ([`super::finalizer`]): a Proxy refused
//! before that (a mistyped `spec.provider`) goes without asking any provider.
//!
//! 1. The Proxy's Service and EndpointSlice go first, so that no workload is sent to
//!    a VM being deleted.
//! 2. Every instance recorded or tagged with its UID is deleted (NOT_FOUND is
//!    success), then the finalizer goes. The tags find an instance whose Create
//!    answer never arrived or was never recorded (a crash in between).
//! 3. If that fails (its provider is no longer configured, unreachable, cannot list),
//!    the finalizer stays (the VM would leak) until the annotation
//!    `egressproxy.dev/abandon-instance: "true"` says to leave the VM behind (see
//!    [`super::abandon`]).
//!
//! When the finalizer goes, every in-memory entry of the Proxy goes with it.

use std::collections::{BTreeSet, HashMap};

use kube::api::Api;
use kube::runtime::controller::Action;

use super::{ProxyKey, abandon, save, tags};
use crate::context::Context;
use crate::crd::{Proxy, ProxyStatus, condition};
use crate::endpoints::service;
use crate::k8s::events::EventType;
use crate::k8s::status::set_condition;
use crate::shared::error::{Error, Result};

pub(super) async fn cleanup(
    proxy: &Proxy,
    key: &ProxyKey,
    ctx: &Context,
    api: &Api<Proxy>,
) -> Result<Action> {
    let mut status = proxy.status.clone().unwrap_or_default();
    withdraw_service(ctx, proxy, key, &status).await;
    let outcome = match delete_everything(proxy, key, ctx, &status).await {
        Err(error) if abandon::requested(proxy) => {
            abandon::record(ctx, proxy, key, &status, &error).await;
            Ok(Action::await_change())
        }
        outcome => outcome,
    };
    if let Err(error) = &outcome {
        let message = abandon::refusal(error, key);
        set_condition(
            &mut status.conditions,
            condition::READY,
            false,
            error.reason(),
            &message,
            proxy.metadata.generation,
        );
        if status.last_error.as_deref() != Some(&message) {
            ctx.publish(proxy, EventType::Warning, "DeleteFailed", &message)
                .await;
        }
        status.last_error = Some(message);
    }
    let mut saved = proxy.status.clone();
    save(ctx, key, proxy, api, &mut status, &mut saved).await?;
    if outcome.is_ok() {
        ctx.forget_reconcile_state(&key.uid);
    }
    outcome
}

/// Deletes the Proxy's Service and EndpointSlice before its VM, so that no workload is
/// sent to a VM on its way out. A failure does not hold the deletion back: the objects'
/// owner references let Kubernetes' garbage collector delete them with the Proxy.
async fn withdraw_service(ctx: &Context, proxy: &Proxy, key: &ProxyKey, status: &ProxyStatus) {
    if status.service_name.is_none() {
        return;
    }
    // After any sync under way: one that began before the deletion would otherwise
    // write the objects again once they are gone.
    let _one_writer = ctx.published.one_writer(&key.uid).await;
    if let Err(error) = service::withdraw(ctx, proxy).await {
        tracing::warn!(proxy = %key, error = %error.describe(),
            "cannot delete the Proxy's Service; the garbage collector will");
    }
}

async fn delete_everything(
    proxy: &Proxy,
    key: &ProxyKey,
    ctx: &Context,
    status: &ProxyStatus,
) -> Result<Action> {
    let provider = ctx
        .providers
        .get(&proxy.spec.provider)
        .map_err(|error| match error {
            Error::ProviderNotConfigured(name) => Error::ProviderGone(name),
            other => other,
        })?;
    let mut ids: BTreeSet<String> = status.provider_id.iter().cloned().collect();
    let selector = HashMap::from([
        (tags::CLUSTER.to_owned(), ctx.cluster_name.clone()),
        (tags::UID.to_owned(), key.uid.clone()),
    ]);
    // ListInstances is required: without it an instance created just before a crash
    // (its id never recorded) could not be found, and the finalizer must not go then.
    let tagged = provider.list(&selector).await?;
    ids.extend(tagged.into_iter().map(|instance| instance.id));
    for id in &ids {
        provider.delete(id).await?;
    }
    if !ids.is_empty() {
        let note = format!(
            "deleted instance {}",
            ids.into_iter().collect::<Vec<_>>().join(", ")
        );
        ctx.publish(proxy, EventType::Normal, "Deleted", &note)
            .await;
    }
    Ok(Action::await_change())
}
