//! Probes that mean something, and `helm test`, as the chart runs them (no kubelet runs
//! here: the agent runs as its Deployment says, and each exec runs the workspace's
//! binary in the pod's stand-in filesystem, as the kubelet would in the container):
//!
//! - the agent's readiness and liveness probes ask its gRPC health over the TLS or
//!   mutual TLS it serves (the kubelet's own gRPC probe speaks no TLS; a TCP probe only
//!   shows the port opens): they pass while it serves, and fail with the reason once it
//!   is gone;
//! - with TLS off they ask in plaintext;
//! - the `helm test` pod asks the agent's health through its Service and lists its
//!   instances: it fails naming the hypervisor the agent cannot reach, and passes
//!   against a provider that lists (the reference provider with the chart's
//!   certificates).

mod chart_support;

use std::time::Duration;

use chart_support::create_ssh_secret;
use egressproxy_integration::chart_pod::{ChartPod, Probe, hook_pod_spec, run_pod_to_completion};
use egressproxy_integration::eventually::eventually;
use egressproxy_integration::helm::{Helm, Kubectl};
use egressproxy_integration::kube_env::KubeTestEnv;
use egressproxy_integration::reference_provider::ReferenceProvider;
use egressproxy_provider::client::{ClientOptions, ClientTls, connect_lazy};
use egressproxy_provider::pb;

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

fn text(output: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Runs `probe` until it passes (the agent is still starting until it listens), up to
/// 30 s; returns its output.
async fn passes(agent: &ChartPod, probe: Probe) -> String {
    // Each probe is the next look, as the kubelet's period would be.
    let what = format!("the {probe:?} probe to pass");
    eventually(&what, Duration::from_secs(30), || async {
        let output = agent.run_probe(probe).unwrap();
        if output.status.success() {
            Ok(text(&output))
        } else {
            Err(text(&output))
        }
    })
    .await
}

/// Installs release `release` with VALUES plus `set`, and starts its agent.
async fn install_and_start(env: &KubeTestEnv, release: &str, set: &[&str]) -> (Helm, ChartPod) {
    let ns = env.namespace.as_str();
    let dir = tempfile::tempdir().unwrap();
    create_ssh_secret(env, dir.path(), "kvm-agent-ssh").await;
    let values = dir.path().join("values.yaml");
    std::fs::write(&values, VALUES).unwrap();
    let helm = Helm::new(env.apiserver().kubeconfig_path()).unwrap();
    let watch = format!("operator.watchNamespaces={{{ns}}}");
    // Two releases in one apiserver: neither owns the cluster-wide CRD.
    let mut all = vec![watch.as_str(), "crds.enabled=false"];
    all.extend_from_slice(set);
    helm.install(release, ns, &[&values], &all).unwrap();
    let agent = ChartPod::start(
        env,
        ns,
        &format!("{release}-egressproxy-kvm-agent"),
        "kvm-agent",
        None,
    )
    .await
    .unwrap();
    (helm, agent)
}

#[tokio::test]
async fn the_agent_s_probes_ask_its_health_over_mutual_tls_and_helm_test_lists_instances() {
    let env = KubeTestEnv::new("chart-probes").await.unwrap();
    let ns = env.namespace.clone();
    let (helm, agent) = install_and_start(&env, "pr", &[]).await;
    let answer = passes(&agent, Probe::Readiness).await;
    assert!(answer.contains("SERVING"), "{answer}");
    passes(&agent, Probe::Liveness).await;

    // `helm test`: the hook's pod, through the Service's name (here: where the agent
    // listens).
    let hooks = helm.get_hooks("pr", &ns).unwrap();
    let kubectl = Kubectl::new(env.apiserver().kubeconfig_path());
    let pod = hook_pod_spec(&kubectl, &hooks, "Pod", "pr-egressproxy-kvm-agent-test").unwrap();
    let service = format!("pr-egressproxy-kvm-agent.{ns}.svc:50051");
    let output = run_pod_to_completion(
        &env,
        &ns,
        &pod,
        None,
        &[(service, agent.listen().to_string())],
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let said = text(&output);
    assert!(
        !output.status.success()
            && said.contains("SERVING")
            && said.contains("host hv1: cannot connect to SSH server 127.0.0.1:1"),
        "helm test must report the unreachable hypervisor: {said}"
    );

    // The same pod against a provider that lists: the reference provider, serving the
    // agent's certificate and requiring the operator's, with one instance.
    let tls = agent.root().join("etc/kvm-agent/tls");
    let file = |name: &str| tls.join(name).display().to_string();
    let provider = ReferenceProvider::start(&[
        "--tls-cert",
        &file("tls.crt"),
        "--tls-key",
        &file("tls.key"),
        "--client-ca",
        &file("ca.crt"),
    ])
    .unwrap();
    let mut options = ClientOptions::new(format!("https://{}", provider.address()));
    options.tls = Some(ClientTls {
        ca: tls.join("ca.crt"),
        domain: Some(format!("pr-egressproxy-kvm-agent.{ns}.svc")),
        identity: Some((
            agent.root().join("etc/kvm-agent/probe-tls/tls.crt"),
            agent.root().join("etc/kvm-agent/probe-tls/tls.key"),
        )),
    });
    connect_lazy(&options)
        .unwrap()
        .create_instance(pb::CreateInstanceRequest {
            key: "k1".into(),
            name: "team-a/egress".into(),
            placement: Some(pb::Placement {
                location: None,
                machine_type: "small".into(),
                image: "debian-12".into(),
            }),
            proxy_port: 3128,
            ..Default::default()
        })
        .await
        .unwrap();
    let service = format!("pr-egressproxy-kvm-agent.{ns}.svc:50051");
    let output = run_pod_to_completion(
        &env,
        &ns,
        &pod,
        None,
        &[(service, provider.address().to_owned())],
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let said = text(&output);
    assert!(output.status.success(), "helm test failed: {said}");
    assert!(
        said.contains("SERVING") && said.contains("1 instances") && said.contains("team-a/egress"),
        "{said}"
    );

    // Gone: the probe fails and says why.
    let mut agent = agent;
    agent.stop();
    let output = agent.run_probe(Probe::Liveness).unwrap();
    assert!(
        !output.status.success(),
        "the probe of a stopped agent passed: {}",
        text(&output)
    );
    assert!(
        text(&output).contains(&agent.listen().to_string()),
        "{}",
        text(&output)
    );
}

#[tokio::test]
async fn with_tls_off_the_probes_ask_in_plaintext() {
    let env = KubeTestEnv::new("chart-probes-plain").await.unwrap();
    let (_helm, agent) = install_and_start(
        &env,
        "pp",
        &[
            "kvmAgent.tls.enabled=false",
            "kvmAgent.tls.mtls.enabled=false",
        ],
    )
    .await;
    let answer = passes(&agent, Probe::Readiness).await;
    assert!(answer.contains("http://"), "{answer}");
}
