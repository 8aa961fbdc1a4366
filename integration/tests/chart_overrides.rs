//! The overrides every chart user expects, in one values file: keys an umbrella chart
//! passes under `global`, `fullnameOverride`, pod labels and annotations, topology
//! spread, affinity, extra volumes and mounts (a private CA), the security-context
//! overrides OpenShift needs (no fixed uid), and `ephemeral-storage` for the agent's
//! spool. The schema accepts them, the rendering carries each where Kubernetes reads it,
//! and the real kube-apiserver accepts the result (server-side dry run).

use std::path::Path;

use egressproxy_integration::helm::{Helm, Kubectl};
use egressproxy_integration::kube_env::KubeTestEnv;
use serde::Deserialize as _;

const VALUES: &str = r#"
fullnameOverride: edge
global:
  # What other subcharts of an umbrella chart pass down.
  storageClass: fast
  otel:
    endpoint: https://collector.observability:4318
    protocol: http/protobuf
    caConfigMap: collector-ca
  postgresql: { auth: { existingSecret: db } }
operator:
  clusterName: overrides
  podLabels: { team: platform }
  podAnnotations: { example.org/owner: platform }
  topologySpreadConstraints:
    - maxSkew: 1
      topologyKey: kubernetes.io/hostname
      whenUnsatisfiable: ScheduleAnyway
      labelSelector:
        matchLabels: { app.kubernetes.io/component: operator }
  affinity:
    nodeAffinity:
      requiredDuringSchedulingIgnoredDuringExecution:
        nodeSelectorTerms:
          - matchExpressions: [{ key: kubernetes.io/os, operator: In, values: [linux] }]
  extraVolumes:
    - name: collector-ca
      configMap: { name: collector-ca }
  extraVolumeMounts:
    - name: collector-ca
      mountPath: /etc/collector-ca
      readOnly: true
  # OpenShift assigns the uid: none of the chart's fixed ids.
  podSecurityContext: { runAsUser: null, runAsGroup: null, fsGroup: null }
kvmAgent:
  enabled: true
  ssh: { secretName: kvm-agent-ssh }
  podLabels: { team: platform }
  extraVolumes:
    - name: mirror-ca
      configMap: { name: mirror-ca }
  extraVolumeMounts:
    - name: mirror-ca
      mountPath: /etc/mirror-ca
      readOnly: true
  extraEnv:
    - { name: SSL_CERT_FILE, value: /etc/mirror-ca/ca.crt }
  # A uid from the namespace's range, set by hand.
  containerSecurityContext: { runAsUser: 1000680000 }
  resources:
    requests: { ephemeral-storage: 2Gi }
    limits: { ephemeral-storage: 12Gi }
  config:
    hosts:
      - name: hv1
        ssh: { address: hv1.example.org, user: egressproxy }
    machineTypes:
      small: { vcpus: 1, memoryMiB: 1024, diskGiB: 10 }
    images:
      debian-12: { url: "https://mirror.example.org/debian-12.qcow2" }
"#;

/// The rendered object of `kind` named `name`.
fn object(rendered: &str, kind: &str, name: &str) -> serde_norway::Value {
    serde_norway::Deserializer::from_str(rendered)
        .filter_map(|document| serde_norway::Value::deserialize(document).ok())
        .find(|doc| doc["kind"] == kind && doc["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the rendering:\n{rendered}"))
}

/// Whether list `items` has an entry whose `key` is `value`.
fn has(items: &serde_norway::Value, key: &str, value: &str) -> bool {
    items
        .as_sequence()
        .is_some_and(|items| items.iter().any(|item| item[key] == value))
}

/// The collector's CA from `global.otel.caConfigMap` is mounted where
/// `OTEL_EXPORTER_OTLP_CERTIFICATE` says, beside the protocol.
fn assert_collector_ca(spec: &serde_norway::Value) {
    let container = &spec["containers"][0];
    let env = |name: &str| {
        container["env"]
            .as_sequence()
            .and_then(|vars| vars.iter().find(|var| var["name"] == name))
            .map(|var| var["value"].as_str().unwrap_or_default().to_owned())
    };
    assert_eq!(
        env("OTEL_EXPORTER_OTLP_PROTOCOL").as_deref(),
        Some("http/protobuf")
    );
    assert_eq!(
        env("OTEL_EXPORTER_OTLP_CERTIFICATE").as_deref(),
        Some("/etc/egressproxy/otel-ca/ca.crt")
    );
    assert!(has(
        &container["volumeMounts"],
        "mountPath",
        "/etc/egressproxy/otel-ca"
    ));
    assert!(has(&spec["volumes"], "name", "otel-ca"));
}

#[tokio::test]
async fn the_overrides_users_expect_are_accepted_and_rendered() {
    let env = KubeTestEnv::new("chart-overrides").await.unwrap();
    let kubeconfig = env.apiserver().kubeconfig_path();
    let helm = Helm::new(kubeconfig).unwrap();
    let values = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(values.path(), VALUES).unwrap();
    let values: &Path = values.path();
    let rendered = helm
        .template("rel", &env.namespace, &[values], &[])
        .unwrap_or_else(|error| panic!("the chart refused the overrides: {error:#}"));

    let operator = object(&rendered, "Deployment", "edge-operator");
    let pod = &operator["spec"]["template"];
    assert_eq!(pod["metadata"]["labels"]["team"], "platform");
    assert_eq!(
        pod["metadata"]["labels"]["app.kubernetes.io/component"], "operator",
        "the selector's labels stay"
    );
    assert_eq!(
        pod["metadata"]["annotations"]["example.org/owner"],
        "platform"
    );
    let spec = &pod["spec"];
    assert_eq!(
        spec["topologySpreadConstraints"][0]["topologyKey"],
        "kubernetes.io/hostname"
    );
    assert!(spec["affinity"]["nodeAffinity"].is_mapping());
    assert!(has(&spec["volumes"], "name", "collector-ca"));
    assert!(has(
        &spec["containers"][0]["volumeMounts"],
        "mountPath",
        "/etc/collector-ca"
    ));
    let security = &spec["securityContext"];
    for removed in ["runAsUser", "runAsGroup", "fsGroup"] {
        assert!(
            security.get(removed).is_none(),
            "{removed} is left out: {security:?}"
        );
    }
    assert_eq!(security["runAsNonRoot"], true, "the rest stays");
    assert_collector_ca(spec);

    let agent = object(&rendered, "Deployment", "edge-kvm-agent");
    let spec = &agent["spec"]["template"]["spec"];
    let container = &spec["containers"][0];
    assert_eq!(
        container["resources"]["limits"]["ephemeral-storage"],
        "12Gi"
    );
    assert_eq!(container["securityContext"]["runAsUser"], 1000680000);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);
    assert!(has(
        &container["volumeMounts"],
        "mountPath",
        "/etc/mirror-ca"
    ));
    assert!(has(&spec["volumes"], "name", "mirror-ca"));
    assert_collector_ca(spec);
    object(&rendered, "Service", "edge-kvm-agent");

    let answer = Kubectl::new(kubeconfig)
        .dry_run_apply(&rendered)
        .unwrap_or_else(|error| panic!("the apiserver refused the rendering: {error:#}"));
    assert!(answer.contains("serverside-applied (server dry run)"));
}
