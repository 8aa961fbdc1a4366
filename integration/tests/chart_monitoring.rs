//! Monitoring as the chart sets it up: `helm install` with both ServiceMonitors and the
//! PrometheusRule (the Prometheus Operator's kinds made known to the apiserver), then the
//! agent and the operator run as their Deployments say:
//!
//! - each ServiceMonitor selects its component's Service and names a port the Service
//!   has, which leads to the container port the binary serves `/metrics` on;
//! - the agent's `/metrics` answers on the port the chart passes as `--metrics-listen`
//!   (its call metrics count the probe's health check), the operator's on its own;
//! - the PrometheusRule has both components' groups, with the release's alert labels.
//!
//! That every metric an alert reads is exported is checked where each binary's metrics
//! are produced: `kvm-agent/tests/serve_metrics.rs` and `operator/tests/prometheus_rule.rs`.

mod chart_support;

use std::time::Duration;

use chart_support::{PROMETHEUS_OPERATOR_KINDS, create_ssh_secret};
use egressproxy_integration::chart_pod::{ChartPod, Probe};
use egressproxy_integration::eventually::eventually;
use egressproxy_integration::helm::Helm;
use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};
use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};

const VALUES: &str = "\
operator:
  serviceMonitor: { enabled: true }
prometheusRule:
  enabled: true
  alertLabels: { team: platform }
kvmAgent:
  enabled: true
  serviceMonitor: { enabled: true }
  ssh:
    secretName: kvm-agent-ssh
  config:
    hosts:
      - name: hv1
        ssh: { address: \"127.0.0.1:1\", user: egressproxy }
    machineTypes:
      small: { vcpus: 1, memoryMiB: 1024, diskGiB: 10 }
    images:
      debian-12: { url: \"file:///nonexistent/debian-12.qcow2\" }
";

fn monitoring_api(env: &KubeTestEnv, kind: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("monitoring.coreos.com", "v1", kind);
    Api::namespaced_with(
        env.client.clone(),
        &env.namespace,
        &ApiResource::from_gvk(&gvk),
    )
}

/// GET `/metrics` at `address` (HTTP/1.1, no client crate), retried while the process
/// starts.
async fn scrape(address: std::net::SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Until it listens, the process is starting.
    let what = format!("/metrics served on {address}");
    let mut stream = eventually(&what, Duration::from_secs(30), || async {
        tokio::net::TcpStream::connect(address)
            .await
            .map_err(|error| format!("connect: {error}"))
    })
    .await;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_owned()
}

#[tokio::test]
async fn service_monitors_reach_the_metrics_and_the_rule_covers_both_components() {
    let env = KubeTestEnv::new("chart-monitoring").await.unwrap();
    apply_crds_yaml(&env.client, PROMETHEUS_OPERATOR_KINDS)
        .await
        .unwrap();
    let ns = env.namespace.clone();
    let dir = tempfile::tempdir().unwrap();
    create_ssh_secret(&env, dir.path(), "kvm-agent-ssh").await;
    let values = dir.path().join("values.yaml");
    std::fs::write(&values, VALUES).unwrap();
    let watch = format!("operator.watchNamespaces={{{ns}}}");
    Helm::new(env.apiserver().kubeconfig_path())
        .unwrap()
        .install("mon", &ns, &[&values], &[&watch])
        .unwrap();

    // Each ServiceMonitor selects its Service and a port it has.
    let services: Api<Service> = Api::namespaced(env.client.clone(), &ns);
    for (name, port) in [
        ("mon-egressproxy-operator", "http"),
        ("mon-egressproxy-kvm-agent", "metrics"),
    ] {
        let monitor = monitoring_api(&env, "ServiceMonitor")
            .get(name)
            .await
            .unwrap();
        let spec = &monitor.data["spec"];
        assert_eq!(spec["endpoints"][0]["port"], port, "{spec}");
        let service = services.get(name).await.unwrap();
        let labels = service.metadata.labels.unwrap_or_default();
        for (key, value) in spec["selector"]["matchLabels"].as_object().unwrap() {
            assert_eq!(
                labels.get(key).map(String::as_str),
                value.as_str(),
                "{name}: the ServiceMonitor selects {key}={value}"
            );
        }
        assert!(
            service
                .spec
                .unwrap()
                .ports
                .unwrap()
                .iter()
                .any(|p| p.name.as_deref() == Some(port)),
            "{name} has no port {port}"
        );
    }

    let agent = ChartPod::start(&env, &ns, "mon-egressproxy-kvm-agent", "kvm-agent", None)
        .await
        .unwrap();
    let operator = ChartPod::start(
        &env,
        &ns,
        "mon-egressproxy-operator",
        "egressproxy-operator",
        Some("mon-egressproxy-operator"),
    )
    .await
    .unwrap();
    // One health call, so the agent has served something.
    eventually("the agent to serve", Duration::from_secs(30), || async {
        let probe = agent.run_probe(Probe::Readiness).unwrap();
        if probe.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&probe.stderr).into_owned())
        }
    })
    .await;
    let agent_metrics = scrape(agent.metrics_listen()).await;
    assert!(
        agent_metrics.contains(
            "kvm_agent_grpc_request_duration_seconds_count{method=\"/grpc.health.v1.Health/Check\",code=\"Ok\"}"
        ),
        "{agent_metrics}"
    );
    let operator_metrics = scrape(operator.listen()).await;
    assert!(
        operator_metrics.contains("egressproxy_is_leader"),
        "{operator_metrics}"
    );

    // The rule is there, for both components, with the release's alert labels.
    let rule = monitoring_api(&env, "PrometheusRule")
        .get("mon-egressproxy")
        .await
        .unwrap();
    let groups = rule.data["spec"]["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 2, "{}", rule.data["spec"]);
    for alert in groups
        .iter()
        .flat_map(|group| group["rules"].as_array().unwrap())
    {
        assert_eq!(alert["labels"]["team"], "platform", "{alert}");
    }
}
