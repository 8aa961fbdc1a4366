//! Secure by default: with no TLS values at all, `helm install` of the in-cluster agent
//! makes a CA, the agent's certificate and the operator's client certificate, and the
//! agent (run as the chart runs it) serves mutual TLS: a client without a certificate is
//! refused, the operator's mounted files are accepted, and so are NOTES' grpcurl
//! commands (which fetch the CA and the client certificate first), run as written.
//!
//! Then `helm upgrade`: with the same values the Secrets stay as they are (nothing
//! restarts or reconnects); when the certificates near expiry (`renewDays` above what
//! is left) they are made anew, and `ca.crt` carries the previous CA too, so the
//! operator's old certificate still verifies while the kubelet updates the files.

mod chart_support;

use std::path::Path;
use std::time::Duration;

use chart_support::create_ssh_secret;
use egressproxy_integration::chart_pod::ChartPod;
use egressproxy_integration::eventually::eventually;
use egressproxy_integration::helm::Helm;
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_provider::client::{ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::pb;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;

const RELEASE: &str = "sd";
const AGENT: &str = "sd-egressproxy-kvm-agent";
const OPERATOR: &str = "sd-egressproxy-operator";

/// Only what a user must say: the agent, its key Secret and one hypervisor. Nothing
/// about TLS.
const VALUES: &str = "\
kvmAgent:
  enabled: true
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

/// GetPluginInfo on the agent at `address`, verifying its certificate for the Service's
/// name against `ca` and presenting `identity`: the plugin's name, or the error.
async fn plugin_info(
    address: std::net::SocketAddr,
    server_name: &str,
    ca: &Path,
    identity: Option<(&Path, &Path)>,
) -> Result<String, String> {
    let mut options = ClientOptions::new(format!("https://{address}"));
    options.call_timeout = Duration::from_secs(10);
    options.tls = Some(ClientTls {
        ca: ca.to_owned(),
        domain: Some(server_name.to_owned()),
        identity: identity.map(|(cert, key)| (cert.to_owned(), key.to_owned())),
    });
    let client = connect_lazy(&options).map_err(|e| e.to_string())?;
    client
        .clone()
        .get_plugin_info(pb::GetPluginInfoRequest {})
        .await
        .map(|answer| answer.into_inner().name)
        .map_err(|status| format!("{status:?}"))
}

/// Waits until the agent answers a client with `identity` (it is still starting
/// until it listens), returning the answer.
async fn first_answer(
    agent: &ChartPod,
    server_name: &str,
    ca: &Path,
    identity: (&Path, &Path),
) -> String {
    eventually(
        "the agent to answer the operator's certificate",
        Duration::from_secs(30),
        || plugin_info(agent.listen(), server_name, ca, Some(identity)),
    )
    .await
}

/// Runs NOTES' grpcurl commands as a user pastes them, in an empty directory, with the
/// agent at `agent` standing in for the port-forward to its Service: fetching the CA and
/// the client certificate from the cluster, then calling. Returns grpcurl's output.
fn run_notes_grpcurl(
    install_output: &str,
    agent: std::net::SocketAddr,
    kubeconfig: &Path,
) -> String {
    let (_, section) = install_output
        .split_once("2. Talk to the kvm-agent with grpcurl")
        .expect("NOTES show grpcurl");
    let commands: Vec<String> = section
        .lines()
        .skip(1)
        .take_while(|line| !line.contains("kill %1"))
        .filter(|line| !line.contains("port-forward"))
        .map(|line| {
            line.trim_start()
                .replace("127.0.0.1:50051", &agent.to_string())
        })
        .collect();
    let script = commands.join("\n");
    let grpcurl = egressproxy_integration::tools::bin("grpcurl").unwrap();
    let path = format!(
        "{}:{}",
        grpcurl.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let dir = tempfile::tempdir().unwrap();
    let output = std::process::Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(dir.path())
        .env("PATH", path)
        .env("KUBECONFIG", kubeconfig)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "NOTES' commands failed:\n{script}\n{text}"
    );
    text
}

fn certificates(pem: &[u8]) -> usize {
    String::from_utf8_lossy(pem)
        .matches("-----BEGIN CERTIFICATE-----")
        .count()
}

#[tokio::test]
async fn the_defaults_serve_mutual_tls_with_certificates_the_chart_makes_and_keeps() {
    let env = KubeTestEnv::new("chart-secure").await.unwrap();
    let ns = env.namespace.clone();
    let dir = tempfile::tempdir().unwrap();
    create_ssh_secret(&env, dir.path(), "kvm-agent-ssh").await;
    let values = dir.path().join("values.yaml");
    std::fs::write(&values, VALUES).unwrap();
    let helm = Helm::new(env.apiserver().kubeconfig_path()).unwrap();
    // Its own namespace only, so the operator leaves other tests' Proxies alone.
    let watch = format!("operator.watchNamespaces={{{ns}}}");
    let installed = helm.install(RELEASE, &ns, &[&values], &[&watch]).unwrap();

    let secrets: Api<Secret> = Api::namespaced(env.client.clone(), &ns);
    let server_secret = secrets.get(&format!("{AGENT}-tls")).await.unwrap();
    let client_secret = secrets
        .get(&format!("{OPERATOR}-client-tls"))
        .await
        .unwrap();
    for secret in [&server_secret, &client_secret] {
        let data = secret.data.as_ref().unwrap();
        for key in ["tls.crt", "tls.key", "ca.crt"] {
            assert!(data.contains_key(key), "{key} missing: {secret:?}");
        }
    }

    let server_name = format!("{AGENT}.{ns}.svc");
    let agent = ChartPod::start(&env, &ns, AGENT, "kvm-agent", None)
        .await
        .unwrap();
    let operator = ChartPod::start(&env, &ns, OPERATOR, "egressproxy-operator", Some(OPERATOR))
        .await
        .unwrap();
    // The operator's files, where its provider config says (provider `kvm`).
    let mounted = operator.root().join("etc/egressproxy/provider-tls/kvm");
    let old_files = tempfile::tempdir().unwrap();
    for file in ["ca.crt", "tls.crt", "tls.key"] {
        std::fs::copy(mounted.join(file), old_files.path().join(file)).unwrap();
    }
    let old = old_files.path();
    let (ca, cert, key) = (old.join("ca.crt"), old.join("tls.crt"), old.join("tls.key"));
    assert_eq!(
        first_answer(&agent, &server_name, &ca, (&cert, &key)).await,
        "kvm.egressproxy.dev",
        "the operator's certificate is accepted"
    );
    let refused = plugin_info(agent.listen(), &server_name, &ca, None).await;
    assert!(
        refused.is_err(),
        "a client without a certificate was served: {refused:?}"
    );
    let answer = run_notes_grpcurl(
        &installed,
        agent.listen(),
        env.apiserver().kubeconfig_path(),
    );
    assert!(answer.contains("kvm.egressproxy.dev"), "{answer}");

    // The same values again: nothing changes.
    helm.upgrade(RELEASE, &ns, &[&values], &[&watch]).unwrap();
    let kept = secrets.get(&format!("{AGENT}-tls")).await.unwrap();
    assert_eq!(
        kept.metadata.resource_version, server_secret.metadata.resource_version,
        "an upgrade with the same values keeps the certificates"
    );
    let kept_client = secrets
        .get(&format!("{OPERATOR}-client-tls"))
        .await
        .unwrap();
    assert_eq!(
        kept_client.metadata.resource_version,
        client_secret.metadata.resource_version
    );

    // Near expiry (renewDays above the 730 days left): made anew, the old CA kept beside.
    let renew = [
        watch.as_str(),
        "kvmAgent.tls.helm.validityDays=3000",
        "kvmAgent.tls.helm.renewDays=1000",
    ];
    helm.upgrade(RELEASE, &ns, &[&values], &renew).unwrap();
    let renewed = secrets.get(&format!("{AGENT}-tls")).await.unwrap();
    let renewed_data = renewed.data.as_ref().unwrap();
    assert_ne!(
        renewed_data["tls.crt"],
        server_secret.data.as_ref().unwrap()["tls.crt"]
    );
    assert_eq!(
        certificates(&renewed_data["ca.crt"].0),
        2,
        "the new and the previous CA"
    );
    drop(agent);
    drop(operator);
    let agent = ChartPod::start(&env, &ns, AGENT, "kvm-agent", None)
        .await
        .unwrap();
    let operator = ChartPod::start(&env, &ns, OPERATOR, "egressproxy-operator", Some(OPERATOR))
        .await
        .unwrap();
    let new = operator.root().join("etc/egressproxy/provider-tls/kvm");
    assert_eq!(
        first_answer(
            &agent,
            &server_name,
            &new.join("ca.crt"),
            (&new.join("tls.crt"), &new.join("tls.key"))
        )
        .await,
        "kvm.egressproxy.dev",
        "the renewed certificates work together"
    );
    assert_eq!(
        plugin_info(
            agent.listen(),
            &server_name,
            &new.join("ca.crt"),
            Some((&cert, &key))
        )
        .await
        .unwrap(),
        "kvm.egressproxy.dev",
        "an operator whose client certificate is not updated yet is still accepted"
    );
    // Renewed for 3000 days with 1000 to go: the next upgrade keeps them.
    helm.upgrade(RELEASE, &ns, &[&values], &renew).unwrap();
    let again = secrets.get(&format!("{AGENT}-tls")).await.unwrap();
    assert_eq!(
        again.metadata.resource_version,
        renewed.metadata.resource_version
    );
}
