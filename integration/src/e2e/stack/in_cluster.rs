//! The stack with the chart installed as users install it ([`StackOptions::through_chart`]):
//! the operator and the agent run as pods of a single-node cluster.
//!
//! 1. The hypervisor's services are reached at its address on the guests' network, as a
//!    cluster reaches a hypervisor: sshd, the image mirror and the span receiver listen
//!    on the host's loopback, and relays in the hypervisor's namespace take their ports
//!    on [`GATEWAY`].
//! 2. The cluster ([`Cluster::start`]) gets the project's images, and its node's uplink
//!    into the hypervisor's namespace, routing [`GUEST_NETWORK`] through it: pods reach
//!    the guests (the operator's health check, clients of the proxies) and the gateway's
//!    services by routing, masqueraded to the node's address; the libvirt network is
//!    routed, so the guests are reachable from outside it.
//! 3. The commands of `docs/install.md` ([`Release::install`]) in the `install` folder
//!    of [`Stack::dir`], the host key collected from sshd at the gateway's address, into
//!    a namespace of the release's own; then it waits until both Deployments are
//!    available, and copies the agent's configuration as its pod reads it to
//!    [`Stack::agent_config`].
//! 4. [`Stack::collect_pod_logs`] copies the pods' output to `operator.log` and
//!    `kvm-agent.log` of [`Stack::dir`], where [`Stack::log_tails`] and the tests' secret
//!    checks read them.
//!
//! [`StackOptions::through_chart`]: super::StackOptions::through_chart

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;

use super::{GATEWAY, GUEST_NETWORK, PROVIDER, Stack};
use crate::cluster::{Cluster, ClusterOptions, Uplink};
use crate::e2e::release::{AGENT, DocumentedUninstall, OPERATOR, Release, ReleaseSettings};
use crate::relay::LoopbackRelay;

/// The project's images (`make images`) the cluster imports.
const PROJECT_IMAGES: [&str; 2] = ["operator", "kvm-agent"];
/// The folder of [`Stack::dir`] where the install document's commands run.
const INSTALL_DIR: &str = "install";
/// How long the release's pods may take to be Ready (the images are local; the agent
/// checks its hosts first).
const AVAILABLE_WITHIN: Duration = Duration::from_secs(180);

impl Stack {
    /// Steps 1-3 of the module docs.
    pub(super) async fn install_in_cluster(
        &mut self,
        handle: &tokio::runtime::Handle,
    ) -> anyhow::Result<()> {
        let netns = self.netns().to_owned();
        for port in [self.sshd.port(), self.images.port(), self.spans.port()] {
            self.relays.push(LoopbackRelay::start_on(
                handle,
                &netns,
                SocketAddr::from((GATEWAY, port)),
            )?);
        }
        let options = ClusterOptions {
            uplink: Some(Uplink {
                netns: netns.clone(),
                routed: vec![GUEST_NETWORK.to_owned()],
            }),
            images: PROJECT_IMAGES.iter().map(|s| (*s).to_owned()).collect(),
        };
        self.cluster = Some(Cluster::start(&options).await?);
        let cluster = self.cluster.as_ref().context("the cluster")?;

        let agent_config = self.agent_settings(0, false, GATEWAY)?;
        let otel_endpoint = self
            .spans
            .endpoint()
            .replace("127.0.0.1", &GATEWAY.to_string());
        let cluster_name = format!("e2e-{}", self.kube.namespace);
        // The hypervisor's sshd as the cluster reaches it: at the gateway's address.
        let keyscan = format!(
            "ip netns exec {netns} ssh-keyscan -p {port} {GATEWAY}",
            port = self.sshd.port()
        );
        let dir = self.dir.path().join(INSTALL_DIR);
        std::fs::create_dir_all(&dir)?;
        let settings = ReleaseSettings {
            agent_config: &agent_config,
            sshd: &self.sshd,
            keyscan: &keyscan,
            provider: PROVIDER,
            otel_endpoint: &otel_endpoint,
            cluster_name: &cluster_name,
            dir: &dir,
        };
        let release = Release::install(&self.kube, cluster, &settings).await?;
        release
            .wait_available(&self.kube, cluster, AVAILABLE_WITHIN)
            .await?;
        std::fs::write(self.agent_config(), release.agent_config(&self.kube).await?)?;
        self.release = Some(release);
        Ok(())
    }

    /// The single-node cluster the chart is installed into, with
    /// [`super::StackOptions::through_chart`].
    pub fn cluster(&self) -> Option<&Cluster> {
        self.cluster.as_ref()
    }

    /// Copies the output of the release's operator and agent pods to `operator.log` and
    /// `kvm-agent.log` of [`Stack::dir`] (nothing without the chart: the processes write
    /// there themselves).
    pub fn collect_pod_logs(&self) {
        if let (Some(cluster), Some(release)) = (&self.cluster, &self.release) {
            copy_pod_logs(cluster, release.namespace(), self.dir.path());
        }
    }

    /// The release's pods and the cluster's parts, for a failed test's output.
    pub fn cluster_report(&self) -> String {
        match (&self.cluster, &self.release) {
            (Some(cluster), Some(release)) => {
                format!("{}\n{}", release.pods_report(cluster), cluster.log_tails())
            }
            _ => String::new(),
        }
    }

    /// `helm test` of the release (see [`Release::test`]).
    pub fn test_release(&self) -> anyhow::Result<String> {
        let (Some(cluster), Some(release)) = (&self.cluster, &self.release) else {
            anyhow::bail!("the stack was not installed with the chart");
        };
        release.test(cluster)
    }

    /// The release's namespace (with [`super::StackOptions::through_chart`]).
    pub fn release_namespace(&self) -> Option<&str> {
        self.release.as_ref().map(Release::namespace)
    }

    /// The names of the release's running pods per component (see
    /// [`Release::running_pods`]).
    pub async fn release_pods(&self) -> anyhow::Result<BTreeMap<String, BTreeSet<String>>> {
        let release = self.release.as_ref().context("the stack has no release")?;
        release.running_pods(&self.kube).await
    }

    /// `docs/install.md`'s `helm upgrade` after `edit` changed the values (see
    /// [`Release::upgrade_as_documented`]); the pods that run afterwards.
    pub async fn upgrade_as_documented(
        &self,
        edit: impl FnOnce(&mut serde_norway::Value),
    ) -> anyhow::Result<BTreeMap<String, BTreeSet<String>>> {
        let release = self.release.as_ref().context("the stack has no release")?;
        release.upgrade_as_documented(&self.kube, edit).await
    }

    /// The uninstall commands of `docs/install.md`, as written (see
    /// [`Release::uninstall_as_documented`]); the pods' output is copied to the stack's
    /// logs just before the last `helm uninstall`.
    pub async fn uninstall_as_documented(&mut self) -> anyhow::Result<DocumentedUninstall> {
        let release = self
            .release
            .take()
            .context("the stack was not installed with the chart")?;
        let cluster = self.cluster.as_ref().context("the stack has no cluster")?;
        let namespace = release.namespace().to_owned();
        let dir = self.dir.path();
        release
            .uninstall_as_documented(&self.kube, || copy_pod_logs(cluster, &namespace, dir))
            .await
    }
}

/// Copies the output of the operator's and the agent's pods in `namespace` to
/// `operator.log` and `kvm-agent.log` of `dir`.
fn copy_pod_logs(cluster: &Cluster, namespace: &str, dir: &std::path::Path) {
    for (deployment, file) in [(OPERATOR, "operator.log"), (AGENT, "kvm-agent.log")] {
        let text = cluster.deployment_logs(namespace, deployment);
        let _ = std::fs::write(dir.join(file), text);
    }
}
