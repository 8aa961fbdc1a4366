//! The stack's operator and kvm-agent installed the way users install them: the commands
//! of `docs/install.md` ("2a. Agent in the cluster, over SSH"), run as written
//! ([`crate::doc_commands`]) with this machine's names filled in, into the stack's
//! single-node cluster ([`crate::cluster`]). The chart's Deployments run as pods under
//! the kubelet, from the images `make images` built from `deploy/docker/`, with the
//! chart's own security context (uid 65532, read-only root filesystem) and its own
//! certificates for the mutual TLS between the two (the default `tls.source: helm`).
//!
//! 1. [`Release::install`] runs the document's first block (the release's namespace, the
//!    agent's SSH key, the hypervisor's host key by `ssh-keyscan`, the Secret), authorizes
//!    the new key at the stack's sshd as the document asks, writes `my-values.yaml` from
//!    `examples/in-cluster-agent-ssh.yaml` with the stack's hosts, machine types and
//!    images, and runs the second block (`helm install --wait`, the pods, the agent's log).
//! 2. [`Release::wait_available`] watches both Deployments until each has an available
//!    replica (its readiness probe passed), and shows the pods' states and output if not.
//!    [`Release::upgrade_as_documented`] runs the document's `helm upgrade --wait` after
//!    a change to `my-values.yaml`, and tells which pods run afterwards.
//! 3. [`Release::uninstall_as_documented`] runs "Upgrades and uninstall" command by
//!    command: the refused `helm uninstall`, the hook's log, the deletion it asks for,
//!    the `helm uninstall` that then passes; then it waits until the release's pods are
//!    gone and lists whatever of the release is still in the cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, ListParams};

use crate::cluster::{Cluster, pods};
use crate::doc_commands::{DocShell, LineOutcome, blocks_under, commands_of, fill_in};
use crate::helm::{Helm, Kubectl, chart_dir};
use crate::kube_env::KubeTestEnv;
use crate::sshd::Sshd;

/// The release name, as `docs/install.md` installs it.
pub const RELEASE: &str = "egressproxy";
/// The operator's Deployment (the chart's name for it).
pub const OPERATOR: &str = "egressproxy-operator";
/// The agent's Deployment and Service.
pub const AGENT: &str = "egressproxy-kvm-agent";
/// The document the release is installed and uninstalled by.
const INSTALL_DOC: &str = include_str!("../../../docs/install.md");
/// The chart's example the values start from, as the document says.
const EXAMPLE_VALUES: &str =
    include_str!("../../../charts/egressproxy/examples/in-cluster-agent-ssh.yaml");
/// The label every object of the release carries.
const INSTANCE_LABEL: &str = "app.kubernetes.io/instance=egressproxy";
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
    shell: DocShell,
}

/// What the release's values say beyond the chart's example.
#[derive(Debug)]
pub struct ReleaseSettings<'a> {
    /// The `kvmAgent.config` document (hosts, machine types, images, transport).
    pub agent_config: &'a str,
    /// The hypervisor's sshd; the key the document makes is authorized there.
    pub sshd: &'a Sshd,
    /// The command that collects the hypervisor's host key, in place of the document's
    /// `ssh-keyscan` of its example hosts.
    pub keyscan: &'a str,
    /// The provider name Proxies use.
    pub provider: &'a str,
    /// The OTLP endpoint both export spans to.
    pub otel_endpoint: &'a str,
    /// `operator.clusterName`.
    pub cluster_name: &'a str,
    /// The working directory of the document's commands (keys, values).
    pub dir: &'a Path,
}

/// What the document's uninstall commands did, each in order.
#[derive(Debug)]
pub struct DocumentedUninstall {
    /// `helm uninstall` while Proxies exist: refused by the pre-delete hook.
    pub refused: LineOutcome,
    /// The hook Job's log.
    pub hook_log: LineOutcome,
    /// `kubectl delete proxypools,proxies …`.
    pub deleted: LineOutcome,
    /// `helm uninstall` once they are gone.
    pub uninstalled: LineOutcome,
    /// What of the release is still in the cluster afterwards ([`Kubectl::release_leftovers`]).
    pub left: Vec<String>,
}

impl Release {
    /// Steps 1 and 2 of the module docs: the document's commands, as written.
    pub async fn install(
        kube: &KubeTestEnv,
        cluster: &Cluster,
        settings: &ReleaseSettings<'_>,
    ) -> anyhow::Result<Self> {
        let namespace = format!(
            "egressproxy-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        let kubeconfig = kube.apiserver().kubeconfig_path();
        let shell = DocShell::new(settings.dir, kubeconfig)?;
        let in_namespace = [
            ("namespace egressproxy", format!("namespace {namespace}")),
            ("-n egressproxy", format!("-n {namespace}")),
        ];

        let keys = install_block("2a.", "ssh-keygen")?;
        let mut pairs = in_namespace.to_vec();
        pairs.push((
            "ssh-keyscan hv1.example.org hv2.example.org",
            settings.keyscan.to_owned(),
        ));
        shell.run(&fill_in(&keys, &pairs)?)?;
        let public_key = std::fs::read_to_string(settings.dir.join("id_ed25519.pub"))
            .context("the document's ssh-keygen wrote id_ed25519.pub")?;
        settings.sshd.authorize(&public_key)?;

        std::fs::write(settings.dir.join("my-values.yaml"), values_yaml(settings)?)?;
        let install = install_block("2a.", "helm install")?;
        let mut pairs = vec![("charts/egressproxy", chart_dir().display().to_string())];
        pairs.push(in_namespace[1].clone());
        let release = Self {
            helm: Helm::new(kubeconfig)?,
            kubectl: Kubectl::new(kubeconfig),
            namespace,
            shell,
        };
        release
            .shell
            .run(&fill_in(&install, &pairs)?)
            .with_context(|| {
                format!(
                    "helm install as documented\n{}",
                    release.pods_report(cluster)
                )
            })?;
        Ok(release)
    }

    /// The release's namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
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
        let secret = Api::<Secret>::namespaced(kube.client.clone(), &self.namespace)
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

    /// The document's `helm upgrade`, as written, after `edit` changed `my-values.yaml`;
    /// the names of the release's pods per component (`operator`, `kvm-agent`) that run
    /// afterwards, so that a caller sees which were replaced.
    pub async fn upgrade_as_documented(
        &self,
        kube: &KubeTestEnv,
        edit: impl FnOnce(&mut serde_norway::Value),
    ) -> anyhow::Result<BTreeMap<String, BTreeSet<String>>> {
        let path = self.shell.dir().join("my-values.yaml");
        let mut values: serde_norway::Value =
            serde_norway::from_str(&std::fs::read_to_string(&path)?)?;
        edit(&mut values);
        std::fs::write(&path, serde_norway::to_string(&values)?)?;
        let block = install_block("Upgrades and uninstall", "helm upgrade")?;
        let block = fill_in(
            &block,
            &[
                ("charts/egressproxy", chart_dir().display().to_string()),
                ("-n egressproxy", format!("-n {}", self.namespace)),
            ],
        )?;
        self.shell
            .run(&block)
            .context("helm upgrade as documented")?;
        self.running_pods(kube).await
    }

    /// The names of the release's pods that run and are not being deleted, per component.
    pub async fn running_pods(
        &self,
        kube: &KubeTestEnv,
    ) -> anyhow::Result<BTreeMap<String, BTreeSet<String>>> {
        let pods = Api::<Pod>::namespaced(kube.client.clone(), &self.namespace)
            .list(&ListParams::default().labels(INSTANCE_LABEL))
            .await
            .context("list the release's pods")?;
        let mut running: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for pod in pods {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if phase != Some("Running") || pod.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let component = pod
                .metadata
                .labels
                .as_ref()
                .and_then(|labels| labels.get("app.kubernetes.io/component"))
                .cloned()
                .unwrap_or_default();
            running
                .entry(component)
                .or_default()
                .insert(pod.metadata.name.unwrap_or_default());
        }
        Ok(running)
    }

    /// Step 3 of the module docs. `before_uninstall` runs just before the last `helm
    /// uninstall`, while the release's pods still run (to copy their logs).
    pub async fn uninstall_as_documented(
        self,
        kube: &KubeTestEnv,
        before_uninstall: impl FnOnce(),
    ) -> anyhow::Result<DocumentedUninstall> {
        let block = install_block("Upgrades and uninstall", "helm uninstall")?;
        let block = fill_in(
            &block,
            &[("-n egressproxy", format!("-n {}", self.namespace))],
        )?;
        let commands = commands_of(&block);
        let [refused, hook_log, deleted, uninstalled] = commands.as_slice() else {
            bail!(
                "docs/install.md's uninstall block has {} commands, not 4:\n{block}",
                commands.len()
            );
        };
        let refused = self.shell.run_command(refused)?;
        let hook_log = self.shell.run_command(hook_log)?;
        let deleted = self.shell.run_command(deleted)?;
        before_uninstall();
        let uninstalled = self.shell.run_command(uninstalled)?;
        pods::gone(
            &kube.client,
            &self.namespace,
            INSTANCE_LABEL,
            PODS_GONE_WITHIN,
        )
        .await?;
        Ok(DocumentedUninstall {
            refused,
            hook_log,
            deleted,
            uninstalled,
            left: self.kubectl.release_leftovers(&self.namespace, RELEASE),
        })
    }
}

/// The shell block under `docs/install.md`'s heading `section` that holds `command`.
fn install_block(section: &str, command: &str) -> anyhow::Result<String> {
    blocks_under(INSTALL_DOC, section, "sh")?
        .into_iter()
        .find(|block| block.contains(command))
        .with_context(|| {
            format!("docs/install.md's section {section:?} has no block with {command:?}")
        })
}

/// `my-values.yaml`: the chart's in-cluster example with this stack's cluster name,
/// provider name and agent configuration, plus what the test adds: spans to the stack's
/// receiver, debug logs (the run checks that no secret shows at any level), a short span
/// export delay, no garbage-collection sweep during the run, and the stack's call
/// deadline.
fn values_yaml(settings: &ReleaseSettings<'_>) -> anyhow::Result<String> {
    use serde_norway::Value;
    let mut values: Value = serde_norway::from_str(EXAMPLE_VALUES)?;
    let debug_env = |filter: &str| -> anyhow::Result<Value> {
        Ok(serde_norway::from_str(&format!(
            "[{{name: RUST_LOG, value: \"{filter}\"}}, {{name: OTEL_BSP_SCHEDULE_DELAY, value: \"200\"}}]"
        ))?)
    };
    values["global"] = serde_norway::from_str(&format!(
        "otel: {{endpoint: \"{}\"}}",
        settings.otel_endpoint
    ))?;
    let operator = &mut values["operator"];
    operator["clusterName"] = settings.cluster_name.into();
    operator["gc"] = serde_norway::from_str("{interval: 1h}")?;
    operator["extraEnv"] = debug_env("info,kube=warn,egressproxy_operator=debug")?;
    let agent = &mut values["kvmAgent"];
    agent["providerName"] = settings.provider.into();
    agent["callTimeout"] = "60s".into();
    agent["extraEnv"] = debug_env("info,kvm_agent=debug,egressproxy_provider=debug")?;
    agent["config"] = serde_norway::from_str(settings.agent_config)
        .context("the stack's agent configuration is YAML")?;
    Ok(serde_norway::to_string(&values)?)
}
