//! What NOTES.txt tells a user after `helm install`, checked where it can go wrong:
//!
//! - the sample Proxy is accepted by the real apiserver (the CRD's schema and CEL rules),
//!   its squid serves the cluster's private ranges (Debian's stock squid refuses all but
//!   localhost) and its health check proxies a request (a TCP check calls a refusing
//!   squid healthy);
//! - every command that needs a port-forward runs it in the background and waits for it,
//!   instead of `port-forward && curl`, which never reaches curl; the metrics go through
//!   the apiserver's service proxy;
//! - a host whose VMs sit on libvirt's NAT network `default` is named in a warning (pods
//!   cannot reach such VMs), and the chart's examples have none.
//!
//! `chart_secure_default.rs` runs the grpcurl commands themselves.

mod chart_support;

use std::path::Path;

use chart_support::{CERT_MANAGER_CERTIFICATE_CRD, PROMETHEUS_OPERATOR_KINDS};
use egressproxy_integration::helm::{self, Helm, Kubectl};
use egressproxy_integration::kube_env::{KubeTestEnv, apply_crds_yaml};

/// The sample Proxy: the here-document of `kubectl apply -f - <<'YAML'`, unindented.
fn sample_proxy(notes: &str) -> String {
    let (_, rest) = notes
        .split_once("kubectl apply -f - <<'YAML'\n")
        .expect("NOTES apply a sample Proxy");
    let (document, _) = rest
        .split_once("\n  YAML\n")
        .expect("the here-document ends");
    document
        .lines()
        .map(|line| line.strip_prefix("  ").unwrap_or(line))
        .collect::<Vec<_>>()
        .join("\n")
}

fn values_file(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test]
async fn notes_give_a_sample_that_proxies_for_the_cluster_and_commands_that_run() {
    let env = KubeTestEnv::new("chart-notes").await.unwrap();
    let crd = std::fs::read_to_string(helm::chart_dir().join("files/crds.yaml")).unwrap();
    for crd in [
        &crd,
        CERT_MANAGER_CERTIFICATE_CRD,
        PROMETHEUS_OPERATOR_KINDS,
    ] {
        apply_crds_yaml(&env.client, crd).await.unwrap();
    }
    let ns = env.namespace.as_str();
    let kubeconfig = env.apiserver().kubeconfig_path();
    let helm = Helm::new(kubeconfig).unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The CRD applied above belongs to no release: these renders leave it out.
    let no_crd = values_file(dir.path(), "no-crd.yaml", "crds: {enabled: false}\n");
    let example = helm::chart_dir().join("examples/in-cluster-agent-ssh.yaml");
    let notes = helm.install_notes("rel", ns, &[&example, &no_crd]).unwrap();

    // The sample Proxy, as the user pastes it (into this test's namespace).
    let sample = sample_proxy(&notes).replace("namespace: default", &format!("namespace: {ns}"));
    Kubectl::new(kubeconfig)
        .run(&["apply", "--dry-run=server", "-f", "-"], Some(&sample))
        .unwrap_or_else(|error| panic!("the apiserver refused the sample:\n{sample}\n{error:#}"));
    let proxy: serde_norway::Value = serde_norway::from_str(&sample).unwrap();
    let spec = &proxy["spec"];
    assert_eq!(spec["healthCheck"]["type"], "Http", "{sample}");
    let user_data: serde_norway::Value =
        serde_norway::from_str(spec["cloudInit"]["userData"].as_str().unwrap()).unwrap();
    assert!(
        user_data["packages"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|package| package == "squid")
    );
    let conf = &user_data["write_files"][0];
    assert!(
        conf["path"]
            .as_str()
            .unwrap()
            .starts_with("/etc/squid/conf.d/")
            && conf["content"]
                .as_str()
                .unwrap()
                .contains("http_access allow localnet"),
        "squid must serve the private ranges: {sample}"
    );

    // Commands that wait for their port-forward, and metrics without one.
    assert!(!notes.contains("&& curl"), "{notes}");
    for line in notes
        .lines()
        .filter(|line| line.contains("kubectl port-forward"))
    {
        assert!(
            line.trim_end().ends_with('&'),
            "a port-forward runs in the background: {line}"
        );
    }
    for expected in [
        "until grep -q Forwarding port-forward.log; do sleep 0.2; done",
        &format!(
            "kubectl get --raw /api/v1/namespaces/{ns}/services/http:rel-egressproxy-operator:http/proxy/metrics"
        ),
        "-cert tls.crt -key tls.key",
        "-o jsonpath='{.data.tls\\.crt}' | base64 -d > tls.crt",
    ] {
        assert!(
            notes.contains(expected),
            "NOTES lack {expected:?}:\n{notes}"
        );
    }

    // The examples put VMs where pods reach them; a NAT host is named.
    for values in helm::example_values().unwrap() {
        let notes = helm.install_notes("rel", ns, &[&values, &no_crd]).unwrap();
        assert!(
            !notes.contains("WARNING: host"),
            "{}: {notes}",
            values.display()
        );
    }
    let nat = values_file(
        dir.path(),
        "nat.yaml",
        "kvmAgent:\n  enabled: true\n  ssh: {secretName: k}\n  config:\n    hosts:\n      \
         - {name: hv1, ssh: {address: hv1, user: u}, network: default}\n      \
         - {name: hv2, ssh: {address: hv2, user: u}}\n      \
         - {name: hv3, ssh: {address: hv3, user: u}, bridge: br0}\n",
    );
    let notes = helm.install_notes("rel", ns, &[&nat, &no_crd]).unwrap();
    assert!(
        notes.contains("WARNING: host hv1 puts VMs on libvirt's network \"default\",")
            && notes.contains("WARNING: host hv2 puts VMs on libvirt's network \"default\" (it sets no network or bridge)")
            && !notes.contains("WARNING: host hv3"),
        "{notes}"
    );
}
