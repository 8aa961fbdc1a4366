//! Proxies for the chart tests: made through the real apiserver as untyped objects (the
//! integration crate does not depend on the operator), and waited on until Ready; test
//! certificates made with openssl.

// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

use std::path::Path;
use std::time::Duration;

use egressproxy_integration::kube_env::KubeTestEnv;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::runtime::wait::await_condition;

const WAIT: Duration = Duration::from_secs(90);

/// cert-manager's own Certificate CRD, so that the chart's Certificates are checked
/// against cert-manager's schema.
pub(crate) const CERT_MANAGER_CERTIFICATE_CRD: &str =
    include_str!("../fixtures/cert-manager.io_certificates.yaml");

/// Stand-ins for the Prometheus Operator's ServiceMonitor and PrometheusRule CRDs: they
/// only make the kinds known to the apiserver (any content is accepted), so that a dry
/// run checks the rest of a rendering that contains them.
pub(crate) const PROMETHEUS_OPERATOR_KINDS: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: { name: servicemonitors.monitoring.coreos.com }
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: { kind: ServiceMonitor, plural: servicemonitors, singular: servicemonitor, listKind: ServiceMonitorList }
  versions:
    - name: v1
      served: true
      storage: true
      schema: { openAPIV3Schema: { type: object, x-kubernetes-preserve-unknown-fields: true } }
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: { name: prometheusrules.monitoring.coreos.com }
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: { kind: PrometheusRule, plural: prometheusrules, singular: prometheusrule, listKind: PrometheusRuleList }
  versions:
    - name: v1
      served: true
      storage: true
      schema: { openAPIV3Schema: { type: object, x-kubernetes-preserve-unknown-fields: true } }
"#;

pub(crate) fn proxy_api(client: &kube::Client, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("egressproxy.dev", "v1alpha1", "Proxy");
    Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk))
}

/// Creates a Proxy whose cloud-init is in a Secret (so the operator must read it) and
/// whose proxy port is a local listener (the reference provider reports 127.0.0.1).
pub(crate) async fn create_proxy(env: &KubeTestEnv, namespace: &str, name: &str, port: u16) {
    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), namespace);
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("{name}-user-data")},
        "stringData": {"user-data": "#cloud-config\npackages: [squid]\n"},
    }))
    .unwrap();
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
    let proxy: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "egressproxy.dev/v1alpha1",
        "kind": "Proxy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "provider": "reference",
            "placement": {"machineType": "small", "image": "debian-12"},
            "cloudInit": {"userDataSecretRef": {"name": format!("{name}-user-data"), "key": "user-data"}},
            "proxyPort": port,
            "healthCheck": {"periodSeconds": 2, "timeoutSeconds": 1},
        },
    }))
    .unwrap();
    proxy_api(&env.client, namespace)
        .create(&PostParams::default(), &proxy)
        .await
        .unwrap();
}

pub(crate) async fn wait_ready(env: &KubeTestEnv, namespace: &str, name: &str) {
    let api = proxy_api(&env.client, namespace);
    let ready = |proxy: Option<&DynamicObject>| {
        proxy
            .and_then(|p| p.data.pointer("/status/phase"))
            .and_then(|phase| phase.as_str())
            == Some("Ready")
    };
    let watched = tokio::time::timeout(WAIT, await_condition(api.clone(), name, ready)).await;
    if !matches!(watched, Ok(Ok(_))) {
        let status = api.get(name).await.map(|p| p.data["status"].clone());
        panic!("Proxy {namespace}/{name} was not Ready within {WAIT:?} ({watched:?}): {status:?}");
    }
}

/// See [`egressproxy_integration::certificates::make_certificates`].
pub(crate) fn make_certificates(dir: &Path, server_name: &str) {
    egressproxy_integration::certificates::make_certificates(dir, server_name).unwrap();
}

/// Creates Secret `name` in the test's namespace with each file's text under its key.
pub(crate) async fn create_secret(env: &KubeTestEnv, name: &str, files: &[(&str, &Path)]) {
    let data: serde_json::Map<String, serde_json::Value> = files
        .iter()
        .map(|(key, path)| {
            let text = std::fs::read_to_string(path).unwrap();
            ((*key).to_owned(), serde_json::Value::String(text))
        })
        .collect();
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "stringData": data,
    }))
    .unwrap();
    Api::<Secret>::namespaced(env.client.clone(), &env.namespace)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

/// An SSH key and a known_hosts naming `[127.0.0.1]:1` in `dir`, as Secret `name` with
/// the keys the chart's defaults read (`id_ed25519`, `known_hosts`). Nothing listens on
/// that port: the agent starts and serves without reaching a hypervisor.
pub(crate) async fn create_ssh_secret(env: &KubeTestEnv, dir: &Path, name: &str) {
    let key = dir.join("id_ed25519");
    let status = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .status()
        .unwrap();
    assert!(status.success());
    let public = std::fs::read_to_string(dir.join("id_ed25519.pub")).unwrap();
    let host_key: Vec<&str> = public.split_whitespace().take(2).collect();
    let known_hosts = dir.join("known_hosts");
    std::fs::write(
        &known_hosts,
        format!("[127.0.0.1]:1 {}\n", host_key.join(" ")),
    )
    .unwrap();
    create_secret(
        env,
        name,
        &[("id_ed25519", &key), ("known_hosts", &known_hosts)],
    )
    .await;
}
