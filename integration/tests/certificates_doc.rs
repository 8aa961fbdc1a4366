//! `docs/certificates.md` as written: its shell blocks run verbatim with bash (openssl,
//! then kubectl against the real kube-apiserver, in the namespace the document names),
//! the chart is installed with its `source: secret` values, and the certificates work:
//!
//! - the in-cluster agent, run as the chart runs it from the Secret the recipe made,
//!   serves the operator (its files as the chart mounts them) and refuses a client
//!   without a certificate;
//! - an agent on a hypervisor, served with the hypervisor's certificate, answers the
//!   operator's provider for it (the CA and client certificate from the `hypervisor-tls`
//!   Secret, as the chart mounts them) under the host's name.

mod chart_support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use chart_support::create_ssh_secret;
use egressproxy_integration::chart_pod::ChartPod;
use egressproxy_integration::doc_commands::fenced_blocks;
use egressproxy_integration::eventually::eventually;
use egressproxy_integration::helm::Helm;
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::kvm_agent::ServedAgent;
use egressproxy_provider::client::{ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::pb;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, PostParams};

const DOC: &str = include_str!("../../docs/certificates.md");
/// The release and namespace the document's names assume.
const NAMESPACE: &str = "egressproxy";
const RELEASE: &str = "egressproxy";

/// The fenced blocks of `lang` in the document.
fn blocks(lang: &str) -> Vec<String> {
    fenced_blocks(DOC, lang)
}

fn run_block(block: &str, dir: &Path, kubeconfig: &Path) {
    let output = Command::new("bash")
        .args(["-euo", "pipefail", "-c", block])
        .current_dir(dir)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "the block failed:\n{block}\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// GetPluginInfo at `address`, verifying `server_name` against `ca`, presenting the
/// client certificate in `client_dir` (`tls.crt`, `tls.key`) when given.
async fn plugin_info(
    address: &str,
    server_name: &str,
    ca: &Path,
    client_dir: Option<&Path>,
) -> Result<String, String> {
    let mut options = ClientOptions::new(format!("https://{address}"));
    options.call_timeout = Duration::from_secs(10);
    options.tls = Some(ClientTls {
        ca: ca.to_owned(),
        domain: Some(server_name.to_owned()),
        identity: client_dir.map(|dir| (dir.join("tls.crt"), dir.join("tls.key"))),
    });
    let client = connect_lazy(&options).map_err(|e| e.to_string())?;
    client
        .clone()
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .map(|answer| answer.into_inner().name)
        .map_err(|status| format!("{status:?}"))
}

async fn eventually_answers(address: &str, server_name: &str, client_dir: &Path) -> String {
    // Until it answers, the agent is still starting.
    let what = format!("{server_name} to answer the operator's certificate");
    let ca = client_dir.join("ca.crt");
    eventually(&what, Duration::from_secs(30), || {
        plugin_info(address, server_name, &ca, Some(client_dir))
    })
    .await
}

#[tokio::test]
async fn the_recipe_runs_verbatim_and_its_certificates_serve_mutual_tls() {
    let mut env = KubeTestEnv::new("certificates-doc").await.unwrap();
    let namespace: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": NAMESPACE}})).unwrap();
    Api::<Namespace>::all(env.client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .unwrap();
    env.namespace = NAMESPACE.to_owned();
    let kubeconfig = env.apiserver().kubeconfig_path();

    let dir = tempfile::tempdir().unwrap();
    let shell = blocks("sh");
    assert!(shell.len() >= 6, "the recipe's steps: {shell:?}");
    for block in &shell {
        run_block(block, dir.path(), kubeconfig);
    }

    // The chart with the document's values, an agent and a hypervisor's agent.
    let tls_values = blocks("yaml")
        .into_iter()
        .find(|block| block.contains("source: secret"))
        .expect("the values for source: secret");
    let values = dir.path().join("values.yaml");
    std::fs::write(
        &values,
        format!(
            "{tls_values}  enabled: true\n  ssh: {{secretName: kvm-agent-ssh}}\n  config:\n    \
             hosts: [{{name: hv1, ssh: {{address: \"127.0.0.1:1\", user: egressproxy}}}}]\n\
             operator:\n  watchNamespaces: [{NAMESPACE}]\n  providers:\n    hv1:\n      \
             endpoint: https://hv1.example.org:50051\n      tls:\n        secretName: hypervisor-tls\n        \
             clientCertificate: true\n"
        ),
    )
    .unwrap();
    let ssh = tempfile::tempdir().unwrap();
    create_ssh_secret(&env, ssh.path(), "kvm-agent-ssh").await;
    Helm::new(kubeconfig)
        .unwrap()
        .install(RELEASE, NAMESPACE, &[&values], &[])
        .unwrap();

    let agent = ChartPod::start(&env, NAMESPACE, "egressproxy-kvm-agent", "kvm-agent", None)
        .await
        .unwrap();
    let operator = ChartPod::start(
        &env,
        NAMESPACE,
        "egressproxy-operator",
        "egressproxy-operator",
        Some("egressproxy-operator"),
    )
    .await
    .unwrap();
    let provider_tls = operator.root().join("etc/egressproxy/provider-tls");
    let service = "egressproxy-kvm-agent.egressproxy.svc";
    let address = agent.listen().to_string();
    assert_eq!(
        eventually_answers(&address, service, &provider_tls.join("kvm")).await,
        "kvm.egressproxy.dev"
    );
    let refused = plugin_info(&address, service, &provider_tls.join("kvm/ca.crt"), None).await;
    assert!(
        refused.is_err(),
        "served without a certificate: {refused:?}"
    );

    // The agent on hv1, with the files the recipe says go to /etc/kvm-agent/tls/.
    let socket = dir.path().join("libvirt-sock");
    let _nobody_answers = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "hosts:\n- name: here\n  local: true\n  libvirtSocket: {}\n\
             machineTypes:\n  small: {{vcpus: 1, memoryMiB: 512, diskGiB: 4}}\n\
             images:\n  debian: {{url: \"https://example.org/debian.qcow2\"}}\n",
            socket.display()
        ),
    )
    .unwrap();
    let hypervisor = ServedAgent::start_with(&config, "127.0.0.1:0", |command| {
        command
            .arg("--tls-cert")
            .arg(dir.path().join("hv1.crt"))
            .arg("--tls-key")
            .arg(dir.path().join("hv1.key"))
            .arg("--client-ca")
            .arg(dir.path().join("ca.crt"));
    })
    .unwrap();
    assert_eq!(
        eventually_answers(
            hypervisor.address(),
            "hv1.example.org",
            &provider_tls.join("hv1")
        )
        .await,
        "kvm.egressproxy.dev"
    );
}
