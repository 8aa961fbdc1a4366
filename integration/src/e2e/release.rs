//! The stack's operator and kvm-agent installed the way users install them: one
//! `helm install` of `charts/egressproxy` with the in-cluster agent, mutual TLS between
//! the two, and the agent's SSH key and known_hosts in a Secret.
//!
//! The test apiserver runs no pods, so each Deployment runs as a [`ChartPod`]: its args,
//! env and volumes (ConfigMaps and Secrets) materialised out of cluster. The agent runs
//! on loopback at the port the chart's Service gives; the operator runs in the stack's
//! network namespace, where `/etc/netns/<netns>/hosts` (which `ip netns exec` mounts over
//! `/etc/hosts`) resolves the agent Service's DNS name to loopback, relayed to the agent.
//! So the operator dials the endpoint the chart wrote and checks the certificate made
//! for that name.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};

use crate::certificates::make_certificates;
use crate::chart_pod::{ChartPod, PodOptions};
use crate::helm::Helm;
use crate::kube_env::KubeTestEnv;

/// The release name.
const RELEASE: &str = "e2e";
/// The chart's names for what the release makes.
const OPERATOR: &str = "e2e-egressproxy-operator";
const AGENT: &str = "e2e-egressproxy-kvm-agent";
const SSH_SECRET: &str = "kvm-agent-ssh";

/// An installed release; removes the namespace's hosts file on drop (the release itself
/// goes with the run's Kubernetes namespace).
#[derive(Debug)]
pub struct Release {
    namespace: String,
    netns: String,
    hosts_dir: PathBuf,
    agent_port: u16,
}

/// What the release's values say beyond the chart's defaults.
#[derive(Debug)]
pub struct ReleaseSettings<'a> {
    /// The `kvmAgent.config` document (hosts, machine types, images, transport), as YAML
    /// indented for that key.
    pub agent_config: &'a str,
    /// The agent's private key and known_hosts file.
    pub ssh_key: &'a Path,
    /// See [`ReleaseSettings::ssh_key`].
    pub known_hosts: &'a Path,
    /// The provider name Proxies use.
    pub provider: &'a str,
    /// The port of the agent's Service (and so of the agent on loopback).
    pub agent_port: u16,
    /// The OTLP endpoint both export spans to.
    pub otel_endpoint: &'a str,
    /// `operator.clusterName`.
    pub cluster_name: &'a str,
    /// The network namespace the operator runs in.
    pub netns: &'a str,
    /// Where certificates and the values file go.
    pub dir: &'a Path,
}

impl Release {
    /// Makes the Secrets the chart expects, installs it and writes the hosts file.
    pub async fn install(
        kube: &KubeTestEnv,
        settings: &ReleaseSettings<'_>,
    ) -> anyhow::Result<Self> {
        let namespace = kube.namespace.clone();
        let service = format!("{AGENT}.{namespace}.svc");
        let certs = settings.dir.join("certs");
        std::fs::create_dir_all(&certs)?;
        make_certificates(&certs, &service)?;
        create_secret(
            kube,
            SSH_SECRET,
            &[
                ("id_ed25519", settings.ssh_key),
                ("known_hosts", settings.known_hosts),
            ],
        )
        .await?;
        create_secret(
            kube,
            &format!("{AGENT}-tls"),
            &[
                ("tls.crt", &certs.join("server.crt")),
                ("tls.key", &certs.join("server.key")),
                ("ca.crt", &certs.join("ca.crt")),
            ],
        )
        .await?;
        create_secret(
            kube,
            &format!("{OPERATOR}-client-tls"),
            &[
                ("tls.crt", &certs.join("client.crt")),
                ("tls.key", &certs.join("client.key")),
                ("ca.crt", &certs.join("ca.crt")),
            ],
        )
        .await?;

        let values = settings.dir.join("values.yaml");
        std::fs::write(&values, values_yaml(settings, &namespace))?;
        let helm = Helm::new(kube.apiserver().kubeconfig_path())?;
        helm.install(RELEASE, &namespace, &[&values], &[])
            .context("helm install the chart")?;

        let hosts_dir = Path::new("/etc/netns").join(settings.netns);
        std::fs::create_dir_all(&hosts_dir)?;
        std::fs::write(
            hosts_dir.join("hosts"),
            format!("127.0.0.1 localhost\n127.0.0.1 {service}\n::1 localhost\n"),
        )?;
        Ok(Self {
            namespace,
            netns: settings.netns.to_owned(),
            hosts_dir,
            agent_port: settings.agent_port,
        })
    }

    /// Runs the agent's Deployment on loopback, its output in `log`.
    pub async fn start_agent(&self, kube: &KubeTestEnv, log: &Path) -> anyhow::Result<ChartPod> {
        let options = PodOptions {
            log: Some(log.to_owned()),
            listen: Some(SocketAddr::from(([127, 0, 0, 1], self.agent_port))),
            ..PodOptions::default()
        };
        ChartPod::start_with(kube, &self.namespace, AGENT, "kvm-agent", None, &options).await
    }

    /// Runs the operator's Deployment, as its ServiceAccount, in the network namespace.
    pub async fn start_operator(&self, kube: &KubeTestEnv, log: &Path) -> anyhow::Result<ChartPod> {
        let options = PodOptions {
            netns: Some(self.netns.clone()),
            log: Some(log.to_owned()),
            ..PodOptions::default()
        };
        let binary = "egressproxy-operator";
        ChartPod::start_with(
            kube,
            &self.namespace,
            OPERATOR,
            binary,
            Some(OPERATOR),
            &options,
        )
        .await
    }

    /// The directory of the hosts file (gone after drop).
    pub fn hosts_dir(&self) -> &Path {
        &self.hosts_dir
    }
}

impl Drop for Release {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.hosts_dir);
    }
}

/// The values a user with one hypervisor would write, plus debug logs (the run checks
/// that no secret shows at any level) and a short span export delay.
fn values_yaml(settings: &ReleaseSettings<'_>, namespace: &str) -> String {
    let debug_env = |filter: &str| {
        format!(
            "\n    - {{name: RUST_LOG, value: \"{filter}\"}}\
             \n    - {{name: OTEL_BSP_SCHEDULE_DELAY, value: \"200\"}}"
        )
    };
    format!(
        "crds:\n\
         \x20 enabled: false\n\
         global:\n\
         \x20 otel:\n\
         \x20   endpoint: \"{otel}\"\n\
         operator:\n\
         \x20 clusterName: \"{cluster}\"\n\
         \x20 watchNamespaces: [\"{namespace}\"]\n\
         \x20 gc: {{interval: 1h}}\n\
         \x20 extraEnv:{operator_env}\n\
         kvmAgent:\n\
         \x20 enabled: true\n\
         \x20 providerName: {provider}\n\
         \x20 port: {port}\n\
         \x20 callTimeout: 60s\n\
         \x20 extraEnv:{agent_env}\n\
         \x20 ssh:\n\
         \x20   secretName: {SSH_SECRET}\n\
         \x20 tls:\n\
         \x20   source: secret\n\
         \x20   mtls:\n\
         \x20     enabled: true\n\
         \x20 config:\n{config}",
        otel = settings.otel_endpoint,
        cluster = settings.cluster_name,
        operator_env = debug_env("info,kube=warn,egressproxy_operator=debug"),
        provider = settings.provider,
        port = settings.agent_port,
        agent_env = debug_env("info,kvm_agent=debug,egressproxy_provider=debug"),
        config = settings.agent_config,
    )
}

async fn create_secret(
    kube: &KubeTestEnv,
    name: &str,
    files: &[(&str, &Path)],
) -> anyhow::Result<()> {
    let mut data = serde_json::Map::new();
    for (key, path) in files {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("read {} for Secret {name}", path.display()))?;
        data.insert((*key).to_owned(), serde_json::Value::String(text));
    }
    let secret: Secret = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "stringData": data,
    }))?;
    Api::<Secret>::namespaced(kube.client.clone(), &kube.namespace)
        .create(&PostParams::default(), &secret)
        .await
        .with_context(|| format!("create Secret {name}"))?;
    Ok(())
}
