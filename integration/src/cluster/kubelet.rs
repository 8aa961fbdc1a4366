//! The kubelet, registered with the shared apiserver, running pods through containerd.
//!
//! It runs in the node's mount and network namespaces (its probes reach pod addresses,
//! its volume mounts are the ones containerd binds into containers), with the settings
//! this machine needs: cgroup v1 with the cgroupfs driver and no per-QoS cgroups or
//! node-allocatable enforcement (the v1 hierarchy here is writable but not delegated),
//! no swap check, no local-storage isolation (the root device has no filesystem
//! statistics). Eviction and image garbage collection thresholds are set so that a
//! nearly full shared disk never evicts the tests' pods or deletes their images, which
//! could not be pulled again. Pod logs go under the cluster's directory, where
//! [`super::Cluster::pod_logs`] reads them.
//!
//! Its API (logs, exec, port-forward) listens on the node's loopback only, on a port
//! relayed from the host's loopback: the Node is named `localhost`, so the apiserver,
//! which dials a Node's `Hostname` address first, reaches it through that relay and
//! `kubectl logs` works. Only processes of the host reach it there, so it takes their
//! requests without credentials (the harness's apiserver presents none).

use std::path::{Path, PathBuf};

use super::mounts::NodeMounts;
use super::network::{DNS_SERVICE_IP, NODE_IP};
use crate::process::Daemon;
use crate::tools;

/// What the kubelet is told beyond its fixed settings.
#[derive(Debug)]
pub(crate) struct KubeletSettings<'a> {
    /// The Node's name.
    pub(crate) node_name: &'a str,
    /// The kubeconfig it registers and reports with.
    pub(crate) kubeconfig: &'a Path,
    /// The CA whose client certificates it accepts (the apiserver's).
    pub(crate) client_ca: &'a Path,
    /// containerd's CRI endpoint.
    pub(crate) runtime_endpoint: &'a str,
    /// The port of its API on the node's loopback (relayed from the host's).
    pub(crate) port: u16,
}

/// A running kubelet.
#[derive(Debug)]
pub(crate) struct Kubelet {
    daemon: Daemon,
    pod_logs: PathBuf,
}

impl Kubelet {
    /// Writes its configuration under `dir` and starts it in the node's namespaces.
    pub(crate) fn start(
        dir: &Path,
        mounts: &NodeMounts,
        settings: &KubeletSettings<'_>,
    ) -> anyhow::Result<Self> {
        let root = dir.join("kubelet");
        let pod_logs = dir.join("pod-logs");
        std::fs::create_dir_all(&root)?;
        std::fs::create_dir_all(&pod_logs)?;
        // Pods with `dnsPolicy: Default` get this file: the node has no upstream resolver.
        let resolv_conf = dir.join("resolv.conf");
        std::fs::write(&resolv_conf, "")?;
        let config = dir.join("kubelet.yaml");
        std::fs::write(
            &config,
            format!(
                "apiVersion: kubelet.config.k8s.io/v1beta1\n\
                 kind: KubeletConfiguration\n\
                 failCgroupV1: false\n\
                 cgroupDriver: cgroupfs\n\
                 cgroupsPerQOS: false\n\
                 enforceNodeAllocatable: []\n\
                 failSwapOn: false\n\
                 localStorageCapacityIsolation: false\n\
                 containerRuntimeEndpoint: {runtime}\n\
                 address: 127.0.0.1\n\
                 port: {port}\n\
                 readOnlyPort: 0\n\
                 healthzBindAddress: 127.0.0.1\n\
                 authentication:\n\
                 \x20 anonymous: {{enabled: true}}\n\
                 \x20 webhook: {{enabled: false}}\n\
                 \x20 x509: {{clientCAFile: {ca}}}\n\
                 authorization: {{mode: AlwaysAllow}}\n\
                 clusterDNS: [{DNS_SERVICE_IP}]\n\
                 clusterDomain: cluster.local\n\
                 resolvConf: {resolv}\n\
                 podLogsDir: {logs}\n\
                 imageGCHighThresholdPercent: 100\n\
                 imageGCLowThresholdPercent: 99\n\
                 evictionHard: {{memory.available: 1Mi, nodefs.available: 1%, \
                 nodefs.inodesFree: 1%, imagefs.available: 1%, imagefs.inodesFree: 1%}}\n\
                 serializeImagePulls: false\n",
                runtime = settings.runtime_endpoint,
                port = settings.port,
                ca = settings.client_ca.display(),
                resolv = resolv_conf.display(),
                logs = pod_logs.display(),
            ),
        )?;
        let mut command = mounts.command(tools::bin("kube-node")?);
        command
            .arg("kubelet")
            .arg("--config")
            .arg(&config)
            .arg("--kubeconfig")
            .arg(settings.kubeconfig)
            .arg("--root-dir")
            .arg(&root)
            .args(["--hostname-override", settings.node_name])
            .args(["--node-ip", &NODE_IP.to_string()]);
        let daemon = Daemon::spawn("kubelet", command, &dir.join("kubelet.log"))?;
        Ok(Self { daemon, pod_logs })
    }

    /// Fails with the kubelet's log if it has exited.
    pub(crate) fn ensure_running(&mut self) -> anyhow::Result<()> {
        self.daemon.ensure_running()
    }

    /// The directory of the pods' container logs (`<namespace>_<pod>_<uid>/<container>/`).
    pub(crate) fn pod_logs(&self) -> &Path {
        &self.pod_logs
    }
}
