//! The stack's operator and kvm-agent installed the way users install them: one
//! `helm install` of `charts/egressproxy` into the stack's single-node cluster
//! ([`crate::cluster`]), with the in-cluster agent, mutual TLS between the two, and the
//! agent's SSH key and known_hosts in a Secret. The chart's Deployments run as pods under
//! the kubelet, from the images `make images` built from `deploy/docker/` and with the
//! chart's own security context (uid 65532, read-only root filesystem).
//!
//! 1. [`Release::install`] makes the Secrets the chart expects (TLS for the agent's
//!    Service name, a client certificate for the operator, the SSH key), writes the
//!    values, and runs `helm install`.
//! 2. [`Release::wait_available`] watches both Deployments until each has an available
//!    replica (its readiness probe passed), and shows the pods' states and output if not.
//! 3. [`Release::uninstall`] runs `helm uninstall`, waits until the release's pods are
//!    gone, and lists whatever of the release is still in the cluster.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams};

use crate::certificates::make_certificates;
use crate::cluster::{Cluster, pods};
use crate::helm::{Helm, Kubectl};
use crate::kube_env::KubeTestEnv;

/// The release name.
pub const RELEASE: &str = "e2e";
/// The operator's Deployment (the chart's name for it).
pub const OPERATOR: &str = "e2e-egressproxy-operator";
/// The agent's Deployment and Service.
pub const AGENT: &str = "e2e-egressproxy-kvm-agent";
const SSH_SECRET: &str = "kvm-agent-ssh";
/// The label every object of the release carries.
const INSTANCE_LABEL: &str = "app.kubernetes.io/instance=e2e";
/// How long `helm test` may take: the test pod starts from an image already on the
/// node and makes two calls of at most 20 s each.
const HELM_TEST_WITHIN: &str = "3m";
/// How long `helm uninstall` may take to remove the release's pods.
const PODS_GONE_WITHIN: Duration = Duration::from_secs(120);

/// An installed release.
#[derive(Debug)]
pub struct Release {
    namespace: String,
    helm: Helm,
    kubectl: Kubectl,
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
    /// The OTLP endpoint both export spans to.
    pub otel_endpoint: &'a str,
    /// `operator.clusterName`.
    pub cluster_name: &'a str,
    /// Where certificates and the values file go.
    pub dir: &'a Path,
}

impl Release {
    /// Makes the Secrets the chart expects and installs it.
    pub async fn install(
        kube: &KubeTestEnv,
        settings: &ReleaseSettings<'_>,
    ) -> anyhow::Result<Self> {
        let namespace = kube.namespace.clone();
        let certs = settings.dir.join("certs");
        std::fs::create_dir_all(&certs)?;
        make_certificates(&certs, &format!("{AGENT}.{namespace}.svc"))?;
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
        let kubeconfig = kube.apiserver().kubeconfig_path();
        let helm = Helm::new(kubeconfig)?;
        helm.install(RELEASE, &namespace, &[&values], &[])
            .context("helm install the chart")?;
        Ok(Self {
            namespace,
            helm,
            kubectl: Kubectl::new(kubeconfig),
        })
    }

    /// Waits until the operator's and the agent's Deployments each have an available
    /// replica; on timeout, fails with their pods' states and output.
    pub async fn wait_available(
        &self,
        kube: &KubeTestEnv,
        cluster: &Cluster,
        within: Duration,
    ) -> anyhow::Result<()> {
        for name in [AGENT, OPERATOR] {
            if !pods::deployment_available(&kube.client, &self.namespace, name, within).await? {
                bail!(
                    "Deployment {name} had no available replica within {within:?}\n{}\n{}",
                    self.pods_report(cluster),
                    cluster.log_tails()
                );
            }
        }
        Ok(())
    }

    /// The release's pods as `kubectl get pods -o wide` lists them, and each
    /// Deployment's output, for a failed test's message.
    pub fn pods_report(&self, cluster: &Cluster) -> String {
        let pods = self
            .kubectl
            .run(
                &[
                    "get",
                    "pods",
                    "-n",
                    &self.namespace,
                    "-l",
                    INSTANCE_LABEL,
                    "-o",
                    "wide",
                ],
                None,
            )
            .unwrap_or_else(|err| format!("{err:#}"));
        let mut report = format!("the release's pods:\n{pods}");
        for name in [OPERATOR, AGENT] {
            report.push_str(&format!(
                "--- {name} (its pods' output)\n{}\n",
                cluster.deployment_logs(&self.namespace, name)
            ));
        }
        report
    }

    /// The agent's configuration as its pod reads it (the chart's config Secret).
    pub async fn agent_config(&self, kube: &KubeTestEnv) -> anyhow::Result<String> {
        let secret = kube
            .namespaced::<Secret>()
            .get(AGENT)
            .await
            .with_context(|| format!("read the agent's config Secret {AGENT}"))?;
        let bytes = secret
            .data
            .and_then(|mut data| data.remove("config.yaml"))
            .context("the agent's config Secret has no config.yaml")?;
        Ok(String::from_utf8(bytes.0)?)
    }

    /// `helm test`: the chart's test pod asks the agent's health through its Service and
    /// lists its instances, as a user checks an install. helm's report, or the failure
    /// with the release's pods.
    pub fn test(&self, cluster: &Cluster) -> anyhow::Result<String> {
        self.helm
            .test(RELEASE, &self.namespace, HELM_TEST_WITHIN)
            .with_context(|| format!("helm test\n{}", self.pods_report(cluster)))
    }

    /// `helm uninstall`, then waits until the release's pods are gone; what of the
    /// release is still there ([`Kubectl::release_leftovers`]).
    pub async fn uninstall(&self, kube: &KubeTestEnv) -> anyhow::Result<Vec<String>> {
        self.helm
            .uninstall(RELEASE, &self.namespace)
            .context("helm uninstall")?;
        pods::gone(
            &kube.client,
            &self.namespace,
            INSTANCE_LABEL,
            PODS_GONE_WITHIN,
        )
        .await?;
        Ok(self.kubectl.release_leftovers(&self.namespace, RELEASE))
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
