//! The in-cluster kvm-agent as the chart runs it: its Deployment's args, env and volumes
//! (the rendered config, the SSH key Secret, the server TLS Secret, the spool and runtime
//! emptyDirs) materialised out of cluster. It starts, serves mutual TLS with the chart's
//! certificate paths, answers grpcurl with the operator's client certificate, and refuses
//! a client without one.

mod chart_support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use chart_support::{create_secret, create_ssh_secret, make_certificates};
use egressproxy_integration::chart_pod::ChartPod;
use egressproxy_integration::eventually::eventually;
use egressproxy_integration::helm::Helm;
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::tools;

const AGENT: &str = "ag-egressproxy-kvm-agent";

/// Hosts on loopback only (nothing is dialled to serve GetPluginInfo; if anything were,
/// it stays on this machine), an image that is never fetched (one that ships the guest
/// agent, so the agent itself parses that setting as the chart passes it).
const VALUES: &str = "\
kvmAgent:
  enabled: true
  ssh:
    secretName: kvm-agent-ssh
  tls:
    source: secret
  config:
    hosts:
      - name: hv1
        ssh: { address: \"127.0.0.1:1\", user: egressproxy }
    machineTypes:
      small: { vcpus: 1, memoryMiB: 1024, diskGiB: 10 }
    images:
      debian-12: { url: \"file:///nonexistent/debian-12.qcow2\", guestAgent: preinstalled }
";

fn grpcurl(
    address: &str,
    authority: &str,
    certs: &Path,
    client_cert: bool,
) -> std::process::Output {
    let mut command = Command::new(tools::bin("grpcurl").unwrap());
    command.arg("-cacert").arg(certs.join("ca.crt")).args([
        "-authority",
        authority,
        "-max-time",
        "5",
    ]);
    if client_cert {
        command
            .arg("-cert")
            .arg(certs.join("client.crt"))
            .arg("-key")
            .arg(certs.join("client.key"));
    }
    command
        .args([address, "egressproxy.provider.v1.Provider/GetPluginInfo"])
        .output()
        .unwrap()
}

#[tokio::test]
async fn the_agent_serves_mutual_tls_as_the_chart_runs_it() {
    let env = KubeTestEnv::new("chart-agent").await.unwrap();
    let ns = env.namespace.clone();
    let authority = format!("{AGENT}.{ns}.svc");
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path();
    make_certificates(certs, &authority);
    create_ssh_secret(&env, certs, "kvm-agent-ssh").await;
    create_secret(
        &env,
        &format!("{AGENT}-tls"),
        &[
            ("tls.crt", &certs.join("server.crt")),
            ("tls.key", &certs.join("server.key")),
            ("ca.crt", &certs.join("ca.crt")),
        ],
    )
    .await;
    // The operator's client certificate: the agent's probe presents it too.
    create_secret(
        &env,
        "ag-egressproxy-operator-client-tls",
        &[
            ("tls.crt", &certs.join("client.crt")),
            ("tls.key", &certs.join("client.key")),
            ("ca.crt", &certs.join("ca.crt")),
        ],
    )
    .await;

    let values = dir.path().join("values.yaml");
    std::fs::write(&values, VALUES).unwrap();
    let helm = Helm::new(env.apiserver().kubeconfig_path()).unwrap();
    helm.install("ag", &ns, &[&values], &[]).unwrap();

    let agent = ChartPod::start(&env, &ns, AGENT, "kvm-agent", None)
        .await
        .unwrap();
    let address = agent.listen().to_string();
    // Until it answers, the agent is still starting (nothing listens yet).
    let what = "the agent to answer over mutual TLS";
    let answer = eventually(what, Duration::from_secs(30), || async {
        let output = grpcurl(&address, &authority, certs, true);
        if output.status.success() {
            Ok(String::from_utf8_lossy(&output.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).into_owned())
        }
    })
    .await;
    assert!(answer.contains("\"contractVersion\""), "{answer}");

    let refused = grpcurl(&address, &authority, certs, false);
    assert!(
        !refused.status.success(),
        "a client without a certificate was served: {}",
        String::from_utf8_lossy(&refused.stdout)
    );
}
