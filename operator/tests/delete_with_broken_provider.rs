//! Deleting a Proxy whose provider is configured but broken, against a real
//! kube-apiserver and the reference provider (its fault injection makes ListInstances
//! unimplemented; killing it makes it unreachable). The deletion is refused with an
//! Event that names the way out, the abandon annotation takes it, and the VM that is
//! left behind is named in an `InstanceAbandoned` Event, never dropped silently.

mod common;

use common::fixtures::{proxy, proxy_port, wait_event};
use common::{Controller, reference_config, wait_until};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};

const ABANDON: &str = "egressproxy.dev/abandon-instance";

struct Setup {
    env: KubeTestEnv,
    provider: ReferenceProvider,
    _controller: Controller,
    /// The Ready Proxy's UID and instance id.
    uid: String,
    instance: String,
}

/// A Ready Proxy `egress`.
async fn ready_proxy(test: &str) -> Setup {
    let env = common::env_with_crd(test).await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "100ms"]).unwrap();
    let cluster = format!("test-{}", env.namespace);
    let controller =
        Controller::start(&env, &reference_config(provider.endpoint(), "2s"), &cluster);
    let proxies: Api<Proxy> = env.namespaced();
    let port = proxy_port().await;
    proxies
        .create(
            &PostParams::default(),
            &proxy("egress", port, serde_json::json!({})),
        )
        .await
        .unwrap();
    let ready = wait_until(
        &proxies,
        "egress",
        "egress to be Ready",
        |p: Option<&Proxy>| {
            p.and_then(|p| p.status.as_ref())
                .is_some_and(|s| s.phase == Some(Phase::Ready))
        },
    )
    .await
    .unwrap();
    Setup {
        uid: ready.metadata.uid.clone().unwrap(),
        instance: ready.status.unwrap().provider_id.unwrap(),
        env,
        provider,
        _controller: controller,
    }
}

/// Deletes `egress`, checks that the deletion is refused with an Event naming the
/// annotation, then annotates it and checks that it goes with an `InstanceAbandoned`
/// Event naming what was left behind.
async fn refused_then_abandoned(s: &Setup) {
    let proxies: Api<Proxy> = s.env.namespaced();
    let events: Api<Event> = s.env.namespaced();
    proxies
        .delete("egress", &DeleteParams::default())
        .await
        .unwrap();
    let refused = wait_event(&events, "egress", "DeleteFailed").await;
    let note = refused.note.unwrap_or_default();
    assert!(
        note.contains(ABANDON),
        "the Event names the way out: {note}"
    );
    assert!(
        proxies.get_opt("egress").await.unwrap().is_some(),
        "the finalizer holds while the VM cannot be deleted"
    );

    let abandon = serde_json::json!({"metadata": {"annotations": {ABANDON: "true"}}});
    proxies
        .patch("egress", &PatchParams::default(), &Patch::Merge(&abandon))
        .await
        .unwrap();
    wait_until(
        &proxies,
        "egress",
        "the annotation to release the finalizer",
        |p: Option<&Proxy>| p.is_none(),
    )
    .await;
    let abandoned = wait_event(&events, "egress", "InstanceAbandoned").await;
    let note = abandoned.note.unwrap_or_default();
    assert_eq!(abandoned.type_.as_deref(), Some("Warning"));
    for named in [&s.instance, &s.uid, "reference"] {
        assert!(note.contains(named), "the record names {named}: {note}");
    }
}

#[tokio::test]
async fn a_provider_that_cannot_list_blocks_a_delete_only_until_abandoned() {
    let s = ready_proxy("delete-list-unimplemented").await;
    let mut control = ControlServiceClient::connect(s.provider.endpoint().to_owned())
        .await
        .unwrap();
    control
        .inject_fault(control::InjectFaultRequest {
            method: "ListInstances".into(),
            count: None,
            effect: Some(control::inject_fault_request::Effect::Fail(
                control::ErrorClass::Unimplemented.into(),
            )),
            message: "listing is not supported here".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    refused_then_abandoned(&s).await;
    // The VM was left, as the annotation asked, not deleted behind the user's back.
    let mut client = egressproxy_provider::client::connect_lazy(
        &egressproxy_provider::client::ClientOptions::new(s.provider.endpoint()),
    )
    .unwrap();
    let request = egressproxy_provider::pb::GetInstanceRequest {
        id: s.instance.clone(),
    };
    client.get_instance(request).await.unwrap();
}

#[tokio::test]
async fn an_unreachable_provider_blocks_a_delete_only_until_abandoned() {
    let mut s = ready_proxy("delete-provider-down").await;
    s.provider.kill();
    refused_then_abandoned(&s).await;
}
