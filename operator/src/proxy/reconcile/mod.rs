//! Reconciling one Proxy, in the style of kube-rs's controller-rs: a deleted Proxy is
//! cleaned up, any other runs passes of three steps.
//!
//! 1. **Resolve** the Proxy's UID, namespace and name once into a [`ProxyKey`]. A
//!    deleted Proxy is cleaned up (`cleanup`) if it carries the finalizer
//!    `egressproxy.dev/instance`, which is added just before the first call that may
//!    create an instance (`finalizer`), so a crash never leaks a VM.
//! 2. **Observe** ([`observe`]): the provider (looked up, contract version checked),
//!    the recorded instance (GetInstance) and its proxy (the health check), each once.
//!    Where the instance reports it runs becomes `status.location` (the host the
//!    provider chose, or moved it to).
//! 3. **Plan** ([`plan::plan`]): a pure function of spec, status and observation to
//!    one [`Step`]: create, replace (placement changed, stopped, vanished), wait for
//!    the instance, or record the health check. Its table is in `docs/operator.md`.
//! 4. **Act** (`act`): perform that step. A Create checks the placement, reads the
//!    cloud-init Secret, adds the finalizer, calls CreateInstance with the key
//!    `<uid>-<replacements>` and records the id; the same key returns the same VM, so
//!    a crash anywhere is harmless; a Create refused for room says which locations
//!    the placement allows and what each lacks ([`no_room`]). After a Create (or a placement replacement) the
//!    pass runs again at once; every other step ends the reconcile with a requeue.
//!
//! A pool's new member whose annotation names a spare adopts it instead of creating
//! ([`adopt`]): the first Create step of its life takes the spare over by a
//! compare-and-set of its tags, or falls back to a Create.
//!
//! The phase is never set directly: [`status::phase`] derives it from the conditions
//! when status is saved, only if it changed.
//!
//! Errors become the `Ready` condition's reason, `lastError`, an Event for those a
//! person must fix, and a retry ([`Retry`]): backoff with jitter, the provider's
//! quota hint, a slow periodic retry when the cause lies outside the spec, or waiting
//! for the spec to change. The annotation [`RETRY_ANNOTATION`] (any new value)
//! retries at once.
//!
//! A Ready Proxy's egress address, the source address destinations see, is observed
//! through its proxy once per VM when a check URL is configured (`egress_observed`).
//!
//! The Proxy's Service and EndpointSlice follow the status it writes, synced by a
//! controller of their own ([`crate::endpoints::publisher`]); a reconcile only
//! withdraws them in its cleanup, before the VM goes. A reconcile whose copy of the
//! Proxy predates the operator's own last status write waits for the watch to catch
//! up ([`crate::k8s::own_writes`]).

mod abandon;
mod act;
pub mod adopt;
mod cleanup;
mod egress_address;
mod egress_observed;
mod finalizer;
pub mod key;
mod next;
pub mod no_room;
pub mod observe;
pub mod plan;

use std::sync::Arc;
use std::time::Duration;

use egressproxy_provider::pb;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;

pub use self::finalizer::FINALIZER;
pub use self::key::ProxyKey;
use self::next::Next;
pub use self::plan::Step;
use crate::context::Context;
use crate::crd::{Proxy, ProxyStatus};
use crate::endpoints::service;
use crate::k8s::events::EventType;
use crate::k8s::own_writes;
use crate::k8s::status::{self, set_condition};
use crate::providers::{Provider, placement};
use crate::shared::error::{Error, Result, Retry};

/// Longest wait a provider's quota hint can impose.
const MAX_QUOTA_WAIT: Duration = Duration::from_secs(300);
/// Most observe → plan → act passes in one reconcile (placement replacement, Create,
/// then the new instance's first look).
const MAX_PASSES: usize = 4;

/// Annotation that lets a Proxy whose VM cannot be deleted (its provider gone or
/// broken) be deleted, leaving its VM.
pub const ABANDON_ANNOTATION: &str = "egressproxy.dev/abandon-instance";
/// Annotation whose every new value retries the Proxy at once (as Flux's
/// `reconcile.fluxcd.io/requestedAt`): set it to the current time.
pub const RETRY_ANNOTATION: &str = "egressproxy.dev/reconcile-requested-at";
/// Tag keys set on every instance.
pub use crate::providers::instance_tags as tags;

/// Reconciles one Proxy (the controller's entry point). Its span carries the trace id,
/// and every provider call made inside it continues the same trace.
#[tracing::instrument(skip_all, fields(
    proxy = %proxy.name_any(),
    namespace = proxy.namespace().unwrap_or_default(),
    trace_id = tracing::field::Empty,
))]
pub async fn reconcile(proxy: Arc<Proxy>, ctx: Arc<Context>) -> Result<Action> {
    let key = ProxyKey::of(&proxy);
    if ctx
        .own_writes
        .waits_for(&key.uid, proxy.metadata.resource_version.as_deref())
    {
        // This copy predates the operator's own last write: wait for the watch.
        return Ok(Action::requeue(own_writes::RECHECK));
    }
    ctx.metrics.reconciled();
    record_trace_id();
    let api: Api<Proxy> = Api::namespaced(ctx.client.clone(), &key.namespace);
    let result = if proxy.metadata.deletion_timestamp.is_none() {
        apply(&proxy, &key, &ctx, &api).await
    } else if finalizer::holds(&proxy) {
        clean_up(&proxy, &key, &ctx, &api).await
    } else {
        // No instance was ever asked for: nothing to delete.
        ctx.forget_reconcile_state(&key.uid);
        Ok(Action::await_change())
    };
    ctx.report_memory();
    result
}

/// Deletes what the deleted Proxy has, then lets it go by removing the finalizer.
async fn clean_up(
    proxy: &Proxy,
    key: &ProxyKey,
    ctx: &Context,
    api: &Api<Proxy>,
) -> Result<Action> {
    let removed = match cleanup::cleanup(proxy, key, ctx, api).await {
        Ok(action) => finalizer::remove_from(api, proxy).await.map(|()| action),
        Err(Error::Kube(kube::Error::Api(status))) if status.code == 404 => {
            Err(kube::Error::Api(status))
        }
        Err(error) => return Err(error),
    };
    match removed {
        Ok(action) => Ok(action),
        // The finalizer's removal (or a write of the cleanup) may have met the work of
        // an earlier reconcile, queued while it ran and handed a stale copy.
        Err(_) if cleanup_done(api, key).await => {
            ctx.forget_reconcile_state(&key.uid);
            Ok(Action::await_change())
        }
        Err(error) => Err(error.into()),
    }
}

/// Whether the Proxy `key` names no longer carries the finalizer: it is gone, its name
/// belongs to another, or another finalizer alone holds it. A reconcile queued while
/// an earlier one cleaned up works from a stale copy that still lists the finalizer;
/// what it meets is the cleanup done, not a failure to back off from.
async fn cleanup_done(api: &Api<Proxy>, key: &ProxyKey) -> bool {
    match api.get_opt(&key.name).await {
        Ok(found) => found.is_none_or(|proxy| {
            proxy.uid().as_deref() != Some(key.uid.as_str()) || !finalizer::holds(&proxy)
        }),
        Err(_) => false,
    }
}

/// Records the current OpenTelemetry trace id on the reconcile span (when tracing is
/// exported), so logs can be matched with traces.
fn record_trace_id() {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let span = tracing::Span::current();
    let trace_id = span.context().span().span_context().trace_id();
    if trace_id != opentelemetry::trace::TraceId::INVALID {
        span.record("trace_id", tracing::field::display(trace_id));
    }
}

/// What the controller does when [`reconcile`] fails: back off per object.
pub fn error_policy(proxy: Arc<Proxy>, error: &Error, ctx: Arc<Context>) -> Action {
    tracing::warn!(proxy = %proxy.name_any(), error = %error.describe(), "reconcile failed");
    Action::requeue(ctx.retry_delay(&ProxyKey::of(&proxy).uid))
}

/// One reconcile's working state: what it acts on, and the status it builds.
pub(super) struct Reconciliation<'a> {
    ctx: &'a Context,
    key: &'a ProxyKey,
    proxy: &'a Proxy,
    api: &'a Api<Proxy>,
    provider: &'a Provider,
    status: ProxyStatus,
    /// The status as last written (or read), to skip writes that change nothing.
    saved: Option<ProxyStatus>,
    /// Whether the Proxy carries the finalizer (read, or added by this reconcile).
    guarded: bool,
}

impl Reconciliation<'_> {
    /// Sets a condition at the Proxy's generation.
    fn set(&mut self, type_: &str, value: bool, reason: &str, message: &str) {
        let generation = self.proxy.metadata.generation;
        set_condition(
            &mut self.status.conditions,
            type_,
            value,
            reason,
            message,
            generation,
        );
    }

    async fn publish(&self, type_: EventType, reason: &str, note: &str) {
        self.ctx.publish(self.proxy, type_, reason, note).await;
    }

    /// Adds the finalizer unless the Proxy has it: called just before every provider
    /// call that may leave an instance behind.
    async fn guard_instance(&mut self) -> Result<()> {
        if !self.guarded {
            finalizer::add_to(self.api, self.proxy).await?;
            self.guarded = true;
        }
        Ok(())
    }

    /// Adds the finalizer back to a Proxy whose status records an instance (an id, or
    /// the key of a Create that may have happened) but that lost it.
    async fn keep_guarded(&mut self) -> Result<()> {
        if self.status.provider_id.is_some() || self.status.instance_key.is_some() {
            self.guard_instance().await?;
        }
        Ok(())
    }

    /// Records where the instance runs, as the provider reports it: the host it chose,
    /// and a new one when the instance moved. A report without a location (a
    /// provider's bug) keeps the one last known.
    fn record_location(&mut self, instance: &pb::Instance) {
        if let Some(location) = placement::location_of(instance.placement.as_ref()) {
            self.status.location = Some(location);
        }
    }

    /// Writes the status (with its derived phase) if it changed.
    async fn save(&mut self) -> Result<()> {
        save(
            self.ctx,
            self.key,
            self.proxy,
            self.api,
            &mut self.status,
            &mut self.saved,
        )
        .await
    }
}

/// Derives the phase, writes `status` unless it equals `saved`, and records the
/// phase in the metrics.
async fn save(
    ctx: &Context,
    key: &ProxyKey,
    proxy: &Proxy,
    api: &Api<Proxy>,
    status: &mut ProxyStatus,
    saved: &mut Option<ProxyStatus>,
) -> Result<()> {
    let deleting = proxy.metadata.deletion_timestamp.is_some();
    status.phase = Some(status::phase(status, deleting));
    status.service_name = service::service_name(proxy);
    let mut current = proxy.clone();
    current.status = saved.clone();
    if let Some(version) = status::write_if_changed(api, &current, status).await? {
        ctx.own_writes.record(&key.uid, version);
        ctx.metrics.status_written();
        *saved = Some(status.clone());
    }
    ctx.metrics.set_phase(&key.uid, status.phase);
    Ok(())
}

async fn apply(proxy: &Proxy, key: &ProxyKey, ctx: &Context, api: &Api<Proxy>) -> Result<Action> {
    let mut status = proxy.status.clone().unwrap_or_default();
    let provider = match observe::provider(ctx, proxy).await {
        Ok(provider) => provider,
        Err(error) => {
            let action = fail(ctx, key, proxy, &mut status, error).await;
            let mut saved = proxy.status.clone();
            save(ctx, key, proxy, api, &mut status, &mut saved).await?;
            return Ok(action);
        }
    };
    let mut pass = Reconciliation {
        ctx,
        key,
        proxy,
        api,
        provider,
        saved: proxy.status.clone(),
        status,
        guarded: finalizer::holds(proxy),
    };
    let outcome = match pass.keep_guarded().await {
        Ok(()) => observe_plan_act(&mut pass).await,
        Err(error) => Err(error),
    };
    pass.status.observed_generation = proxy.metadata.generation;
    let action = match outcome {
        Ok(action) => {
            pass.status.last_error = None;
            ctx.retry_backoff.reset(&key.uid);
            action
        }
        Err(error) => fail(ctx, key, proxy, &mut pass.status, error).await,
    };
    pass.save().await?;
    Ok(action)
}

/// Observe → plan → act until a step ends the reconcile.
async fn observe_plan_act(pass: &mut Reconciliation<'_>) -> Result<Action> {
    for _ in 0..MAX_PASSES {
        let observation =
            observe::observe(pass.ctx, pass.key, pass.proxy, &pass.status, pass.provider).await?;
        if let observe::Instance::Found(instance) = &observation.instance {
            pass.record_location(instance);
        }
        let step = plan::plan(&pass.proxy.spec, &pass.status, &observation);
        tracing::debug!(proxy = %pass.key, ?step, "planned");
        if let Next::Done(action) = act::act(pass, step).await? {
            return Ok(action);
        }
    }
    Ok(Action::requeue(pass.ctx.poll_backoff.next(&pass.key.uid)))
}

/// What a failed reconcile tells the user. An error a person fixes outside the Proxy
/// (at the provider, in the operator's config) is retried only slowly, and no change of
/// the Proxy announces the fix: its message ends with the command that retries at once.
fn failure_message(error: &Error, key: &ProxyKey) -> String {
    let message = error.describe();
    if !error.is_permanent() || error.retry() == Retry::OnSpecChange {
        return message;
    }
    format!(
        "{message}; once fixed, retry at once with: kubectl annotate proxy -n {} {} --overwrite {RETRY_ANNOTATION}=\"$(date -Is)\"",
        key.namespace, key.name
    )
}

/// Records a failed reconcile in `status` and says when to retry.
async fn fail(
    ctx: &Context,
    key: &ProxyKey,
    proxy: &Proxy,
    status: &mut ProxyStatus,
    error: Error,
) -> Action {
    let message = failure_message(&error, key);
    tracing::warn!(proxy = %key, error = %message, "reconcile step failed");
    ctx.metrics.failed(error.class_label());
    status.observed_generation = proxy.metadata.generation;
    // A transient blip while the proxy serves does not make it unready: the VM and
    // its proxy still work; lastError says what failed.
    let serving =
        status::is_true(&status.conditions, crate::crd::condition::READY) && !error.is_permanent();
    if !serving {
        set_condition(
            &mut status.conditions,
            crate::crd::condition::READY,
            false,
            error.reason(),
            &message,
            proxy.metadata.generation,
        );
    }
    if error.needs_a_person() && status.last_error.as_deref() != Some(&message) {
        ctx.publish(proxy, EventType::Warning, error.reason(), &message)
            .await;
    }
    status.last_error = Some(message);
    match error.retry() {
        Retry::Backoff => Action::requeue(ctx.retry_delay(&key.uid)),
        // A provider's hint, kept within what our own backoff would allow.
        Retry::After(hint) => Action::requeue(ctx.retry_backoff.next_after_hint(
            &key.uid,
            hint,
            MAX_QUOTA_WAIT,
        )),
        Retry::Slowly => Action::requeue(ctx.permanent_retry),
        Retry::OnSpecChange => Action::await_change(),
    }
}
