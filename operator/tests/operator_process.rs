//! The operator binary as users run it: separate processes against a real
//! kube-apiserver and the reference provider. Covers a crash in the middle of a
//! Create and two replicas behind one leader Lease.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use egressproxy_integration::reference_provider::{ReferenceProvider, workspace_binary};
use egressproxy_operator::crd::{Phase, Proxy};
use egressproxy_provider::pb;
use egressproxy_provider::pb::reference::v1::{
    self as control, control_service_client::ControlServiceClient,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, PostParams};

const CRD: &str = include_str!("../../charts/egressproxy/files/proxies.egressproxy.dev.yaml");
const WAIT: Duration = Duration::from_secs(60);

struct Operator {
    child: Child,
    http: std::net::SocketAddr,
}

impl Operator {
    fn start(env: &KubeTestEnv, providers: &std::path::Path, identity: &str) -> Operator {
        let http = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let child = Command::new(workspace_binary("egressproxy-operator").unwrap())
            .env("KUBECONFIG", env.apiserver().kubeconfig_path())
            .env("POD_NAME", identity)
            .env("RUST_LOG", "info,kube=warn")
            .args(["--cluster-name", &format!("test-{}", env.namespace)])
            .args([
                "--namespace",
                &env.namespace,
                "--lease-namespace",
                &env.namespace,
            ])
            .arg("--providers")
            .arg(providers)
            .args([
                "--http-listen",
                &http.to_string(),
                "--lease-duration",
                "3s",
                "--gc-interval",
                "1h",
            ])
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        Operator { child, http }
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// GET `path` from the operator's HTTP endpoints: status code and body.
    async fn get(&self, path: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let deadline = Instant::now() + WAIT;
        let mut stream = loop {
            match tokio::net::TcpStream::connect(self.http).await {
                Ok(stream) => break stream,
                Err(error) => assert!(
                    Instant::now() < deadline,
                    "operator HTTP never came up: {error}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let request = format!("GET {path} HTTP/1.1\r\nHost: operator\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        let code = answer.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = answer
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        (code, body)
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Setup {
    env: KubeTestEnv,
    provider: ReferenceProvider,
    providers_file: tempfile::NamedTempFile,
}

async fn setup(test: &str) -> Setup {
    let env = KubeTestEnv::new(test).await.unwrap();
    apply_crds_yaml(&env.client, CRD).await.unwrap();
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
    let deadline = Instant::now() + WAIT;
    loop {
        let proxy = api.get(name).await.unwrap();
        if proxy.status.as_ref().and_then(|s| s.phase) == Some(Phase::Ready) {
            return proxy;
        }
        assert!(
            Instant::now() < deadline,
            "{name} never became Ready: {:#?}",
            proxy.status
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
        })
        .await
        .unwrap();
    let operator = Operator::start(&s.env, s.providers_file.path(), "crashing");
    let (_listener, port) = proxy_port();
    let proxies: Api<Proxy> = s.env.namespaced();
    proxies
        .create(&PostParams::default(), &proxy("egress", port))
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    while instances(&s.provider).await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the operator never called CreateInstance"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    operator.kill();
    let stranded = proxies.get("egress").await.unwrap();
    assert_eq!(
        stranded.status.and_then(|s| s.provider_id),
        None,
        "the crash happened before the id was recorded"
    );

    let _restarted = Operator::start(&s.env, s.providers_file.path(), "restarted");
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
        .filter(|e| e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name))
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
    let a = Operator::start(&s.env, s.providers_file.path(), "replica-a");
    let deadline = Instant::now() + WAIT;
    while lease_holder(&s.env).await.as_deref() != Some("replica-a") {
        assert!(Instant::now() < deadline, "replica-a never took the lease");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let b = Operator::start(&s.env, s.providers_file.path(), "replica-b");
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

    a.kill();
    let deadline = Instant::now() + WAIT;
    while lease_holder(&s.env).await.as_deref() != Some("replica-b") {
        assert!(
            Instant::now() < deadline,
            "replica-b never took over the lease"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
