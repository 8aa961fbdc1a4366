//! The way out of a deletion the provider cannot carry out: the annotation
//! `egressproxy.dev/abandon-instance: "true"` lets the Proxy go and leaves its VMs
//! behind, whatever stopped their deletion (the provider no longer configured,
//! unreachable, without ListInstances, or paging without end).
//!
//! 1. Until the annotation is set, the failed deletion keeps the finalizer, and the
//!    message of its `DeleteFailed` Event ends with the command that sets it.
//! 2. With the annotation, the deletion is still tried first; only when it fails does
//!    the Proxy go without it.
//! 3. What is left behind is never dropped silently: an `InstanceAbandoned` Warning
//!    Event (and a log line) names the provider, the recorded instance and its key,
//!    and the tags that find every instance made for the Proxy, with the error that
//!    stopped the deletion.

use kube::ResourceExt;

use super::{ABANDON_ANNOTATION, ProxyKey, tags};
use crate::context::Context;
use crate::crd::{Proxy, ProxyStatus};
use crate::k8s::events::EventType;
use crate::shared::error::Error;

/// Whether the Proxy carries the abandon annotation.
pub(super) fn requested(proxy: &Proxy) -> bool {
    proxy
        .annotations()
        .get(ABANDON_ANNOTATION)
        .is_some_and(|value| value == "true")
}

/// The message of a failed deletion, ending with the way out when it does not name
/// it already.
pub(super) fn refusal(error: &Error, key: &ProxyKey) -> String {
    let message = error.describe();
    if message.contains(ABANDON_ANNOTATION) {
        return message;
    }
    format!(
        "{message}; the Proxy stays until its VM is deleted: fix the provider, or let the \
         Proxy go and leave the VM behind with: kubectl annotate proxy -n {} {} {ABANDON_ANNOTATION}=true",
        key.namespace, key.name
    )
}

/// Records what the Proxy leaves behind as the annotation asks: an Event and a log
/// line naming it.
pub(super) async fn record(
    ctx: &Context,
    proxy: &Proxy,
    key: &ProxyKey,
    status: &ProxyStatus,
    error: &Error,
) {
    let instance = match (&status.provider_id, &status.instance_key) {
        (Some(id), Some(instance_key)) => format!("instance {id} (key {instance_key})"),
        (Some(id), None) => format!("instance {id}"),
        (None, Some(instance_key)) => {
            format!("the instance created under key {instance_key}, if any")
        }
        (None, None) => "no recorded instance".to_owned(),
    };
    let note = format!(
        "deleting the VM failed ({}); as {ABANDON_ANNOTATION} asks, the Proxy goes and \
         leaves at provider {:?}: {instance}, and any instance tagged {}={} and {}={}: \
         delete them at the provider",
        error.describe(),
        proxy.spec.provider,
        tags::CLUSTER,
        ctx.cluster_name,
        tags::UID,
        key.uid,
    );
    tracing::warn!(proxy = %key, provider = %proxy.spec.provider, instance = ?status.provider_id,
        "instance abandoned: {note}");
    ctx.publish(proxy, EventType::Warning, "InstanceAbandoned", &note)
        .await;
}
