//! The `kube-provider` binary as users run it: it reads its YAML file, reaches the
//! apiserver through `KUBECONFIG`, prints `listening on ADDR`, answers GetPluginInfo,
//! and makes a pod for a Create; and it refuses a configuration with a typo before
//! serving anything. (Health, reflection and TLS are the shared scaffold's, checked by
//! its own tests and by the conformance suite.)

mod common;

use std::process::{Command, Stdio};

use common::{Harness, create, create_request};
use egressproxy_integration::process::spawn_listening;
use egressproxy_provider::client::{ClientOptions, connect_lazy};
use egressproxy_provider::pb;

const BINARY: &str = env!("CARGO_BIN_EXE_kube-provider");

/// Kills the child when the test ends, also on a failed assertion.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn config_yaml(harness: &Harness) -> String {
    format!(
        "namespace: {ns}\n\
         node_selector: {{{label}: {ns}}}\n\
         machine_types: {{small: {{requests: {{cpu: 100m}}}}}}\n\
         images: {{squid: {{image: 'localhost/squid:6'}}}}\n",
        ns = harness.env.namespace,
        label = common::EGRESS_LABEL,
    )
}

#[tokio::test]
async fn the_binary_serves_from_its_config_and_kubeconfig() {
    let harness = Harness::new("kube-provider-binary", &[("a", "z1")]).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, config_yaml(&harness)).unwrap();
    let (child, address) = spawn_listening(
        Command::new(BINARY)
            .arg("--config")
            .arg(&config)
            .args(["--listen", "127.0.0.1:0"])
            .env("KUBECONFIG", harness.env.apiserver().kubeconfig_path())
            .stderr(Stdio::inherit()),
        "kube-provider",
    )
    .unwrap();
    let _running = Running(child);
    let mut client = connect_lazy(&ClientOptions::new(format!("http://{address}"))).unwrap();

    let info = client
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "kube.egressproxy.dev");
    assert_eq!(
        info.contract_version,
        egressproxy_provider::CONTRACT_VERSION
    );

    let instance = create(&mut client, create_request("from-the-binary", None, &[])).await;
    let pod = harness.pods().get(&instance.id).await.unwrap();
    assert_eq!(
        pod.spec.unwrap().node_name.as_deref(),
        Some(harness.nodes["a"].as_str())
    );
}

#[tokio::test]
async fn a_typo_in_the_config_stops_it_before_serving() {
    let harness = Harness::new("kube-provider-binary-typo", &[]).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, format!("{}zone_lable: x\n", config_yaml(&harness))).unwrap();
    let output = Command::new(BINARY)
        .arg("--config")
        .arg(&config)
        .args(["--listen", "127.0.0.1:0"])
        .env("KUBECONFIG", harness.env.apiserver().kubeconfig_path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(output.stdout.is_empty(), "it served: {:?}", output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("zone_lable"), "{stderr}");
}
