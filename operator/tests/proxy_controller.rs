//! The Proxy controller against a real kube-apiserver and the reference provider
//! running as a separate process. Each test has its own namespace, provider process
//! and controller (watching only that namespace). Waits watch the apiserver for the
//! awaited change; where nothing changes, they count the provider's calls.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::fixtures::instance_request;
use common::{Controller, WAIT, eventually, reference_config, wait_for_proxy};
use egressproxy_integration::eventually::count_reached;
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::context::Context;
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_operator::k8s::watch_scope::WatchScope;
use egressproxy_provider::pb;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use futures::TryStreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};

struct Harness {
    env: KubeTestEnv,
    provider: ReferenceProvider,
    cluster: String,
    ctx: Arc<Context>,
    _controller: Controller,
}

impl Harness {
    async fn start(test: &str) -> Harness {
        Self::start_with(test, &[]).await
    }

    async fn start_with(test: &str, provider_args: &[&str]) -> Harness {
        let args = [&["--provisioning-delay", "300ms"], provider_args].concat();
        Self::around(test, ReferenceProvider::start(&args).unwrap()).await
    }

    /// With a provider that keeps addresses for address identities. Its addresses lie
    /// in TEST-NET-1, where no proxy answers: its Proxies get addresses, never Ready.
    async fn keeping_addresses(test: &str, provider_args: &[&str]) -> Harness {
        let args = [&["--provisioning-delay", "300ms"], provider_args].concat();
        let provider = ReferenceProvider::start_keeping_addresses(&args).unwrap();
        Self::around(test, provider).await
    }

    async fn around(test: &str, provider: ReferenceProvider) -> Harness {
        let env = common::env_with_crd(test).await;
        let cluster = format!("test-{}", env.namespace);
        let controller =
            Controller::start(&env, &reference_config(provider.endpoint(), "5s"), &cluster);
        Harness {
            env,
            provider,
            cluster,
            ctx: controller.ctx.clone(),
            _controller: controller,
        }
    }

    fn proxies(&self) -> Api<Proxy> {
        self.env.namespaced()
    }

    /// Creates Proxy `name` (see [`proxy`]).
    async fn create(&self, name: &str, port: u16, extra_spec: serde_json::Value) {
        self.proxies()
            .create(&PostParams::default(), &proxy(name, port, extra_spec))
            .await
            .unwrap();
    }

    async fn provider_client(&self) -> egressproxy_provider::client::Client {
        egressproxy_provider::client::connect_lazy(
            &egressproxy_provider::client::ClientOptions::new(self.provider.endpoint()),
        )
        .unwrap()
    }

    /// Creates an instance at the provider directly, as a lost or foreign Create would
    /// have; returns its id.
    async fn create_instance(&self, request: pb::CreateInstanceRequest) -> String {
        self.provider_client()
            .await
            .create_instance(request)
            .await
            .unwrap()
            .into_inner()
            .instance
            .unwrap()
            .id
    }

    async fn control(&self) -> ControlServiceClient<tonic::transport::Channel> {
        ControlServiceClient::connect(self.provider.endpoint().to_owned())
            .await
            .unwrap()
    }

    async fn instances(&self) -> Vec<pb::Instance> {
        let request = pb::ListInstancesRequest {
            tag_selector: [("egressproxy.dev/cluster".to_string(), self.cluster.clone())].into(),
            ..Default::default()
        };
        self.provider_client()
            .await
            .list_instances(request)
            .await
            .unwrap()
            .into_inner()
            .instances
    }

    /// Waits until `check` holds for the named Proxy, or panics with its last status.
    async fn wait_for(&self, name: &str, what: &str, check: impl Fn(&Proxy) -> bool) -> Proxy {
        wait_for_proxy(&self.proxies(), name, what, check).await
    }

    /// Waits until the Proxy's Ready condition has `reason`.
    async fn wait_reason(&self, name: &str, reason_: &str) -> Proxy {
        self.wait_for(name, reason_, |p| {
            reason(p, "Ready").as_deref() == Some(reason_)
        })
        .await
    }

    async fn wait_ready(&self, name: &str) -> Proxy {
        self.wait_for(name, "Ready", |p| {
            phase(p) == Some(Phase::Ready) && condition(p, "Ready") == Some("True".into())
        })
        .await
    }

    /// Waits until an Event with `reason` about Proxy `name` exists (watching Events).
    async fn wait_event(&self, name: &str, reason: &str) {
        let events: Api<Event> = Api::namespaced(self.env.client.clone(), &self.env.namespace);
        let seen = std::cell::RefCell::new(Vec::new());
        let found = watcher(events, watcher::Config::default())
            .applied_objects()
            .try_filter(|event| {
                let about = event.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name);
                if about {
                    seen.borrow_mut()
                        .push(event.reason.clone().unwrap_or_default());
                }
                std::future::ready(about && event.reason.as_deref() == Some(reason))
            });
        let mut found = std::pin::pin!(found);
        let outcome = tokio::time::timeout(WAIT, found.try_next()).await;
        assert!(
            matches!(outcome, Ok(Ok(Some(_)))),
            "no {reason} event for {name}: {:?}",
            seen.borrow()
        );
    }

    /// Waits until the provider has answered `calls` more calls of `method` than now,
    /// so that as many reconciles of a steady Proxy have run.
    async fn wait_calls(&self, method: &str, calls: u64) {
        let target = call_count(self, method).await + calls;
        let what = format!("{calls} more {method} calls");
        eventually(&what, WAIT, || async {
            count_reached(call_count(self, method).await, target, "calls")
        })
        .await;
    }

    /// Waits until Proxy `name` is gone (its finalizer removed).
    async fn wait_deleted(&self, name: &str, what: &str) {
        common::wait_until(&self.proxies(), name, what, |p: Option<&Proxy>| p.is_none()).await;
    }
}

fn phase(proxy: &Proxy) -> Option<Phase> {
    proxy.status.as_ref().and_then(|s| s.phase)
}

fn condition(proxy: &Proxy, type_: &str) -> Option<String> {
    let status = proxy.status.as_ref()?;
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.status.clone())
}

fn reason(proxy: &Proxy, type_: &str) -> Option<String> {
    let status = proxy.status.as_ref()?;
    status
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| c.reason.clone())
}

/// A stand-in for the VM's proxy: the reference provider's instances report
/// 127.0.0.1, so a listener there answers the health check.
async fn proxy_port() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            drop(stream);
        }
    });
    port
}

/// The placement every test Proxy asks for.
fn small_placement() -> pb::Placement {
    pb::Placement {
        location: None,
        machine_type: "small".into(),
        image: "debian-12".into(),
    }
}

fn proxy(name: &str, port: u16, extra_spec: serde_json::Value) -> Proxy {
    let mut spec = serde_json::json!({
        "provider": "reference",
        "placement": {"machineType": "small", "image": "debian-12"},
        "proxyPort": port,
        "healthCheck": {"periodSeconds": 2, "timeoutSeconds": 1, "failureThreshold": 2},
    });
    merge(&mut spec, extra_spec);
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap()
}

fn merge(base: &mut serde_json::Value, patch: serde_json::Value) {
    match (base, patch) {
        (serde_json::Value::Object(base), serde_json::Value::Object(patch)) => {
            for (key, value) in patch {
                merge(base.entry(key).or_insert(serde_json::Value::Null), value);
            }
        }
        (base, patch) => *base = patch,
    }
}

#[tokio::test]
async fn a_proxy_becomes_ready_and_its_instance_goes_with_it() {
    let h = Harness::start("ready").await;
    let port = proxy_port().await;
    h.create("egress", port, serde_json::json!({})).await;
    let ready = h.wait_ready("egress").await;
    let status = ready.status.clone().unwrap();
    assert_eq!(status.addresses[0].address, "127.0.0.1");
    assert_eq!(
        ready.metadata.finalizers.as_deref(),
        Some(&["egressproxy.dev/instance".to_string()][..])
    );
    assert_eq!(status.observed_generation, ready.metadata.generation);
    let instances = h.instances().await;
    assert_eq!(instances.len(), 1);
    let instance = &instances[0];
    assert_eq!(Some(&instance.id), status.provider_id.as_ref());
    assert_eq!(instance.tags["egressproxy.dev/namespace"], h.env.namespace);
    assert_eq!(instance.tags["egressproxy.dev/name"], "egress");
    assert_eq!(
        Some(&instance.tags["egressproxy.dev/uid"]),
        ready.metadata.uid.as_ref()
    );
    h.wait_event("egress", "Created").await;

    h.proxies()
        .delete("egress", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_deleted("egress", "the finalizer to be removed")
        .await;
    assert!(
        h.instances().await.is_empty(),
        "the instance must be deleted with its Proxy"
    );
}

/// Before, the status recorded only the placement asked for, which names no host
/// when the provider chooses one: where the VM ran was nowhere in the cluster.
#[tokio::test]
async fn the_status_names_the_host_the_provider_chose() {
    // The provider puts an instance without a location on the host with the most
    // room: h1, not the first one listed.
    let h = Harness::start_with("location", &["--hosts", "h0,h1", "--max-instances", "h0=2"]).await;
    let port = proxy_port().await;
    h.create("egress", port, serde_json::json!({})).await;
    let ready = h.wait_ready("egress").await;
    let status = ready.status.unwrap();
    let asked = status.placement.expect("the placement asked for");
    assert_eq!((asked.host, asked.zone), (None, None));
    let location = status.location.expect("status.location");
    assert_eq!(
        (location.host.as_deref(), location.zone.as_deref()),
        (Some("h1"), None)
    );
    let instances = h.instances().await;
    let reported = instances[0].placement.as_ref().unwrap();
    assert_eq!(
        reported.location,
        Some(pb::placement::Location::Host("h1".into()))
    );
}

#[tokio::test]
async fn invalid_specs_are_rejected_by_the_api_server() {
    let h = Harness::start("invalid").await;
    let cases = [
        (serde_json::json!({"proxyPort": 0}), "spec.proxyPort"),
        (
            serde_json::json!({"placement": {"host": "a", "zone": "b"}}),
            "set placement.host or placement.zone, not both",
        ),
        (
            serde_json::json!({"cloudInit": {"userData": "#cloud-config", "userDataSecretRef": {"name": "s", "key": "k"}}}),
            "set exactly one of cloudInit.userData and cloudInit.userDataSecretRef",
        ),
        (
            serde_json::json!({"healthCheck": {"type": "Http"}}),
            "healthCheck.url is required when healthCheck.type is Http",
        ),
        (
            serde_json::json!({"placement": {"machineType": ""}}),
            "spec.placement.machineType",
        ),
    ];
    for (i, (spec, message)) in cases.into_iter().enumerate() {
        let error = h
            .proxies()
            .create(
                &PostParams::default(),
                &proxy(&format!("bad-{i}"), 3128, spec),
            )
            .await
            .unwrap_err();
        assert!(
            error.to_string().contains(message),
            "case {i}: {message:?} not in {error}"
        );
    }

    h.create("fixed", 3128, serde_json::json!({})).await;
    let change = serde_json::json!({"spec": {"placement": {"machineType": "medium"}}});
    let error = h
        .proxies()
        .patch("fixed", &PatchParams::default(), &Patch::Merge(&change))
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("spec.placement is immutable"),
        "{error}"
    );
}

#[tokio::test]
async fn a_permanent_error_waits_for_a_fixed_spec() {
    let h = Harness::start("permanent").await;
    let port = proxy_port().await;
    let spec = serde_json::json!({"placement": {"image": "no-such-image"}, "placementUpdatePolicy": "Replace"});
    h.create("egress", port, spec).await;
    let failed = h
        .wait_for("egress", "Failed", |p| phase(p) == Some(Phase::Failed))
        .await;
    assert_eq!(reason(&failed, "Ready").as_deref(), Some("InvalidSpec"));
    let error = failed.status.unwrap().last_error.unwrap();
    assert!(
        error.contains("placement.image") && error.contains("debian-12"),
        "{error}"
    );
    assert!(
        !error.contains("reconcile-requested-at"),
        "a fixed spec retries by itself, no annotation needed: {error}"
    );
    h.wait_event("egress", "InvalidSpec").await;
    let calls = total_calls(&h).await;
    // The absence of a retry shows only over time: a backoff retry would come within
    // 1 s, so 2 s without a call is the proof, not a wait for something to happen.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        total_calls(&h).await,
        calls,
        "a permanent error must not be retried"
    );

    let fix = serde_json::json!({"spec": {"placement": {"image": "debian-12"}}});
    h.proxies()
        .patch("egress", &PatchParams::default(), &Patch::Merge(&fix))
        .await
        .unwrap();
    let ready = h.wait_ready("egress").await;
    assert_eq!(ready.status.unwrap().last_error, None);
}

async fn total_calls(h: &Harness) -> u64 {
    let counts = h
        .control()
        .await
        .get_call_counts(control::GetCallCountsRequest {})
        .await
        .unwrap()
        .into_inner()
        .counts;
    counts.values().sum()
}

async fn call_count(h: &Harness, method: &str) -> u64 {
    let counts = h
        .control()
        .await
        .get_call_counts(control::GetCallCountsRequest {})
        .await
        .unwrap()
        .into_inner()
        .counts;
    counts.get(method).copied().unwrap_or_default()
}

#[tokio::test]
async fn an_unavailable_provider_is_retried_until_it_answers() {
    let h = Harness::start("unavailable").await;
    h.control()
        .await
        .inject_fault(control::InjectFaultRequest {
            method: "CreateInstance".into(),
            count: Some(3),
            effect: Some(control::inject_fault_request::Effect::Fail(
                control::ErrorClass::Transient.into(),
            )),
            message: "hypervisor unreachable".into(),
            retry_after: None,
        })
        .await
        .unwrap();
    let port = proxy_port().await;
    h.create("egress", port, serde_json::json!({})).await;
    let waiting = h.wait_reason("egress", "ProviderUnavailable").await;
    assert!(
        waiting
            .status
            .unwrap()
            .last_error
            .unwrap()
            .contains("hypervisor unreachable")
    );
    h.wait_ready("egress").await;
    assert_eq!(
        call_count(&h, "CreateInstance").await,
        4,
        "three failures, then one success"
    );
    assert_eq!(h.instances().await.len(), 1);
}

#[tokio::test]
async fn a_stopped_instance_is_replaced() {
    let h = Harness::start("stopped").await;
    let port = proxy_port().await;
    h.create("egress", port, serde_json::json!({})).await;
    let first = h
        .wait_ready("egress")
        .await
        .status
        .unwrap()
        .provider_id
        .unwrap();
    h.control()
        .await
        .set_instance_state(control::SetInstanceStateRequest {
            id: first.clone(),
            state: pb::InstanceState::Stopped.into(),
        })
        .await
        .unwrap();
    let replaced = h
        .wait_for("egress", "a replacement", |p| {
            p.status
                .as_ref()
                .is_some_and(|s| s.provider_id.as_ref().is_some_and(|id| *id != first))
                && phase(p) == Some(Phase::Ready)
        })
        .await;
    assert_eq!(replaced.status.unwrap().replacements, 1);
    h.wait_event("egress", "InstanceStopped").await;
    let instances = h.instances().await;
    assert_eq!(
        instances.len(),
        1,
        "the stopped instance is deleted: {instances:?}"
    );
    assert_ne!(instances[0].id, first);
}

/// The replaced instance is kept in status, not in the operator's memory: an operator
/// restarted while a replacement waits out its backoff still names the old instance in
/// the `Replaced` Event.
#[tokio::test]
async fn a_replaced_event_names_the_old_instance_after_an_operator_restart() {
    let mut h = Harness::start("replaced-restart").await;
    let config = reference_config(h.provider.endpoint(), "5s");
    let scope = WatchScope::Namespaces(vec![h.env.namespace.clone()]);
    let slow = Controller::start_configured(&h.env, scope.clone(), &config, &h.cluster, |ctx| {
        let hour = Duration::from_secs(3600);
        ctx.replace_backoff = egressproxy_operator::shared::backoff::Backoff::new(hour, hour);
    });
    h._controller = slow;
    let port = proxy_port().await;
    h.create("egress", port, serde_json::json!({})).await;
    let first = h
        .wait_ready("egress")
        .await
        .status
        .unwrap()
        .provider_id
        .unwrap();
    h.control()
        .await
        .set_instance_state(control::SetInstanceStateRequest {
            id: first.clone(),
            state: pb::InstanceState::Stopped.into(),
        })
        .await
        .unwrap();
    h.wait_for("egress", "the stopped instance to be forgotten", |p| {
        p.status
            .as_ref()
            .is_some_and(|s| s.provider_id.is_none() && s.replacements == 1)
    })
    .await;

    // A new operator, with no memory of the old one, creates the replacement.
    h._controller = Controller::start_in(&h.env, scope, &config, &h.cluster);
    let events: Api<Event> = h.env.namespaced();
    let replaced = common::fixtures::wait_event(&events, "egress", "Replaced").await;
    let note = replaced.note.unwrap_or_default();
    assert!(
        note.contains(&first) && note.contains("stopped"),
        "the Replaced Event names the old instance and why: {note:?}"
    );
    let proxy = h.wait_ready("egress").await;
    assert_eq!(
        proxy.status.unwrap().replacing,
        None,
        "cleared once replaced"
    );
}

#[tokio::test]
async fn a_changed_placement_replaces_the_instance() {
    let h = Harness::start("placement").await;
    let port = proxy_port().await;
    let spec = serde_json::json!({"placementUpdatePolicy": "Replace"});
    h.create("egress", port, spec).await;
    let first = h
        .wait_ready("egress")
        .await
        .status
        .unwrap()
        .provider_id
        .unwrap();
    let change = serde_json::json!({"spec": {"placement": {"machineType": "medium"}}});
    h.proxies()
        .patch("egress", &PatchParams::default(), &Patch::Merge(&change))
        .await
        .unwrap();
    let replaced = h
        .wait_for("egress", "the new placement", |p| {
            p.status.as_ref().is_some_and(|s| {
                s.placement
                    .as_ref()
                    .is_some_and(|pl| pl.machine_type == "medium")
            }) && phase(p) == Some(Phase::Ready)
        })
        .await;
    assert_ne!(replaced.status.unwrap().provider_id.unwrap(), first);
    let instances = h.instances().await;
    assert_eq!(instances.len(), 1);
    assert_eq!(
        instances[0].placement.as_ref().unwrap().machine_type,
        "medium"
    );
    h.wait_event("egress", "Replacing").await;
}

#[tokio::test]
async fn cloud_init_comes_from_a_secret_once_it_exists() {
    let h = Harness::start("secret").await;
    let port = proxy_port().await;
    let spec = serde_json::json!({"cloudInit": {"userDataSecretRef": {"name": "egress-user-data", "key": "user-data"}}});
    h.create("egress", port, spec).await;
    let waiting = h.wait_reason("egress", "CloudInitSecretUnavailable").await;
    assert!(
        waiting
            .status
            .unwrap()
            .last_error
            .unwrap()
            .contains("egress-user-data")
    );
    assert!(
        h.instances().await.is_empty(),
        "nothing is created without its user-data"
    );

    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "egress-user-data"},
        "stringData": {"user-data": "#cloud-config\npackages: [squid]\n"},
    }))
    .unwrap();
    let secrets: Api<Secret> = h.env.namespaced();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    h.wait_ready("egress").await;
}

#[tokio::test]
async fn a_ready_proxy_whose_proxy_stops_answering_turns_degraded() {
    let h = Harness::start("degraded").await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    h.create("egress", port, serde_json::json!({})).await;
    h.wait_ready("egress").await;
    drop(listener);
    let degraded = h
        .wait_for("egress", "Degraded", |p| phase(p) == Some(Phase::Degraded))
        .await;
    assert_eq!(condition(&degraded, "Healthy").as_deref(), Some("False"));
    assert_eq!(condition(&degraded, "Provisioned").as_deref(), Some("True"));
    h.wait_event("egress", "Unhealthy").await;
    // A Proxy that stays Degraded is not rewritten at every failed check. The next
    // poll starts only once the reconcile that made it Degraded has saved; then two
    // more failed checks are counted.
    h.wait_calls("GetInstance", 1).await;
    let writes = status_writes(&h);
    h.wait_calls("GetInstance", 2).await;
    assert_eq!(
        status_writes(&h),
        writes,
        "a steady Degraded Proxy must not be rewritten"
    );
}

#[tokio::test]
async fn status_is_not_rewritten_when_nothing_changes() {
    let h = Harness::start("steady").await;
    let port = proxy_port().await;
    h.create("egress", port, serde_json::json!({})).await;
    let ready = h.wait_ready("egress").await;
    // The next poll starts only once the reconcile that made it Ready has saved.
    h.wait_calls("GetInstance", 1).await;
    let writes = status_writes(&h);
    // Three more polls of a steady Proxy (one per 2 s health-check period): counted, not
    // waited out.
    let started = std::time::Instant::now();
    h.wait_calls("GetInstance", 3).await;
    let three_polls = started.elapsed();
    assert_eq!(
        status_writes(&h),
        writes,
        "a steady Proxy must not be rewritten"
    );
    let after = h.proxies().get("egress").await.unwrap();
    assert_eq!(
        after.metadata.resource_version,
        ready.metadata.resource_version
    );
    // Load can only make polls later; polls sooner than the period would be a hot loop.
    assert!(
        three_polls >= Duration::from_secs(4),
        "one GetInstance per 2 s health period, yet three came within {three_polls:?}"
    );
    let text = h.ctx.metrics.encode();
    assert!(
        text.contains("egressproxy_proxies{phase=\"Ready\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("method=\"CreateInstance\",code=\"Ok\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn a_new_proxy_whose_instance_runs_at_once_is_ready_after_one_status_write() {
    let provider = ReferenceProvider::start(&["--provisioning-delay", "0s"]).unwrap();
    let h = Harness::around("one-write", provider).await;
    let port = proxy_port().await;
    h.create("egress", port, serde_json::json!({})).await;
    let ready = h.wait_ready("egress").await;
    // The next poll starts only once the reconcile that made it Ready has saved.
    h.wait_calls("GetInstance", 1).await;
    // The finalizer added just before the Create is what says an instance may exist;
    // the instance and Ready are then written together, with no status write before.
    assert_eq!(status_writes(&h), 1);
    assert_eq!(
        ready.metadata.finalizers.as_deref(),
        Some(&["egressproxy.dev/instance".to_string()][..])
    );
}

fn status_writes(h: &Harness) -> u64 {
    counter(h, "egressproxy_status_writes_total")
}

fn reconcile_count(h: &Harness) -> u64 {
    counter(h, "egressproxy_reconciles_total")
}

fn counter(h: &Harness, name: &str) -> u64 {
    let text = h.ctx.metrics.encode();
    let prefix = format!("{name} ");
    let line = text.lines().find(|l| l.starts_with(&prefix)).unwrap();
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn garbage_collection_deletes_only_our_orphans() {
    let h = Harness::start("gc").await;
    let port = proxy_port().await;
    h.create("live", port, serde_json::json!({})).await;
    let live = h
        .wait_ready("live")
        .await
        .status
        .unwrap()
        .provider_id
        .unwrap();
    let mut client = h.provider_client().await;
    let create = |key: &str, tags: Vec<(&str, &str)>| {
        let request = instance_request(key, &tags);
        let mut client = client.clone();
        async move {
            client
                .create_instance(request)
                .await
                .unwrap()
                .into_inner()
                .instance
                .unwrap()
                .id
        }
    };
    let ns = h.env.namespace.clone();
    let orphan = create(
        "orphan",
        vec![
            ("egressproxy.dev/cluster", &h.cluster),
            ("egressproxy.dev/namespace", &ns),
            ("egressproxy.dev/uid", "gone"),
        ],
    )
    .await;
    let elsewhere = create(
        "elsewhere",
        vec![
            ("egressproxy.dev/cluster", &h.cluster),
            ("egressproxy.dev/namespace", "other"),
            ("egressproxy.dev/uid", "x"),
        ],
    )
    .await;
    let untagged = create("untagged", vec![]).await;
    let foreign = create(
        "foreign",
        vec![
            ("egressproxy.dev/cluster", "another-cluster"),
            ("egressproxy.dev/uid", "x"),
        ],
    )
    .await;

    let sweep = |scope: WatchScope, grace: Duration| {
        let ctx = h.ctx.clone();
        async move {
            let cache = common::follow(&ctx.client, scope).await;
            egressproxy_operator::proxy::gc::sweep(&ctx, &cache, grace).await
        }
    };
    let report = sweep(WatchScope::AllNamespaces, Duration::from_secs(3600)).await;
    assert!(
        report.deleted.is_empty(),
        "the grace period protects young instances: {report:?}"
    );
    // An operator watching one namespace cannot see Proxies elsewhere: it only judges
    // its own namespace's instances.
    let report = sweep(WatchScope::Namespaces(vec![ns.clone()]), Duration::ZERO).await;
    assert_eq!(report.deleted, vec![orphan.clone()]);
    let report = sweep(WatchScope::AllNamespaces, Duration::ZERO).await;
    assert_eq!(report.deleted, vec![elsewhere.clone()]);
    for kept in [&live, &untagged, &foreign] {
        let request = pb::GetInstanceRequest { id: kept.clone() };
        client
            .get_instance(request)
            .await
            .unwrap_or_else(|e| panic!("{kept} must survive: {e}"));
    }
}

#[tokio::test]
async fn only_one_replica_holds_the_lease() {
    use egressproxy_operator::k8s::leader::{LeaseConfig, acquire};
    let env = KubeTestEnv::new("lease").await.unwrap();
    let config = |identity: &str| {
        LeaseConfig::new(
            "egressproxy-operator".into(),
            env.namespace.clone(),
            identity.into(),
            Duration::from_secs(2),
        )
    };
    let first = acquire(env.client.clone(), config("replica-a")).await;
    let second = tokio::spawn(acquire(env.client.clone(), config("replica-b")));
    // Ten renewals by the first (2.7 s, longer than the 2 s lease), counted on the Lease
    // itself, give the second many chances to take it.
    let renewals = std::cell::RefCell::new(std::collections::BTreeSet::new());
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> = env.namespaced();
    common::wait_until(
        &leases,
        common::LEASE,
        "ten renewals",
        |lease: Option<&k8s_openapi::api::coordination::v1::Lease>| {
            let spec = lease.and_then(|l| l.spec.as_ref());
            if let Some(spec) = spec
                && spec.holder_identity.as_deref() == Some("replica-a")
                && let Some(renewed) = &spec.renew_time
            {
                renewals.borrow_mut().insert(renewed.0);
            }
            renewals.borrow().len() >= 10
        },
    )
    .await;
    assert!(
        !second.is_finished(),
        "a second replica must not lead while the first renews"
    );
    drop(first);
    let mut second = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("takes over after expiry")
        .unwrap();
    let lease: k8s_openapi::api::coordination::v1::Lease =
        env.namespaced().get("egressproxy-operator").await.unwrap();
    let spec = lease.spec.unwrap();
    assert_eq!(spec.holder_identity.as_deref(), Some("replica-b"));
    assert_eq!(spec.lease_transitions, Some(1));
    let lost = tokio::time::timeout(Duration::from_secs(1), second.lost()).await;
    assert!(lost.is_err(), "the new leader keeps its lease");
}

#[tokio::test]
async fn a_provider_on_another_contract_major_version_is_refused() {
    let h = Harness::start_with("contract", &["--contract-version", "2.0.0"]).await;
    h.create("egress", 3128, serde_json::json!({})).await;
    let failed = h
        .wait_for("egress", "Failed", |p| phase(p) == Some(Phase::Failed))
        .await;
    assert_eq!(
        reason(&failed, "Ready").as_deref(),
        Some("IncompatibleProvider")
    );
    let error = failed.status.unwrap().last_error.unwrap();
    assert!(error.contains("2.0.0") && error.contains("1.x"), "{error}");
    assert_eq!(
        call_count(&h, "CreateInstance").await,
        0,
        "nothing is created on an incompatible provider"
    );
}

#[tokio::test]
async fn a_provider_that_is_down_is_retried_until_it_starts() {
    let env = common::env_with_crd("down").await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _controller = Controller::start(
        &env,
        &reference_config(&format!("http://127.0.0.1:{port}"), "2s"),
        "down",
    );
    let proxies: Api<Proxy> = env.namespaced();
    let proxy_port = proxy_port().await;
    proxies
        .create(
            &PostParams::default(),
            &proxy("egress", proxy_port, serde_json::json!({})),
        )
        .await
        .unwrap();

    let waiting = wait_for_proxy(
        &proxies,
        "egress",
        "the provider reported unavailable",
        |current| reason(current, "Ready").as_deref() == Some("ProviderUnavailable"),
    )
    .await;
    assert_ne!(
        phase(&waiting),
        Some(Phase::Failed),
        "an unreachable provider is not a permanent failure"
    );

    let _provider = ReferenceProvider::start_at(
        &format!("127.0.0.1:{port}"),
        &["--provisioning-delay", "0s"],
    )
    .unwrap();
    wait_for_proxy(
        &proxies,
        "egress",
        "Ready once the provider started",
        |current| phase(current) == Some(Phase::Ready),
    )
    .await;
}

#[tokio::test]
async fn a_proxy_whose_provider_is_gone_keeps_its_finalizer_until_abandoned() {
    let h = Harness::start("gone").await;
    let spec = serde_json::json!({"provider": "retired"});
    h.create("orphaned", 3128, spec).await;
    let failed = h
        .wait_for("orphaned", "Failed", |p| phase(p) == Some(Phase::Failed))
        .await;
    assert_eq!(
        reason(&failed, "Ready").as_deref(),
        Some("ProviderNotConfigured")
    );
    // An instance made while the provider was still configured, and the finalizer
    // added before it was made.
    let finalizer = serde_json::json!({"metadata": {"finalizers": [
        egressproxy_operator::proxy::reconcile::FINALIZER
    ]}});
    h.proxies()
        .patch(
            "orphaned",
            &PatchParams::default(),
            &Patch::Merge(&finalizer),
        )
        .await
        .unwrap();
    let recorded =
        serde_json::json!({"status": {"providerId": "vm-on-retired", "instanceKey": "k-0"}});
    h.proxies()
        .patch_status(
            "orphaned",
            &PatchParams::default(),
            &Patch::Merge(&recorded),
        )
        .await
        .unwrap();

    h.proxies()
        .delete("orphaned", &DeleteParams::default())
        .await
        .unwrap();
    let stuck = h
        .wait_for("orphaned", "the deletion to be refused", |p| {
            p.status
                .as_ref()
                .and_then(|s| s.last_error.as_deref())
                .is_some_and(|e| e.contains("abandon-instance"))
        })
        .await;
    assert!(stuck.metadata.deletion_timestamp.is_some());
    assert_eq!(phase(&stuck), Some(Phase::Deleting));
    h.wait_event("orphaned", "DeleteFailed").await;
    // Two more attempts at the deletion, counted, rather than a fixed wait.
    let target = reconcile_count(&h) + 2;
    eventually("the deletion to be retried twice", WAIT, || async {
        count_reached(reconcile_count(&h), target, "reconciles")
    })
    .await;
    assert!(
        h.proxies().get_opt("orphaned").await.unwrap().is_some(),
        "the finalizer must hold without the annotation"
    );

    let abandon = serde_json::json!({"metadata": {"annotations": {"egressproxy.dev/abandon-instance": "true"}}});
    h.proxies()
        .patch("orphaned", &PatchParams::default(), &Patch::Merge(&abandon))
        .await
        .unwrap();
    h.wait_deleted("orphaned", "the annotation to release the finalizer")
        .await;
}

/// Creates Proxy `egress`, whose cloud-init Secret does not exist yet, and plants an
/// instance under its first key, tagged with `cluster` and its UID, from other
/// user-data. Then creates the Secret, so the Proxy's own Create meets that key taken.
/// Returns the Proxy's UID and the planted instance's id.
async fn plant_under_first_key(h: &Harness, cluster: &str) -> (String, String) {
    let port = proxy_port().await;
    let spec =
        serde_json::json!({"cloudInit": {"userDataSecretRef": {"name": "user-data", "key": "v"}}});
    h.create("egress", port, spec).await;
    let waiting = h
        .wait_for("egress", "the Secret to be missing", |p| {
            reason(p, "Ready").as_deref() == Some("CloudInitSecretUnavailable")
        })
        .await;
    let uid = waiting.metadata.uid.clone().unwrap();
    let request = pb::CreateInstanceRequest {
        key: format!("{uid}-0"),
        tags: [
            ("egressproxy.dev/cluster".to_string(), cluster.to_string()),
            ("egressproxy.dev/uid".to_string(), uid.clone()),
        ]
        .into(),
        placement: Some(small_placement()),
        cloud_init: Some(pb::CloudInit {
            user_data: b"#cloud-config\n# planted\n".to_vec(),
            vendor_data: None,
        }),
        proxy_port: u32::from(port),
        ..Default::default()
    };
    let planted = h.create_instance(request).await;
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "user-data"},
        "stringData": {"v": "#cloud-config\n# the Proxy's own\n"},
    }))
    .unwrap();
    let secrets: Api<Secret> = h.env.namespaced();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    (uid, planted)
}

#[tokio::test]
async fn a_key_taken_by_an_instance_of_someone_else_is_left_alone() {
    let h = Harness::start("taken").await;
    // Tagged by another cluster's operator: not this Proxy's.
    let (uid, theirs) = plant_under_first_key(&h, "another").await;
    let ready = h.wait_ready("egress").await;
    assert_eq!(ready.status.unwrap().instance_key, Some(format!("{uid}-1")));
    h.wait_event("egress", "InstanceKeyTaken").await;
    let ours = h.instances().await;
    assert_eq!(ours.len(), 1, "{ours:?}");
    let theirs = h
        .provider_client()
        .await
        .get_instance(pb::GetInstanceRequest { id: theirs })
        .await;
    assert!(
        theirs.is_ok(),
        "the other cluster's instance survives: {theirs:?}"
    );
}

#[tokio::test]
async fn an_instance_left_by_an_unfinished_attempt_with_an_older_spec_is_replaced() {
    let h = Harness::start("stale").await;
    // An earlier attempt's instance: this cluster's, this Proxy's, another spec.
    let (uid, stale) = plant_under_first_key(&h, &h.cluster).await;
    let ready = h.wait_ready("egress").await;
    assert_eq!(ready.status.unwrap().instance_key, Some(format!("{uid}-1")));
    h.wait_event("egress", "StaleAttemptReplaced").await;
    let instances = h.instances().await;
    assert_eq!(instances.len(), 1, "{instances:?}");
    assert_ne!(instances[0].id, stale);
}

fn first_address(proxy: &Proxy) -> Option<String> {
    Some(proxy.status.as_ref()?.addresses.first()?.address.clone())
}

fn provider_id(proxy: &Proxy) -> Option<String> {
    proxy.status.as_ref()?.provider_id.clone()
}

#[tokio::test]
async fn a_replacement_keeps_the_proxy_s_address() {
    // The old instance stays DELETING for a while, so the replacement's first Create
    // finds the address still held and must wait for it.
    let h = Harness::keeping_addresses("keep-address", &["--deleting-delay", "6s"]).await;
    h.create("egress", 9, serde_json::json!({})).await;
    let first = h
        .wait_for("egress", "an address", |p| first_address(p).is_some())
        .await;
    let (first_id, address) = (provider_id(&first).unwrap(), first_address(&first).unwrap());
    let instance = h
        .provider_client()
        .await
        .get_instance(pb::GetInstanceRequest {
            id: first_id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .instance
        .unwrap();
    assert_eq!(
        instance.address_identity, first.metadata.uid,
        "the identity is the UID"
    );

    h.control()
        .await
        .set_instance_state(control::SetInstanceStateRequest {
            id: first_id.clone(),
            state: pb::InstanceState::Stopped.into(),
        })
        .await
        .unwrap();
    let waiting = h.wait_reason("egress", "WaitingForOldInstance").await;
    let message = waiting.status.unwrap().conditions;
    assert!(
        message
            .iter()
            .any(|c| c.type_ == "Ready" && c.message.contains(&first_id)),
        "the status names the instance it waits for: {message:?}"
    );
    let replaced = h
        .wait_for("egress", "a replacement with an address", |p| {
            provider_id(p).is_some_and(|id| id != first_id) && first_address(p).is_some()
        })
        .await;
    assert_eq!(
        first_address(&replaced).as_deref(),
        Some(address.as_str()),
        "the replacement got the address back"
    );
}

/// The instance is deleted behind the operator's back: the Proxy waits while the
/// provider deletes it, then creates a replacement with the same identity, which gets
/// the same address.
#[tokio::test]
async fn a_replacement_of_a_deleted_instance_keeps_the_proxy_s_address() {
    let h = Harness::keeping_addresses("deleted-keeps", &["--deleting-delay", "2s"]).await;
    h.create("egress", 9, serde_json::json!({})).await;
    let first = h
        .wait_for("egress", "an address", |p| first_address(p).is_some())
        .await;
    let (first_id, address) = (provider_id(&first).unwrap(), first_address(&first).unwrap());
    h.provider_client()
        .await
        .delete_instance(pb::DeleteInstanceRequest {
            id: first_id.clone(),
        })
        .await
        .unwrap();
    let replaced = h
        .wait_for("egress", "a replacement with an address", |p| {
            provider_id(p).is_some_and(|id| id != first_id) && first_address(p).is_some()
        })
        .await;
    assert_eq!(
        first_address(&replaced).as_deref(),
        Some(address.as_str()),
        "the replacement got the address back"
    );
    assert!(
        address.starts_with("192.0.2."),
        "{address} is the identity's, from the provider's range"
    );
    h.wait_event("egress", "InstanceVanished").await;
}

#[tokio::test]
async fn a_proxy_gets_the_address_it_asks_for_and_a_taken_one_is_reported() {
    let h = Harness::keeping_addresses("ask-address", &[]).await;
    let asking = serde_json::json!({"egress": {"address": "192.0.2.77"}});
    h.create("egress", 9, asking.clone()).await;
    let granted = h
        .wait_for("egress", "an address", |p| first_address(p).is_some())
        .await;
    assert_eq!(first_address(&granted).as_deref(), Some("192.0.2.77"));

    // Another Proxy asking for it is told the address is taken; it is not mistaken
    // for its own key being taken (which would try key after key).
    h.create("thief", 9, asking).await;
    let refused = h.wait_reason("thief", "AddressTaken").await;
    assert_eq!(phase(&refused), Some(Phase::Failed));
    let thief_uid = refused.metadata.uid.unwrap();
    let of_thief: Vec<_> = h
        .instances()
        .await
        .into_iter()
        .filter(|i| i.tags.get("egressproxy.dev/uid") == Some(&thief_uid))
        .collect();
    assert_eq!(of_thief, [], "the refused Proxy made no instance");
    assert_eq!(
        refused.status.unwrap().instance_key.as_deref(),
        Some(&*format!("{thief_uid}-0"))
    );

    h.create(
        "typo",
        9,
        serde_json::json!({"egress": {"address": "192.0.2.300"}}),
    )
    .await;
    let typo = h.wait_reason("typo", "InvalidSpec").await;
    let ready = typo.status.unwrap().conditions;
    assert!(
        ready.iter().any(|c| c.type_ == "Ready"
            && c.message
                .contains("spec.egress.address: \"192.0.2.300\" is not an IP address")),
        "{ready:?}"
    );
}

#[tokio::test]
async fn a_provider_without_kept_addresses_gets_no_identity_and_refuses_a_chosen_address() {
    let h = Harness::start("no-kept-address").await;
    let port = proxy_port().await;
    h.create("plain", port, serde_json::json!({})).await;
    h.wait_ready("plain").await;
    let instances = h.instances().await;
    assert_eq!(instances.len(), 1);
    assert_eq!(instances[0].address_identity, None);

    h.create(
        "asking",
        port,
        serde_json::json!({"egress": {"address": "192.0.2.77"}}),
    )
    .await;
    let refused = h.wait_reason("asking", "InvalidSpec").await;
    assert_eq!(phase(&refused), Some(Phase::Failed));
    let ready = refused.status.unwrap().conditions;
    assert!(
        ready.iter().any(|c| c.type_ == "Ready"
            && c.message
                .contains("spec.egress.address: provider reference cannot")),
        "{ready:?}"
    );
    assert_eq!(
        h.instances().await.len(),
        1,
        "no instance for the refused Proxy"
    );
}

/// A Proxy holding the finalizer may have an instance its status never recorded (the
/// operator stopped between the Create and the status write that follows it): its
/// deletion finds that instance by its tags and deletes it.
#[tokio::test]
async fn deleting_a_proxy_that_holds_the_finalizer_deletes_an_instance_its_status_never_recorded() {
    let h = Harness::start("unrecorded").await;
    let port = proxy_port().await;
    // An image no host offers stops every reconcile before a Create, so the instance
    // made below stands alone for the one whose Create answer was lost.
    let mut held = proxy(
        "egress",
        port,
        serde_json::json!({"placement": {"image": "no-such-image"}}),
    );
    held.metadata.finalizers = Some(vec![
        egressproxy_operator::proxy::reconcile::FINALIZER.to_owned(),
    ]);
    h.proxies()
        .create(&PostParams::default(), &held)
        .await
        .unwrap();
    let failed = h
        .wait_for("egress", "Failed", |p| phase(p) == Some(Phase::Failed))
        .await;
    let status = failed.status.clone().unwrap();
    assert_eq!((status.instance_key, status.provider_id), (None, None));
    let uid = failed.metadata.uid.clone().unwrap();
    let request = pb::CreateInstanceRequest {
        key: format!("{uid}-0"),
        tags: [
            ("egressproxy.dev/cluster", h.cluster.as_str()),
            ("egressproxy.dev/namespace", h.env.namespace.as_str()),
            ("egressproxy.dev/name", "egress"),
            ("egressproxy.dev/uid", uid.as_str()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect(),
        placement: Some(small_placement()),
        proxy_port: u32::from(port),
        ..Default::default()
    };
    let lost = h.create_instance(request).await;

    h.proxies()
        .delete("egress", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_deleted("egress", "the Proxy gone").await;
    let left: Vec<String> = h.instances().await.into_iter().map(|i| i.id).collect();
    assert!(
        !left.contains(&lost),
        "the unrecorded instance {lost} leaked: {left:?}"
    );
}
