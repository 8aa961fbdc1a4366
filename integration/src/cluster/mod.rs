//! A single-node Kubernetes cluster from real parts, on the shared kube-apiserver of the
//! test process: the kubelet, kube-proxy, kube-scheduler and kube-controller-manager built
//! from the same `k8s.io/kubernetes` module as the apiserver (`kube-node`), Debian's
//! containerd, runc and CNI plugins, and CoreDNS built from its Go module. Every image
//! (the pause image too) is built locally and imported: nothing can be pulled here. See
//! `docs/testing/kube-cluster.md`.
//!
//! [`Cluster::start`] brings up, in this order:
//! 1. the node's network namespace with its link and address plan (`network.rs`), and
//!    its uplink into another test-made namespace when asked
//!    ([`ClusterOptions::uplink`]);
//! 2. the node's private mount namespace (`mounts.rs`);
//! 3. containerd in both (`containerd.rs`), and the cluster's images imported into it;
//! 4. the route from the node and its pods to the apiserver (`apiserver_route.rs`);
//! 5. kube-controller-manager and kube-scheduler on the host (`control_plane.rs`);
//! 6. the kubelet and kube-proxy in the node's namespaces (`kubelet.rs`,
//!    `kube_proxy.rs`); it waits (watching) until the Node is Ready;
//! 7. CoreDNS (`coredns.rs`); it waits until its Deployment is available, which also
//!    proves that pods reach the apiserver through the `kubernetes` Service.
//!
//! Caveats: one cluster per test process (it registers one Node, named `localhost`, and
//! publishes the `kubernetes` Service's endpoint on the shared apiserver), and only on an
//! apiserver this process started.
//!
//! Dropping the cluster (also while a test unwinds) stops kube-proxy and the kubelet,
//! kills every container with its shim, stops containerd, the control plane and the
//! relays, then the mount namespace (every mount in it goes) and the network namespace
//! (every interface and rule in it goes), and removes the directory. The Node object
//! stays (NotReady) until the apiserver goes.

mod apiserver_route;
mod containerd;
mod control_plane;
mod coredns;
mod kube_proxy;
mod kubelet;
mod mounts;
pub mod network;
pub mod pods;

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use k8s_openapi::api::core::v1::Node;
use kube::api::Api;
use kube::runtime::wait::await_condition;

use self::containerd::Containerd;
use self::control_plane::ControlPlane;
use self::kube_proxy::KubeProxy;
use self::kubelet::{Kubelet, KubeletSettings};
use self::mounts::NodeMounts;
use self::network::NodeNetwork;
use crate::helm::Kubectl;
use crate::kube_apiserver::{self, KUBECONFIG_ENV, KubeApiserver};
use crate::relay::LoopbackRelay;
use crate::tools::{self, ImageArchive};

/// The image archives (`integration/tools/build-images.sh cluster`) every cluster imports.
pub const PAUSE_IMAGE: &str = "pause";
/// See [`PAUSE_IMAGE`].
pub const COREDNS_IMAGE: &str = "coredns";
/// A busybox shell with wget, nc, nslookup and httpd, for test pods.
pub const TOOLBOX_IMAGE: &str = "toolbox";

/// How long the kubelet may take to register the Node and report it Ready.
const NODE_READY_WITHIN: Duration = Duration::from_secs(120);

/// What [`Cluster::start`] adds to the node.
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    /// Connect the node's uplink into this network namespace (see
    /// [`NodeNetwork::connect_uplink`]).
    pub uplink: Option<Uplink>,
    /// Image archives to import besides the cluster's own (names as in
    /// [`tools::image_archive`]).
    pub images: Vec<String>,
}

/// The node's link to a routed network in another namespace.
#[derive(Debug, Clone)]
pub struct Uplink {
    /// The namespace (made by the test) that gets the other end of the node's link.
    pub netns: String,
    /// CIDRs the node routes through it.
    pub routed: Vec<String>,
}

/// A running single-node cluster; see the module docs.
pub struct Cluster {
    kube_proxy: Option<KubeProxy>,
    kubelet: Option<Kubelet>,
    containerd: Option<Containerd>,
    control_plane: Option<ControlPlane>,
    relay: Option<LoopbackRelay>,
    /// From the host's loopback to the kubelet's API (`kubelet.rs`).
    kubelet_relay: Option<LoopbackRelay>,
    runtime: Option<tokio::runtime::Runtime>,
    // Dropped in this order after the fields above: the mount namespace's holder, the
    // network namespace, the directory.
    mounts: NodeMounts,
    network: NodeNetwork,
    node_name: String,
    apiserver: &'static KubeApiserver,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("node", &self.node_name)
            .field("netns", &self.network.netns().name())
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

impl Cluster {
    /// Starts the cluster on the shared apiserver and waits until the Node is Ready and
    /// CoreDNS is available.
    pub async fn start(options: &ClusterOptions) -> anyhow::Result<Self> {
        if std::env::var_os(KUBECONFIG_ENV).is_some() {
            bail!(
                "the test cluster registers its node with an apiserver this process starts; \
                 unset {KUBECONFIG_ENV} to run it"
            );
        }
        let apiserver = tokio::task::spawn_blocking(kube_apiserver::shared)
            .await
            .context("start the shared kube-apiserver")??;
        let mut images = vec![
            tools::image_archive(PAUSE_IMAGE)?,
            tools::image_archive(COREDNS_IMAGE)?,
            tools::image_archive(TOOLBOX_IMAGE)?,
        ];
        for short in &options.images {
            images.push(tools::image_archive(short)?);
        }
        let options = options.clone();
        let mut cluster =
            tokio::task::spawn_blocking(move || Self::start_node(apiserver, &options, &images))
                .await
                .context("start the node")??;
        let client = apiserver.admin_client().await?;
        apiserver_route::publish_endpoint(&client, apiserver.port()?).await?;
        cluster.wait_node_ready(&client).await?;
        let coredns = tools::image_archive(COREDNS_IMAGE)?.name;
        if let Err(err) = coredns::deploy(&cluster.kubectl(), &client, &coredns).await {
            return Err(err.context(cluster.log_tails()));
        }
        Ok(cluster)
    }

    /// Steps 1-6 of the module docs, on a blocking thread: they spawn and poll daemons.
    fn start_node(
        apiserver: &'static KubeApiserver,
        options: &ClusterOptions,
        images: &[ImageArchive],
    ) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new().prefix("kc-").tempdir()?;
        let mut network = NodeNetwork::create()?;
        if let Some(uplink) = &options.uplink {
            let routed: Vec<&str> = uplink.routed.iter().map(String::as_str).collect();
            network.connect_uplink(&uplink.netns, &routed)?;
        }
        let mounts = NodeMounts::start(dir.path(), &network.netns().path())?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("kube-cluster")
            .enable_all()
            .build()?;
        // The apiserver dials a Node's Hostname address first: `localhost` is the host's
        // loopback, where a relay leads to the kubelet (`kubelet.rs`).
        let node_name = "localhost".to_owned();
        let mut cluster = Self {
            kube_proxy: None,
            kubelet: None,
            containerd: None,
            control_plane: None,
            relay: None,
            kubelet_relay: None,
            runtime: None,
            mounts,
            network,
            node_name,
            apiserver,
            dir,
        };
        let dir = cluster.dir.path().to_owned();
        // The apiserver's port came from the host's ephemeral range, so a daemon of the
        // node (containerd's streaming server binds port 0) could take the same port in
        // the namespace: the relay binds it while nothing else runs there.
        cluster.relay = Some(apiserver_route::relay(
            runtime.handle(),
            cluster.network.netns().name(),
            apiserver.port()?,
        )?);
        let sandbox = &images[0].name;
        let containerd = Containerd::start(&dir, &cluster.mounts, sandbox)?;
        for image in images {
            containerd.import(image)?;
        }
        let kubelet_relay =
            LoopbackRelay::start_into(runtime.handle(), cluster.network.netns().name())?;
        let kubelet_port = kubelet_relay.port();
        cluster.kubelet_relay = Some(kubelet_relay);
        cluster.runtime = Some(runtime);
        let kubeconfig = apiserver.kubeconfig_path().to_owned();
        let ca = harness_ca(apiserver)?;
        cluster.control_plane = Some(ControlPlane::start(&dir, &kubeconfig, &ca)?);
        let settings = KubeletSettings {
            node_name: &cluster.node_name,
            kubeconfig: &kubeconfig,
            client_ca: &ca,
            runtime_endpoint: &containerd.endpoint(),
            port: kubelet_port,
        };
        cluster.containerd = Some(containerd);
        cluster.kubelet = Some(Kubelet::start(&dir, &cluster.mounts, &settings)?);
        cluster.kube_proxy = Some(KubeProxy::start(
            &dir,
            &cluster.mounts,
            &cluster.node_name,
            &kubeconfig,
        )?);
        Ok(cluster)
    }

    async fn wait_node_ready(&mut self, client: &kube::Client) -> anyhow::Result<()> {
        let nodes: Api<Node> = Api::all(client.clone());
        let ready = tokio::time::timeout(
            NODE_READY_WITHIN,
            await_condition(nodes, &self.node_name, |node: Option<&Node>| {
                node.and_then(|n| n.status.as_ref())
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|conditions| {
                        conditions
                            .iter()
                            .any(|c| c.type_ == "Ready" && c.status == "True")
                    })
            }),
        )
        .await;
        match ready {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(err)) => Err(anyhow::Error::new(err).context("watch the Node")),
            Err(_) => {
                self.ensure_running()?;
                bail!(
                    "Node {} was not Ready within {NODE_READY_WITHIN:?}\n{}",
                    self.node_name,
                    self.log_tails()
                )
            }
        }
    }

    /// Fails with the log of whichever part of the node has exited.
    pub fn ensure_running(&mut self) -> anyhow::Result<()> {
        self.mounts.ensure_running()?;
        if let Some(containerd) = &mut self.containerd {
            containerd.ensure_running()?;
        }
        if let Some(control_plane) = &mut self.control_plane {
            control_plane.ensure_running()?;
        }
        if let Some(kubelet) = &mut self.kubelet {
            kubelet.ensure_running()?;
        }
        if let Some(kube_proxy) = &mut self.kube_proxy {
            kube_proxy.ensure_running()?;
        }
        Ok(())
    }

    /// Imports another image archive (see [`tools::image_archive`]) into the node.
    pub fn import_image(&self, short: &str) -> anyhow::Result<ImageArchive> {
        let image = tools::image_archive(short)?;
        self.containerd
            .as_ref()
            .context("containerd was stopped")?
            .import(&image)?;
        Ok(image)
    }

    /// The Node's name.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The admin kubeconfig of the apiserver.
    pub fn kubeconfig(&self) -> &Path {
        self.apiserver.kubeconfig_path()
    }

    /// The apiserver the node is registered with.
    pub fn apiserver(&self) -> &'static KubeApiserver {
        self.apiserver
    }

    /// `kubectl` with the admin kubeconfig.
    pub fn kubectl(&self) -> Kubectl {
        Kubectl::new(self.kubeconfig())
    }

    /// The node's network namespace (its name, for [`crate::netns::command_in`]).
    pub fn netns(&self) -> &str {
        self.network.netns().name()
    }

    /// The cluster's directory: configurations and the logs of every part.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// What the containers of pod `pod` in `namespace` wrote, every container and
    /// restart, as the kubelet logged it (`kubectl logs` cannot reach the node).
    pub fn pod_logs(&self, namespace: &str, pod: &str) -> String {
        self.logs_of_pods_named(&format!("{namespace}_{pod}_"))
    }

    /// Like [`Cluster::pod_logs`], for every pod of Deployment `deployment` (the pods
    /// whose names are `<deployment>-<ReplicaSet hash>-<suffix>`).
    pub fn deployment_logs(&self, namespace: &str, deployment: &str) -> String {
        self.logs_of_pods_named(&format!("{namespace}_{deployment}-"))
    }

    /// The output of every pod whose log directory starts with `prefix`
    /// (`<namespace>_<pod>_<uid>`).
    fn logs_of_pods_named(&self, prefix: &str) -> String {
        let Some(kubelet) = &self.kubelet else {
            return String::new();
        };
        let mut files: Vec<PathBuf> = Vec::new();
        for entry in std::fs::read_dir(kubelet.pod_logs()).into_iter().flatten() {
            let path = entry.map(|e| e.path()).unwrap_or_default();
            let matches = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix));
            if matches {
                files.extend(log_files(&path));
            }
        }
        files.sort();
        let mut text = String::new();
        for file in files {
            for line in std::fs::read_to_string(&file).unwrap_or_default().lines() {
                // CRI log lines: `<time> <stream> <P|F> <text>`.
                let message = line.splitn(4, ' ').nth(3).unwrap_or(line);
                text.push_str(message);
                text.push('\n');
            }
        }
        text
    }

    /// The last lines of the log of every part of the node, for a failed test's output.
    pub fn log_tails(&self) -> String {
        let mut tails = String::new();
        for name in [
            "containerd",
            "kubelet",
            "kube-proxy",
            "kube-controller-manager",
            "kube-scheduler",
        ] {
            let path = self.dir.path().join(format!("{name}.log"));
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            tails.push_str(&format!("--- {} (last lines)\n{tail}\n", path.display()));
        }
        tails
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        drop(self.kube_proxy.take());
        drop(self.kubelet.take());
        drop(self.containerd.take());
        drop(self.control_plane.take());
        drop(self.relay.take());
        drop(self.kubelet_relay.take());
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        // Then the fields: the mount namespace, the network namespace, the directory.
    }
}

/// Every file under `dir`, recursively.
fn log_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(log_files(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// The CA of the harness's apiserver, which signed its admin certificate.
fn harness_ca(apiserver: &KubeApiserver) -> anyhow::Result<PathBuf> {
    let dir = apiserver
        .kubeconfig_path()
        .parent()
        .context("the kubeconfig has no directory")?;
    let ca = dir.join("pki/ca.crt");
    if !ca.is_file() {
        bail!("the apiserver's CA is not at {}", ca.display());
    }
    Ok(ca)
}
