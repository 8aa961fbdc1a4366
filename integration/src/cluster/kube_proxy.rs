//! kube-proxy in iptables mode, in the node's namespaces: Services' ClusterIPs become
//! DNAT rules in the node's network namespace, which every pod's traffic crosses.
//!
//! It masquerades all Service traffic (`masqueradeAll`): a pod that reaches a Service
//! backed by a pod on the same bridge then gets the answer back through the node, without
//! relying on bridged traffic being seen by iptables. It leaves the conntrack table sizes
//! alone (they are the host's to set).

use std::path::Path;

use super::mounts::NodeMounts;
use super::network::{CLUSTER_CIDR, NODE_IP};
use crate::process::Daemon;
use crate::tools;

/// A running kube-proxy.
#[derive(Debug)]
pub(crate) struct KubeProxy {
    daemon: Daemon,
}

impl KubeProxy {
    /// Writes its configuration under `dir` and starts it for Node `node_name`.
    pub(crate) fn start(
        dir: &Path,
        mounts: &NodeMounts,
        node_name: &str,
        kubeconfig: &Path,
    ) -> anyhow::Result<Self> {
        let config = dir.join("kube-proxy.yaml");
        std::fs::write(
            &config,
            format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1\n\
                 kind: KubeProxyConfiguration\n\
                 clientConnection: {{kubeconfig: {kubeconfig}}}\n\
                 hostnameOverride: {node_name}\n\
                 mode: iptables\n\
                 clusterCIDR: {CLUSTER_CIDR}\n\
                 bindAddress: {NODE_IP}\n\
                 nodePortAddresses: [primary]\n\
                 healthzBindAddress: 127.0.0.1:10256\n\
                 metricsBindAddress: 127.0.0.1:10249\n\
                 conntrack: {{maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}\n\
                 iptables: {{masqueradeAll: true}}\n",
                kubeconfig = kubeconfig.display(),
            ),
        )?;
        let mut command = mounts.command(tools::bin("kube-node")?);
        command.arg("kube-proxy").arg("--config").arg(&config);
        let daemon = Daemon::spawn("kube-proxy", command, &dir.join("kube-proxy.log"))?;
        Ok(Self { daemon })
    }

    /// Fails with kube-proxy's log if it has exited.
    pub(crate) fn ensure_running(&mut self) -> anyhow::Result<()> {
        self.daemon.ensure_running()
    }
}
