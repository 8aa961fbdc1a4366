//! Garbage collection of an instance that a live Proxy no longer uses, against a real
//! kube-apiserver and the reference provider: a VM the operator saw vanish (GetInstance
//! answered NOT_FOUND once) and replaced, which then turns out to exist after all (a
//! hypervisor that came back), is collected; the Proxy's current VM is not.

mod common;

use std::time::Duration;

use common::fixtures::{proxy, proxy_port};
use common::{Controller, reference_config, wait_until};
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_provider::pb;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use kube::api::{Api, PostParams};

fn ready_with(proxy: Option<&Proxy>, instance: impl Fn(&str) -> bool) -> bool {
    proxy.and_then(|p| p.status.as_ref()).is_some_and(|s| {
        s.phase == Some(Phase::Ready) && s.provider_id.as_deref().is_some_and(&instance)
    })
}

#[tokio::test]
async fn an_instance_that_vanished_and_came_back_is_collected_while_its_proxy_lives() {
    let env = common::env_with_crd("gc-superseded").await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "100ms"]).unwrap();
    let cluster = format!("test-{}", env.namespace);
    let controller =
        Controller::start(&env, &reference_config(provider.endpoint(), "5s"), &cluster);
    let proxies: Api<Proxy> = env.namespaced();
    let port = proxy_port().await;
    proxies
        .create(
            &PostParams::default(),
            &proxy("egress", port, serde_json::json!({})),
        )
        .await
        .unwrap();
    let first = wait_until(
        &proxies,
        "egress",
        "the first VM Ready",
        |p: Option<&Proxy>| ready_with(p, |_| true),
    )
    .await
    .unwrap();
    let first = first.status.unwrap().provider_id.unwrap();

    // The provider loses sight of it once: the operator replaces it.
    let mut control = ControlServiceClient::connect(provider.endpoint().to_owned())
        .await
        .unwrap();
    control
        .inject_fault(control::InjectFaultRequest {
            method: "GetInstance".into(),
            count: Some(1),
            effect: Some(control::inject_fault_request::Effect::Fail(
                control::ErrorClass::NotFound.into(),
            )),
            message: "host unreachable".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let replaced = wait_until(
        &proxies,
        "egress",
        "a replacement VM Ready",
        |p: Option<&Proxy>| ready_with(p, |id| id != first),
    )
    .await
    .unwrap();
    let second = replaced.status.unwrap().provider_id.unwrap();

    let report =
        egressproxy_operator::proxy::gc::sweep(&controller.ctx, &controller.cache, Duration::ZERO)
            .await;
    assert_eq!(report.deleted, vec![first.clone()], "{report:?}");
    let mut client = egressproxy_provider::client::connect_lazy(
        &egressproxy_provider::client::ClientOptions::new(provider.endpoint()),
    )
    .unwrap();
    client
        .get_instance(pb::GetInstanceRequest { id: second })
        .await
        .expect("the Proxy's current VM survives");
    let gone = client
        .get_instance(pb::GetInstanceRequest { id: first })
        .await;
    assert_eq!(gone.unwrap_err().code(), tonic::Code::NotFound);
}
