//! The operator binary as users run it: separate processes against a real
//! kube-apiserver and the reference provider. Covers a crash in the middle of a
//! Create and two replicas behind one leader Lease.

mod common;

use common::{OperatorOptions, OperatorProcess, WAIT, eventually, wait_for_holder};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_provider::pb;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};

/// The operator binary on `env`'s namespace with a 3 s lease.
fn start_operator(
    env: &KubeTestEnv,
    providers: &std::path::Path,
    identity: &str,
) -> OperatorProcess {
    OperatorProcess::start(
        env,
        &OperatorOptions {
            identity,
            providers,
            lease_duration: "3s",
            clock_offset: None,
            extra_args: &[],
        },
    )
}

struct Setup {
    env: KubeTestEnv,
    provider: ReferenceProvider,
    providers_file: tempfile::NamedTempFile,
}

async fn setup(test: &str) -> Setup {
    let env = common::env_with_crd(test).await;
    let provider = ReferenceProvider::start(&["--provisioning-delay", "200ms"]).unwrap();
    let providers_file = tempfile::NamedTempFile::new().unwrap();
    let config = format!(
        "providers:\n  reference:\n    endpoint: {}\n",
        provider.endpoint()
    );
    std::fs::write(providers_file.path(), config).unwrap();
    Setup {
        env,
        provider,
        providers_file,
    }
}

/// A listener standing in for the VM's proxy (instances report 127.0.0.1).
fn proxy_port() -> (std::net::TcpListener, u16) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    (listener, port)
}

fn proxy(name: &str, port: u16) -> Proxy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name},
        "spec": {
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "proxyPort": port,
            "healthCheck": {"periodSeconds": 2, "timeoutSeconds": 1},
        },
    }))
    .unwrap()
}

async fn wait_ready(api: &Api<Proxy>, name: &str) -> Proxy {
    let what = format!("{name} to become Ready");
    common::wait_until(api, name, &what, |proxy: Option<&Proxy>| {
        proxy.and_then(|p| p.status.as_ref()).and_then(|s| s.phase) == Some(Phase::Ready)
    })
    .await
    .unwrap()
}

async fn instances(provider: &ReferenceProvider) -> Vec<pb::Instance> {
    let options = egressproxy_provider::client::ClientOptions::new(provider.endpoint());
    let mut client = egressproxy_provider::client::connect_lazy(&options).unwrap();
    let request = pb::ListInstancesRequest::default();
    client
        .list_instances(request)
        .await
        .unwrap()
        .into_inner()
        .instances
}

#[tokio::test]
async fn an_operator_killed_mid_create_leaves_exactly_one_instance() {
    let s = setup("crash").await;
    let mut control = ControlServiceClient::connect(s.provider.endpoint().to_owned())
        .await
        .unwrap();
    // The provider creates the instance but holds its answer back: the operator dies
    // before it can record the provider id.
    control
        .inject_fault(control::InjectFaultRequest {
            method: "CreateInstance".into(),
            count: Some(1),
            effect: Some(control::inject_fault_request::Effect::DelayResponse(
                prost_types::Duration {
                    seconds: 30,
                    nanos: 0,
                },
            )),
            message: String::new(),
            retry_after: None,
        })
        .await
        .unwrap();
    let operator = start_operator(&s.env, s.providers_file.path(), "crashing");
    let (_listener, port) = proxy_port();
    let proxies: Api<Proxy> = s.env.namespaced();
    proxies
        .create(&PostParams::default(), &proxy("egress", port))
        .await
        .unwrap();
    eventually("the operator to call CreateInstance", WAIT, || async {
        if instances(&s.provider).await.is_empty() {
            Err("no instance at the provider")
        } else {
            Ok(())
        }
    })
    .await;
    operator.kill().await;
    let stranded = proxies.get("egress").await.unwrap();
    assert_eq!(
        stranded.status.and_then(|s| s.provider_id),
        None,
        "the crash happened before the id was recorded"
    );

    let _restarted = start_operator(&s.env, s.providers_file.path(), "restarted");
    let ready = wait_ready(&proxies, "egress").await;
    let all = instances(&s.provider).await;
    assert_eq!(
        all.len(),
        1,
        "exactly one instance after the restart: {all:?}"
    );
    assert_eq!(ready.status.unwrap().provider_id.as_ref(), Some(&all[0].id));
}

async fn reporting_instances(env: &KubeTestEnv, name: &str) -> Vec<String> {
    let events: Api<Event> = env.namespaced();
    let list = events.list(&ListParams::default()).await.unwrap();
    list.items
        .into_iter()
        // The Proxy's own Events: its Service has the same name, and the apiserver's
        // controllers may report about that.
        .filter(|e| {
            e.regarding.as_ref().is_some_and(|r| {
                r.name.as_deref() == Some(name) && r.kind.as_deref() == Some("Proxy")
            })
        })
        .filter_map(|e| e.reporting_instance)
        .collect()
}

async fn lease_holder(env: &KubeTestEnv) -> Option<String> {
    let leases: Api<Lease> = env.namespaced();
    let lease = leases.get_opt("egressproxy-operator").await.unwrap()?;
    lease.spec?.holder_identity
}

#[tokio::test]
async fn of_two_replicas_only_the_leader_acts_and_the_other_takes_over() {
    let s = setup("replicas").await;
    let a = start_operator(&s.env, s.providers_file.path(), "replica-a");
    wait_for_holder(&s.env, "replica-a").await;
    let b = start_operator(&s.env, s.providers_file.path(), "replica-b");
    for replica in [&a, &b] {
        assert_eq!(replica.get("/healthz").await.0, 200);
        assert_eq!(
            replica.get("/readyz").await.0,
            200,
            "a standby replica is ready too"
        );
    }
    assert!(
        a.get("/metrics")
            .await
            .1
            .contains("egressproxy_is_leader 1")
    );
    assert!(
        b.get("/metrics")
            .await
            .1
            .contains("egressproxy_is_leader 0")
    );
    let (_listener, port) = proxy_port();
    let proxies: Api<Proxy> = s.env.namespaced();
    proxies
        .create(&PostParams::default(), &proxy("first", port))
        .await
        .unwrap();
    wait_ready(&proxies, "first").await;
    let reporters = reporting_instances(&s.env, "first").await;
    assert!(
        !reporters.is_empty() && reporters.iter().all(|r| r == "replica-a"),
        "{reporters:?}"
    );
    assert_eq!(lease_holder(&s.env).await.as_deref(), Some("replica-a"));

    a.kill().await;
    wait_for_holder(&s.env, "replica-b").await;
    proxies
        .create(&PostParams::default(), &proxy("second", port))
        .await
        .unwrap();
    wait_ready(&proxies, "second").await;
    let reporters = reporting_instances(&s.env, "second").await;
    assert!(
        !reporters.is_empty() && reporters.iter().all(|r| r == "replica-b"),
        "{reporters:?}"
    );
    assert_eq!(instances(&s.provider).await.len(), 2);
}
