//! What a `kubectl` user met in the reconcile, each against a real kube-apiserver and
//! the reference provider as a separate process: metrics and memory after deletes,
//! Events of replacements, deleting a Proxy with a mistyped provider, a missing
//! Secret's Event, and the ways back from a provider-side permanent error.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::fixtures::wait_event_matching;
use common::{CRD, WAIT, eventually, wait_for_proxy, wait_until};

use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::context::Context;
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_operator::providers::{Providers, ProvidersConfig};
use egressproxy_operator::shared::metrics::Metrics;
use egressproxy_provider::pb;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};

struct Harness {
    env: KubeTestEnv,
    provider: ReferenceProvider,
    ctx: Arc<Context>,
    port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Harness {
    /// A controller watching its own namespace; `permanent_retry` sets the slow retry.
    async fn start(test: &str, permanent_retry: Option<Duration>) -> Harness {
        Harness::start_with_delay(test, permanent_retry, "100ms").await
    }

    /// Like [`Harness::start`], with instances RUNNING `provisioning_delay` after Create.
    async fn start_with_delay(
        test: &str,
        permanent_retry: Option<Duration>,
        provisioning_delay: &str,
    ) -> Harness {
        let env = KubeTestEnv::new(test).await.unwrap();
        apply_crds_yaml(&env.client, CRD).await.unwrap();
        let provider =
            ReferenceProvider::start(&["--provisioning-delay", provisioning_delay]).unwrap();
        let config = ProvidersConfig::parse(&format!(
            "providers:\n  reference:\n    endpoint: {}\n    callTimeout: 5s\n",
            provider.endpoint()
        ))
        .unwrap();
        let metrics = Arc::new(Metrics::default());
        let mut ctx = Context::new(
            env.client.clone(),
            Providers::new(config, metrics.clone()),
            format!("test-{}", env.namespace),
            metrics,
        );
        if let Some(every) = permanent_retry {
            ctx.permanent_retry = every;
        }
        let ctx = Arc::new(ctx);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(egressproxy_operator::proxy::controller::run(
            ctx.clone(),
            WatchScope::Namespaces(vec![env.namespace.clone()]),
            async {
                let _ = stopped.await;
            },
        ));
        // Every instance reports 127.0.0.1: one listener answers every health check.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                drop(stream);
            }
        });
        Harness {
            env,
            provider,
            ctx,
            port,
            stop: Some(stop),
        }
    }

    fn proxies(&self) -> Api<Proxy> {
        self.env.namespaced()
    }

    async fn create(&self, name: &str, provider: &str) {
        self.create_with(name, provider, serde_json::json!({}))
            .await;
    }

    /// Creates a Proxy whose spec has `extra` on top of the usual fields.
    async fn create_with(&self, name: &str, provider: &str, extra: serde_json::Value) {
        let mut spec = serde_json::json!({
            "provider": provider,
            "placement": {"machineType": "small", "image": "debian-12"},
            "proxyPort": self.port,
            "healthCheck": {"periodSeconds": 2, "timeoutSeconds": 1},
        });
        for (key, value) in extra.as_object().unwrap() {
            spec[key] = value.clone();
        }
        let proxy: Proxy = serde_json::from_value(serde_json::json!({
            "apiVersion": "egressproxy.dev/v1alpha1",
            "kind": "Proxy",
            "metadata": {"name": name},
            "spec": spec,
        }))
        .unwrap();
        self.proxies()
            .create(&PostParams::default(), &proxy)
            .await
            .unwrap();
    }

    async fn wait_for(&self, name: &str, what: &str, check: impl Fn(&Proxy) -> bool) -> Proxy {
        wait_for_proxy(&self.proxies(), name, what, check).await
    }

    async fn wait_phase(&self, name: &str, phase: Phase) -> Proxy {
        self.wait_for(name, &format!("{phase:?}"), |p| {
            p.status.as_ref().and_then(|s| s.phase) == Some(phase)
        })
        .await
    }

    async fn wait_gone(&self, name: &str) {
        let what = format!("{name} to be deleted");
        wait_until(&self.proxies(), name, &what, |p: Option<&Proxy>| {
            p.is_none()
        })
        .await;
    }

    /// Waits until an Event about `name` passes `check(reason, note)`.
    async fn wait_event(&self, name: &str, check: impl Fn(&str, &str) -> bool, what: &str) {
        let events: Api<Event> = self.env.namespaced();
        let what = format!("a {what} Event");
        wait_event_matching(&events, name, &what, |event| {
            check(
                event.reason.as_deref().unwrap_or_default(),
                event.note.as_deref().unwrap_or_default(),
            )
        })
        .await;
    }

    async fn control(&self) -> ControlServiceClient<tonic::transport::Channel> {
        ControlServiceClient::connect(self.provider.endpoint().to_owned())
            .await
            .unwrap()
    }

    async fn fail_next_create(&self, message: &str) {
        self.control()
            .await
            .inject_fault(control::InjectFaultRequest {
                method: "CreateInstance".into(),
                count: Some(1),
                effect: Some(control::inject_fault_request::Effect::Fail(
                    control::ErrorClass::Permanent.into(),
                )),
                message: message.into(),
                retry_after: None,
            })
            .await
            .unwrap();
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn provider_id(proxy: &Proxy) -> Option<String> {
    proxy.status.as_ref()?.provider_id.clone()
}

/// The value of every sample of metric `name` in the text, by its labels.
fn samples(text: &str, name: &str) -> Vec<(String, i64)> {
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with('{'))
        .filter_map(|line| {
            let (labels, value) = line.rsplit_once(' ')?;
            Some((labels[name.len()..].to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[tokio::test]
async fn deleted_proxies_leave_the_metrics_and_every_in_memory_map() {
    let h = Harness::start("forget", None).await;
    let names = ["a", "b", "c"];
    for name in names {
        h.create(name, "reference").await;
    }
    // One Proxy that failed (its backoff and Event cache have entries too).
    h.create("typo", "no-such-provider").await;
    for name in names {
        h.wait_phase(name, Phase::Ready).await;
    }
    h.wait_phase("typo", Phase::Failed).await;
    let text = h.ctx.metrics.encode();
    assert!(
        samples(&text, "egressproxy_proxies").contains(&("{phase=\"Ready\"}".into(), 3)),
        "{text}"
    );

    for name in names.into_iter().chain(["typo"]) {
        h.proxies()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    for name in names.into_iter().chain(["typo"]) {
        h.wait_gone(name).await;
    }
    // The Delete watch event forgets too; wait for it rather than for time (it shows
    // only in the metrics, which cannot be watched).
    let what = "the metrics to forget the deleted Proxies";
    eventually(what, WAIT, || async {
        let text = h.ctx.metrics.encode();
        let phases = samples(&text, "egressproxy_proxies");
        let tracked = samples(&text, "egressproxy_tracked_proxies");
        let leftovers: Vec<_> = phases
            .iter()
            .chain(&tracked)
            .filter(|(_, value)| *value != 0)
            .collect();
        if leftovers.is_empty() && !tracked.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "0 Proxies exist, yet the metrics keep {leftovers:?}:\n{text}"
            ))
        }
    })
    .await;
    for backoff in [
        &h.ctx.retry_backoff,
        &h.ctx.poll_backoff,
        &h.ctx.replace_backoff,
    ] {
        assert_eq!(backoff.len(), 0);
    }
}

/// A reconcile queued while an earlier one cleaned up a deleted Proxy works from a
/// stale copy that still lists the finalizer: it finds the finalizer gone (another
/// finalizer still holding the Proxy), then the Proxy gone. Either is the cleanup done,
/// not a failure to back off from and log.
#[tokio::test]
async fn a_cleanup_that_finds_its_finalizer_or_its_proxy_already_gone_succeeds() {
    let h = Harness::start("gone", None).await;
    h.create("a", "reference").await;
    h.wait_phase("a", Phase::Ready).await;
    // A finalizer of the test's own holds the Proxy until the operator's cleanup is done,
    // and the delete answers the copy a second reconcile would work from.
    h.proxies()
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": [
                egressproxy_operator::proxy::reconcile::FINALIZER, "test.egressproxy.dev/hold"
            ]}})),
        )
        .await
        .unwrap();
    let stale = h
        .proxies()
        .delete("a", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .expect("a Proxy with finalizers is kept until they go");
    assert!(stale.metadata.deletion_timestamp.is_some());
    h.wait_for("a", "the operator's finalizer removed", |p| {
        p.metadata.finalizers.as_deref() == Some(&["test.egressproxy.dev/hold".to_owned()][..])
    })
    .await;
    let reconcile_stale = || {
        egressproxy_operator::proxy::reconcile::reconcile(Arc::new(stale.clone()), h.ctx.clone())
    };
    let outcome = reconcile_stale().await;
    assert!(
        outcome.is_ok(),
        "a cleanup whose finalizer is already gone failed: {:?}",
        outcome.map_err(|e| e.describe())
    );
    h.proxies()
        .patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    h.wait_gone("a").await;

    let outcome = reconcile_stale().await;
    assert!(
        outcome.is_ok(),
        "a cleanup whose Proxy is already gone failed: {:?}",
        outcome.map_err(|e| e.describe())
    );
}

#[tokio::test]
async fn every_replacement_is_an_event_naming_the_new_instance() {
    let h = Harness::start("replaced", None).await;
    h.create("egress", "reference").await;
    let mut ids = vec![provider_id(&h.wait_phase("egress", Phase::Ready).await).unwrap()];
    for _ in 0..3 {
        let old = ids.last().unwrap().clone();
        h.control()
            .await
            .set_instance_state(control::SetInstanceStateRequest {
                id: old.clone(),
                state: pb::InstanceState::Stopped.into(),
            })
            .await
            .unwrap();
        let replaced = h
            .wait_for("egress", "a Ready replacement", |p| {
                provider_id(p).is_some_and(|id| id != old)
                    && p.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready)
            })
            .await;
        ids.push(provider_id(&replaced).unwrap());
    }
    h.wait_event(
        "egress",
        |reason, note| reason == "Created" && note.contains(&ids[0]),
        "Created with the first id",
    )
    .await;
    for pair in ids.windows(2) {
        let (old, new) = (&pair[0], &pair[1]);
        h.wait_event(
            "egress",
            |reason, note| {
                reason == "Replaced"
                    && note.contains(&format!("{old} \u{2192} {new}"))
                    && note.contains("stopped")
            },
            &format!("Replaced {old} -> {new}"),
        )
        .await;
    }
}

#[tokio::test]
async fn a_vm_that_never_becomes_ready_is_replaced_after_the_provisioning_timeout() {
    // Instances stay PROVISIONING for an hour: like a guest that hung while booting.
    let h = Harness::start_with_delay("provisioning-timeout", None, "1h").await;
    h.create_with(
        "stuck",
        "reference",
        serde_json::json!({"provisioningTimeoutSeconds": 10}),
    )
    .await;
    let first = h
        .wait_for("stuck", "an instance", |p| provider_id(p).is_some())
        .await;
    let first_id = provider_id(&first).unwrap();
    assert!(
        first
            .status
            .as_ref()
            .and_then(|s| s.instance_create_time.as_ref())
            .is_some(),
        "the creation time is recorded with the instance: {:#?}",
        first.status
    );
    let replaced = h
        .wait_for("stuck", "a replacement", |p| {
            provider_id(p).is_some_and(|id| id != first_id)
        })
        .await;
    let status = replaced.status.unwrap();
    assert_eq!(status.replacements, 1);
    assert_eq!(status.phase, Some(Phase::Provisioning));
    h.wait_event(
        "stuck",
        |reason, note| {
            reason == "ProvisioningTimedOut"
                && note.contains(&first_id)
                && note.contains("spec.provisioningTimeoutSeconds (10s)")
        },
        "ProvisioningTimedOut naming the instance and the field",
    )
    .await;
    // The stuck VM is gone at the provider, not just forgotten.
    let options = egressproxy_provider::client::ClientOptions::new(h.provider.endpoint());
    let mut provider = egressproxy_provider::client::connect_lazy(&options).unwrap();
    let gone = provider
        .get_instance(pb::GetInstanceRequest {
            id: first_id.clone(),
        })
        .await
        .expect_err("the stuck instance was deleted at the provider");
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");
}

#[tokio::test]
async fn a_proxy_with_a_mistyped_provider_is_deleted_without_an_annotation() {
    let h = Harness::start("typo", None).await;
    h.create("egress", "refrence").await;
    let failed = h.wait_phase("egress", Phase::Failed).await;
    let status = failed.status.unwrap();
    assert!(
        status.last_error.unwrap().contains("refrence"),
        "the error names the provider"
    );
    assert_eq!(status.instance_key, None, "nothing was ever created");
    assert_eq!(
        failed.metadata.finalizers, None,
        "no finalizer before a call that may create an instance"
    );
    h.proxies()
        .delete("egress", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("egress").await;
}

#[tokio::test]
async fn a_missing_cloud_init_secret_is_an_event() {
    let h = Harness::start("secret-event", None).await;
    let proxy: Proxy = serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": "egress"},
        "spec": {
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "cloudInit": {"userDataSecretRef": {"name": "absent", "key": "user-data"}},
        },
    }))
    .unwrap();
    h.proxies()
        .create(&PostParams::default(), &proxy)
        .await
        .unwrap();
    h.wait_event(
        "egress",
        |reason, note| reason == "CloudInitSecretUnavailable" && note.contains("absent"),
        "CloudInitSecretUnavailable",
    )
    .await;
    // The Event goes out before the status that follows it is written: wait for that.
    let waiting = h
        .wait_for("egress", "a status", |p| p.status.is_some())
        .await;
    assert_eq!(
        waiting.status.unwrap().phase,
        Some(Phase::Pending),
        "a Proxy waiting for its Secret is Pending"
    );
}

#[tokio::test]
async fn a_provider_side_permanent_error_is_retried_slowly_until_fixed() {
    let h = Harness::start("slow-retry", Some(Duration::from_secs(2))).await;
    h.fail_next_create("image checksum mismatch in the agent's config")
        .await;
    h.create("egress", "reference").await;
    let failed = h.wait_phase("egress", Phase::Failed).await;
    assert!(
        failed
            .status
            .unwrap()
            .last_error
            .unwrap()
            .contains("checksum mismatch")
    );
    // The fault was used up: the agent's config is fixed. No spec change follows.
    h.wait_phase("egress", Phase::Ready).await;
}

#[tokio::test]
async fn the_retry_annotation_retries_a_failed_proxy_at_once() {
    let h = Harness::start("retry-now", None).await;
    h.fail_next_create("image URL answered 404").await;
    h.create("egress", "reference").await;
    let failed = h.wait_phase("egress", Phase::Failed).await;
    let error = failed.status.unwrap().last_error.unwrap();
    let command = format!(
        "kubectl annotate proxy -n {} egress --overwrite egressproxy.dev/reconcile-requested-at=",
        h.env.namespace
    );
    assert!(
        error.contains("image URL answered 404") && error.contains(&command),
        "the message says how to retry at once: {error}"
    );
    let retry = serde_json::json!({"metadata": {"annotations": {
        "egressproxy.dev/reconcile-requested-at": "2026-11-30T12:00:00Z"
    }}});
    h.proxies()
        .patch("egress", &PatchParams::default(), &Patch::Merge(&retry))
        .await
        .unwrap();
    // The default slow retry is minutes away: only the annotation can make it Ready.
    h.wait_phase("egress", Phase::Ready).await;
}

#[tokio::test]
async fn an_exact_repeat_joins_its_series_and_a_new_note_is_a_new_event() {
    use egressproxy_operator::k8s::events::EventType;
    let h = Harness::start("series", None).await;
    h.create("egress", "refrence").await;
    let proxy = h.wait_phase("egress", Phase::Failed).await;
    for note in ["instance a", "instance a", "instance b"] {
        h.ctx
            .publish(&proxy, EventType::Normal, "Probe", note)
            .await;
    }
    let events: Api<Event> = h.env.namespaced();
    let mut probes: Vec<(String, i32)> = events
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("Probe"))
        .map(|e| {
            let count = e.series.map_or(1, |s| s.count);
            (e.note.unwrap_or_default(), count)
        })
        .collect();
    probes.sort();
    assert_eq!(
        probes,
        [("instance a".to_owned(), 2), ("instance b".to_owned(), 1)]
    );
}
