//! Reconciling one Proxy.
//!
//! Apply (the Proxy exists):
//! 1. The finalizer is added before anything is created, so a crash never leaks a VM.
//! 2. The provider is looked up and its contract version checked.
//! 3. A placement change (allowed only with `updatePolicy: Replace`) deletes the VM.
//! 4. With no VM recorded, the placement is checked (ValidatePlacement, when the
//!    provider has it), then CreateInstance runs with key `<uid>-<replacements>` and the
//!    cluster/namespace/name/uid tags; the provider id is written to status at once.
//!    A crash before that write is harmless: the same key returns the same VM.
//! 5. GetInstance: PROVISIONING polls with backoff; STOPPED or vanished VMs are
//!    replaced (with backoff so a crash loop does not hammer the provider); RUNNING
//!    with an address runs the health check and sets Ready.
//!
//! Errors become conditions (reason says which kind), an Event for permanent ones,
//! and a retry policy: backoff with jitter, the provider's quota hint, or waiting for
//! the spec to change.
//!
//! Cleanup (the Proxy is being deleted): every VM recorded or tagged with its UID is
//! deleted (NOT_FOUND is success), then the finalizer goes. If its provider is no
//! longer configured, the finalizer stays until the annotation
//! `egressproxy.dev/abandon-instance: "true"` says to leave the VM behind.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use egressproxy_provider::{ErrorClass, pb};
use k8s_openapi::api::core::v1::Secret;
use kube::ResourceExt;
use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::finalizer::{Event as FinalizerEvent, finalizer};

use crate::context::Context;
use crate::crd::{HealthCheck, Phase, Placement, Proxy, ProxyAddress, ProxyStatus, condition};
use crate::error::{Error, Result, Retry};
use crate::health_check;
use crate::providers::Provider;
use crate::status::{self, set_condition};

/// Longest wait a provider's quota hint can impose.
const MAX_QUOTA_WAIT: Duration = Duration::from_secs(300);

/// The finalizer that guards every Proxy's VM.
pub const FINALIZER: &str = "egressproxy.dev/instance";
/// Annotation that lets a Proxy whose provider is gone be deleted, leaving its VM.
pub const ABANDON_ANNOTATION: &str = "egressproxy.dev/abandon-instance";
/// Tag keys set on every instance.
pub mod tags {
    /// The operator's `--cluster-name`.
    pub const CLUSTER: &str = "egressproxy.dev/cluster";
    /// The Proxy's namespace.
    pub const NAMESPACE: &str = "egressproxy.dev/namespace";
    /// The Proxy's name.
    pub const NAME: &str = "egressproxy.dev/name";
    /// The Proxy's UID.
    pub const UID: &str = "egressproxy.dev/uid";
}

/// Reconciles one Proxy (the controller's entry point). Its span carries the trace id,
/// and every provider call made inside it continues the same trace.
#[tracing::instrument(skip_all, fields(
    proxy = %proxy.name_any(),
    namespace = proxy.namespace().unwrap_or_default(),
    trace_id = tracing::field::Empty,
))]
pub async fn reconcile(proxy: Arc<Proxy>, ctx: Arc<Context>) -> Result<Action> {
    ctx.metrics.reconciled();
    record_trace_id();
    let namespace = proxy.namespace().unwrap_or_default();
    let api: Api<Proxy> = Api::namespaced(ctx.client.clone(), &namespace);
    finalizer(&api, FINALIZER, proxy, |event| async {
        match event {
            FinalizerEvent::Apply(proxy) => apply(&proxy, &ctx, &api).await,
            FinalizerEvent::Cleanup(proxy) => cleanup(&proxy, &ctx, &api).await,
        }
    })
    .await
    .map_err(|error| Error::Finalizer(Box::new(error)))
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
    tracing::warn!(proxy = %proxy.name_any(), error = %error_chain(error), "reconcile failed");
    Action::requeue(ctx.retry_backoff.next(&proxy.uid().unwrap_or_default()))
}

/// The error and its sources, for messages users read.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Writes status checkpoints, skipping writes that would change nothing.
struct StatusWriter<'a> {
    api: &'a Api<Proxy>,
    ctx: &'a Context,
    proxy: Proxy,
}

impl StatusWriter<'_> {
    async fn save(&mut self, status: &ProxyStatus) -> Result<()> {
        if status::apply_if_changed(self.api, &self.proxy, status).await? {
            self.ctx.metrics.status_written();
            self.proxy.status = Some(status.clone());
        }
        let uid = self.proxy.uid().unwrap_or_default();
        self.ctx.metrics.set_phase(&uid, status.phase);
        Ok(())
    }
}

async fn apply(proxy: &Proxy, ctx: &Context, api: &Api<Proxy>) -> Result<Action> {
    let uid = proxy.uid().unwrap_or_default();
    let mut writer = StatusWriter {
        api,
        ctx,
        proxy: proxy.clone(),
    };
    let mut status = proxy.status.clone().unwrap_or_default();
    status.phase.get_or_insert(Phase::Pending);
    let outcome = drive(proxy, ctx, &mut status, &mut writer).await;
    status.observed_generation = proxy.metadata.generation;
    let action = match outcome {
        Ok(action) => {
            status.last_error = None;
            ctx.retry_backoff.reset(&uid);
            action
        }
        Err(error) => {
            let message = error_chain(&error);
            tracing::warn!(error = %message, "reconcile step failed");
            ctx.metrics.failed(error.class_label());
            // A transient blip while the proxy serves does not make it unready: the VM
            // and its proxy still work; lastError says what failed.
            let serving = status.phase == Some(Phase::Ready) && !error.is_permanent();
            if !serving {
                let generation = proxy.metadata.generation;
                set_condition(
                    &mut status.conditions,
                    condition::READY,
                    false,
                    error.reason(),
                    &message,
                    generation,
                );
            }
            if error.is_permanent() {
                status.phase = Some(Phase::Failed);
                if status.last_error.as_deref() != Some(&message) {
                    ctx.publish(proxy, EventType::Warning, error.reason(), message.clone())
                        .await;
                }
            }
            status.last_error = Some(message);
            match error.retry() {
                Retry::Backoff => Action::requeue(ctx.retry_backoff.next(&uid)),
                // A provider's hint, kept within what our own backoff would allow.
                Retry::After(hint) => Action::requeue(ctx.retry_backoff.next_after_hint(
                    &uid,
                    hint,
                    MAX_QUOTA_WAIT,
                )),
                Retry::OnSpecChange => Action::await_change(),
            }
        }
    };
    writer.save(&status).await?;
    Ok(action)
}

async fn drive(
    proxy: &Proxy,
    ctx: &Context,
    status: &mut ProxyStatus,
    writer: &mut StatusWriter<'_>,
) -> Result<Action> {
    let uid = proxy.uid().unwrap_or_default();
    let provider = ctx.providers.get(&proxy.spec.provider)?;
    provider.handshake().await?;

    if let (Some(id), Some(old)) = (status.provider_id.clone(), status.placement.as_ref())
        && *old != proxy.spec.placement
    {
        let note = format!("placement changed: deleting instance {id} and creating a new one");
        ctx.publish(proxy, EventType::Normal, "Replacing", note)
            .await;
        provider.delete(&id).await?;
        forget_instance(ctx, &proxy.uid().unwrap_or_default(), status);
        writer.save(status).await?;
    }

    let id = match status.provider_id.clone() {
        Some(id) => id,
        None => {
            provider
                .validate_placement(placement(&proxy.spec.placement))
                .await?;
            let instance = match create_instance(proxy, ctx, provider, status).await {
                Ok(instance) => instance,
                Err(Error::Provider { source, .. })
                    if source.class == ErrorClass::AlreadyExists =>
                {
                    return replace_stale_attempt(proxy, ctx, provider, status).await;
                }
                Err(error) => return Err(error),
            };
            let note = format!(
                "created instance {} with provider {}",
                instance.id,
                provider.name()
            );
            ctx.publish(proxy, EventType::Normal, "Created", note).await;
            status.provider_id = Some(instance.id.clone());
            status.placement = Some(proxy.spec.placement.clone());
            status.phase = Some(Phase::Provisioning);
            writer.save(status).await?;
            instance.id
        }
    };

    let Some(instance) = provider.get(&id).await? else {
        let note = format!(
            "instance {id} no longer exists at provider {}: creating a new one",
            provider.name()
        );
        return replace(proxy, ctx, status, "InstanceVanished", note).await;
    };

    let generation = proxy.metadata.generation;
    match instance.state() {
        pb::InstanceState::Stopped => {
            provider.delete(&id).await?;
            let note = format!(
                "instance {id} stopped ({}): replacing it",
                instance.state_message
            );
            replace(proxy, ctx, status, "InstanceStopped", note).await
        }
        pb::InstanceState::Running if !instance.addresses.is_empty() => {
            ctx.poll_backoff.reset(&uid);
            status.addresses = instance.addresses.iter().map(proxy_address).collect();
            status.addresses.sort_by(|a, b| {
                (&a.scope, &a.family, &a.address).cmp(&(&b.scope, &b.family, &b.address))
            });
            set_condition(
                &mut status.conditions,
                condition::PROVISIONED,
                true,
                "Running",
                "",
                generation,
            );
            Ok(check_health(proxy, ctx, status).await)
        }
        state => {
            let message = match state {
                pb::InstanceState::Deleting => "the provider is deleting the instance".to_owned(),
                pb::InstanceState::Running => "running, waiting for an address".to_owned(),
                _ if instance.state_message.is_empty() => {
                    "the instance is being created".to_owned()
                }
                _ => instance.state_message.clone(),
            };
            status.phase = Some(Phase::Provisioning);
            set_condition(
                &mut status.conditions,
                condition::PROVISIONED,
                false,
                "Provisioning",
                &message,
                generation,
            );
            set_condition(
                &mut status.conditions,
                condition::READY,
                false,
                "Provisioning",
                &message,
                generation,
            );
            Ok(Action::requeue(ctx.poll_backoff.next(&uid)))
        }
    }
}

/// Our own key is taken by an instance made from an older spec: an earlier Create
/// whose answer never arrived (timeout, crash) before the spec or its Secret changed.
/// That instance is ours (tagged with our UID and key): delete it and create anew
/// under the next key.
async fn replace_stale_attempt(
    proxy: &Proxy,
    ctx: &Context,
    provider: &Provider,
    status: &mut ProxyStatus,
) -> Result<Action> {
    let key = status.instance_key.clone().unwrap_or_default();
    let selector = HashMap::from([
        (tags::CLUSTER.to_owned(), ctx.cluster_name.clone()),
        (tags::UID.to_owned(), proxy.uid().unwrap_or_default()),
    ]);
    let stale: Vec<String> = provider
        .list(&selector)
        .await?
        .into_iter()
        .filter(|i| i.key == key)
        .map(|i| i.id)
        .collect();
    for id in &stale {
        provider.delete(id).await?;
    }
    let note = format!(
        "key {key} belongs to instance {} made from an older spec by an unfinished attempt: deleted it, creating a new one",
        stale.join(", ")
    );
    replace(proxy, ctx, status, "StaleAttemptReplaced", note).await
}

/// Forgets the current instance (and its health) so the next step creates a
/// replacement.
fn forget_instance(ctx: &Context, uid: &str, status: &mut ProxyStatus) {
    status.provider_id = None;
    status.instance_key = None;
    status.placement = None;
    status.addresses.clear();
    status.replacements += 1;
    status.phase = Some(Phase::Provisioning);
    status.conditions.retain(|c| c.type_ != condition::HEALTHY);
    ctx.health_failures
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(uid);
}

async fn replace(
    proxy: &Proxy,
    ctx: &Context,
    status: &mut ProxyStatus,
    reason: &str,
    note: String,
) -> Result<Action> {
    ctx.publish(proxy, EventType::Warning, reason, note.clone())
        .await;
    forget_instance(ctx, &proxy.uid().unwrap_or_default(), status);
    let generation = proxy.metadata.generation;
    set_condition(
        &mut status.conditions,
        condition::PROVISIONED,
        false,
        reason,
        &note,
        generation,
    );
    set_condition(
        &mut status.conditions,
        condition::READY,
        false,
        reason,
        &note,
        generation,
    );
    Ok(Action::requeue(
        ctx.replace_backoff.next(&proxy.uid().unwrap_or_default()),
    ))
}

async fn create_instance(
    proxy: &Proxy,
    ctx: &Context,
    provider: &Provider,
    status: &mut ProxyStatus,
) -> Result<pb::Instance> {
    let uid = proxy.uid().unwrap_or_default();
    let key = format!("{uid}-{}", status.replacements);
    status.instance_key = Some(key.clone());
    let namespace = proxy.namespace().unwrap_or_default();
    let name = proxy.name_any();
    let request = pb::CreateInstanceRequest {
        key,
        name: format!("{namespace}/{name}"),
        tags: HashMap::from([
            (tags::CLUSTER.to_owned(), ctx.cluster_name.clone()),
            (tags::NAMESPACE.to_owned(), namespace),
            (tags::NAME.to_owned(), name),
            (tags::UID.to_owned(), uid),
        ]),
        placement: Some(placement(&proxy.spec.placement)),
        cloud_init: Some(cloud_init(proxy, ctx).await?),
        proxy_port: u32::from(proxy.spec.proxy_port),
    };
    provider.create(request).await
}

fn placement(placement: &Placement) -> pb::Placement {
    use pb::placement::Location;
    pb::Placement {
        location: match (&placement.host, &placement.zone) {
            (Some(host), _) => Some(Location::Host(host.clone())),
            (None, Some(zone)) => Some(Location::Zone(zone.clone())),
            (None, None) => None,
        },
        machine_type: placement.machine_type.clone(),
        image: placement.image.clone(),
    }
}

async fn cloud_init(proxy: &Proxy, ctx: &Context) -> Result<pb::CloudInit> {
    let Some(spec) = &proxy.spec.cloud_init else {
        return Ok(pb::CloudInit::default());
    };
    let user_data =
        match (&spec.user_data, &spec.user_data_secret_ref) {
            (Some(inline), _) => inline.clone().into_bytes(),
            (None, Some(reference)) => {
                let namespace = proxy.namespace().unwrap_or_default();
                let secret_name = format!("{namespace}/{}", reference.name);
                let secrets: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
                let secret = secrets.get_opt(&reference.name).await?.ok_or_else(|| {
                    Error::CloudInitSecret {
                        secret: secret_name.clone(),
                        problem:
                            "not found: create it, or fix spec.cloudInit.userDataSecretRef.name"
                                .into(),
                    }
                })?;
                let value = secret
                    .data
                    .as_ref()
                    .and_then(|data| data.get(&reference.key));
                value
                    .map(|bytes| bytes.0.clone())
                    .ok_or_else(|| Error::CloudInitSecret {
                        secret: secret_name,
                        problem: format!(
                            "has no key {:?}: fix spec.cloudInit.userDataSecretRef.key",
                            reference.key
                        ),
                    })?
            }
            (None, None) => Vec::new(),
        };
    Ok(pb::CloudInit {
        user_data,
        vendor_data: spec.vendor_data.clone().map(String::into_bytes),
    })
}

fn proxy_address(address: &pb::Address) -> ProxyAddress {
    ProxyAddress {
        address: address.address.clone(),
        scope: match address.scope() {
            pb::AddressScope::External => "External",
            _ => "Internal",
        }
        .into(),
        family: match address.family() {
            pb::IpFamily::V6 => "IPv6",
            _ => "IPv4",
        }
        .into(),
    }
}

async fn check_health(proxy: &Proxy, ctx: &Context, status: &mut ProxyStatus) -> Action {
    let uid = proxy.uid().unwrap_or_default();
    let generation = proxy.metadata.generation;
    let check = proxy.spec.health_check.clone().unwrap_or_default();
    let period = Duration::from_secs(u64::from(check.period_seconds));
    let result = match status
        .addresses
        .first()
        .and_then(|a| a.address.parse::<IpAddr>().ok())
    {
        Some(ip) => health_check::probe(SocketAddr::new(ip, proxy.spec.proxy_port), &check).await,
        None => Err("the provider reported no usable IP address".to_owned()),
    };
    let failures = {
        let mut failures = ctx
            .health_failures
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let count = failures.entry(uid.clone()).or_default();
        *count = if result.is_ok() {
            0
        } else {
            count.saturating_add(1)
        };
        *count
    };
    match result {
        Ok(()) => {
            set_condition(
                &mut status.conditions,
                condition::HEALTHY,
                true,
                "HealthCheckPassed",
                "",
                generation,
            );
            set_condition(
                &mut status.conditions,
                condition::READY,
                true,
                "Ready",
                "",
                generation,
            );
            status.phase = Some(Phase::Ready);
            ctx.replace_backoff.reset(&uid);
            Action::requeue(period)
        }
        Err(problem) => fail_health(proxy, ctx, status, &check, failures, problem).await,
    }
}

async fn fail_health(
    proxy: &Proxy,
    ctx: &Context,
    status: &mut ProxyStatus,
    check: &HealthCheck,
    failures: u32,
    problem: String,
) -> Action {
    let generation = proxy.metadata.generation;
    let soon = Action::requeue(Duration::from_secs(u64::from(check.period_seconds.min(5))));
    // The Healthy condition exists once this VM's proxy has answered (a replacement
    // starts without it): until then the proxy is still being installed, not broken.
    let ever_healthy = status
        .conditions
        .iter()
        .any(|c| c.type_ == condition::HEALTHY);
    if !ever_healthy {
        status.phase = Some(Phase::Provisioning);
        let message = format!("waiting for the proxy to answer: {problem}");
        set_condition(
            &mut status.conditions,
            condition::READY,
            false,
            "WaitingForProxy",
            &message,
            generation,
        );
        return soon;
    }
    if failures < check.failure_threshold {
        return soon;
    }
    let threshold = check.failure_threshold;
    let message = format!("health check failed {threshold} times in a row: {problem}");
    if status.phase != Some(Phase::Degraded) {
        ctx.publish(proxy, EventType::Warning, "Unhealthy", message.clone())
            .await;
    }
    set_condition(
        &mut status.conditions,
        condition::HEALTHY,
        false,
        "HealthCheckFailed",
        &message,
        generation,
    );
    set_condition(
        &mut status.conditions,
        condition::READY,
        false,
        "HealthCheckFailed",
        &message,
        generation,
    );
    status.phase = Some(Phase::Degraded);
    Action::requeue(Duration::from_secs(u64::from(check.period_seconds)))
}

async fn cleanup(proxy: &Proxy, ctx: &Context, api: &Api<Proxy>) -> Result<Action> {
    let mut writer = StatusWriter {
        api,
        ctx,
        proxy: proxy.clone(),
    };
    let mut status = proxy.status.clone().unwrap_or_default();
    status.phase = Some(Phase::Deleting);
    let outcome = delete_everything(proxy, ctx, &status).await;
    if let Err(error) = &outcome {
        let message = error_chain(error);
        set_condition(
            &mut status.conditions,
            condition::READY,
            false,
            error.reason(),
            &message,
            proxy.metadata.generation,
        );
        if status.last_error.as_deref() != Some(&message) {
            ctx.publish(proxy, EventType::Warning, "DeleteFailed", message.clone())
                .await;
        }
        status.last_error = Some(message);
    }
    writer.save(&status).await?;
    outcome
}

async fn delete_everything(proxy: &Proxy, ctx: &Context, status: &ProxyStatus) -> Result<Action> {
    let provider = match ctx.providers.get(&proxy.spec.provider) {
        Ok(provider) => provider,
        Err(error) => {
            if proxy
                .annotations()
                .get(ABANDON_ANNOTATION)
                .is_some_and(|v| v == "true")
            {
                let note = format!(
                    "provider {:?} is not configured; instance {} was left behind as {ABANDON_ANNOTATION} asks",
                    proxy.spec.provider,
                    status.provider_id.as_deref().unwrap_or("(none recorded)")
                );
                ctx.publish(proxy, EventType::Warning, "InstanceAbandoned", note)
                    .await;
                return Ok(Action::await_change());
            }
            return Err(match error {
                Error::ProviderNotConfigured(name) => Error::ProviderGone(name),
                other => other,
            });
        }
    };
    let mut ids: BTreeSet<String> = status.provider_id.iter().cloned().collect();
    let selector = HashMap::from([
        (tags::CLUSTER.to_owned(), ctx.cluster_name.clone()),
        (tags::UID.to_owned(), proxy.uid().unwrap_or_default()),
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
        ctx.publish(proxy, EventType::Normal, "Deleted", note).await;
    }
    ctx.health_failures
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&proxy.uid().unwrap_or_default());
    ctx.metrics
        .set_phase(&proxy.uid().unwrap_or_default(), None);
    Ok(Action::await_change())
}
