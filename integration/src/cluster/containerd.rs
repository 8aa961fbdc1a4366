//! Debian's containerd as the node's container runtime, private to one cluster.
//!
//! 1. [`Containerd::start`] writes a configuration whose every path (root, state, socket,
//!    CNI configuration and address state) is under the cluster's directory, with the
//!    settings this machine needs: the CRI plugin's `restrict_oom_score_adj` (root here
//!    lacks CAP_SYS_RESOURCE, and runc fails a sandbox that asks for a lower OOM score)
//!    and the locally built pause image as the sandbox image (nothing can be pulled).
//! 2. It runs in the node's mount and network namespaces, so the CNI bridge and the pods'
//!    interfaces are made in the node's namespace and its mounts stay private.
//! 3. [`Containerd::import`] loads an image archive (`ctr images import`) into the CRI
//!    plugin's `k8s.io` namespace, where the kubelet finds it.
//! 4. Drop kills every container: each runs under a `containerd-shim-runc-v2` that was
//!    re-parented to this process (a child subreaper) and names this containerd's socket
//!    on its command line, so the shims and their containers are found even when the
//!    kubelet is gone; then containerd stops, and the containers' cgroups are removed.

use std::collections::BTreeSet;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use nix::sys::signal::Signal;

use super::mounts::NodeMounts;
use super::network::NodeNetwork;
use crate::process::{Daemon, process_tree, processes_mentioning, wait_until};
use crate::tools::ImageArchive;

/// How long containerd may take to serve its socket.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Where the cgroup hierarchies are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// Where Debian's containernetworking-plugins installs the CNI plugins.
const CNI_BIN_DIR: &str = "/usr/lib/cni";

/// A running private containerd; see the module docs.
#[derive(Debug)]
pub(crate) struct Containerd {
    daemon: Daemon,
    socket: PathBuf,
}

impl Containerd {
    /// Writes the configuration under `dir` and starts containerd in the node's
    /// namespaces with `sandbox_image` as the pods' pause image.
    pub(crate) fn start(
        dir: &Path,
        mounts: &NodeMounts,
        sandbox_image: &str,
    ) -> anyhow::Result<Self> {
        for tool in ["/usr/bin/containerd", "/usr/sbin/runc", "/usr/bin/ctr"] {
            if !Path::new(tool).exists() {
                bail!("{tool} not found: run integration/tools/install-system-packages.sh");
            }
        }
        if !Path::new(CNI_BIN_DIR).join("bridge").exists() {
            bail!(
                "{CNI_BIN_DIR}/bridge not found: install containernetworking-plugins \
                 (integration/tools/install-system-packages.sh does)"
            );
        }
        let root = dir.join("containerd");
        let cni_conf = dir.join("cni/net.d");
        let ipam = dir.join("cni/ipam");
        std::fs::create_dir_all(&root)?;
        std::fs::create_dir_all(&cni_conf)?;
        std::fs::create_dir_all(&ipam)?;
        std::fs::write(
            cni_conf.join("10-pods.conflist"),
            NodeNetwork::cni_config(&ipam),
        )?;
        let socket = root.join("containerd.sock");
        let config = root.join("config.toml");
        std::fs::write(
            &config,
            config_toml(&root, &socket, &cni_conf, sandbox_image),
        )?;

        let mut command = mounts.command("/usr/bin/containerd");
        command.arg("--config").arg(&config);
        let mut daemon = Daemon::spawn("containerd", command, &dir.join("containerd.log"))?;
        wait_until("containerd to serve its socket", START_TIMEOUT, || {
            daemon.ensure_running()?;
            Ok(UnixStream::connect(&socket).is_ok())
        })?;
        Ok(Self { daemon, socket })
    }

    /// The CRI endpoint the kubelet takes (`unix://...`).
    pub(crate) fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// Imports `image` into the CRI plugin's namespace.
    pub(crate) fn import(&self, image: &ImageArchive) -> anyhow::Result<()> {
        let out = Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["--namespace", "k8s.io", "images", "import"])
            .arg(&image.path)
            .output()
            .context("run ctr (containerd)")?;
        if !out.status.success() {
            bail!(
                "ctr images import {} failed: {}{}",
                image.path.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    /// Fails with containerd's log if it has exited.
    pub(crate) fn ensure_running(&mut self) -> anyhow::Result<()> {
        self.daemon.ensure_running()
    }

    /// The shims of this containerd: processes whose command line names its socket.
    fn shims(&self) -> Vec<u32> {
        processes_mentioning(&self.socket)
            .into_iter()
            .filter(|(_, command)| {
                command
                    .split(' ')
                    .next()
                    .is_some_and(|program| program.ends_with("containerd-shim-runc-v2"))
            })
            .map(|(pid, _)| pid)
            .collect()
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Containers first (deepest first), then their shims: SIGKILL, as a node that
        // loses power would; nothing of theirs outlives the node's mount namespace.
        let shims = self.shims();
        let mut doomed: Vec<u32> = Vec::new();
        for shim in &shims {
            let tree = process_tree(*shim);
            doomed.extend(tree.iter().rev());
        }
        let cgroups = container_cgroups(&doomed);
        for pid in &doomed {
            if let Ok(raw) = i32::try_from(*pid) {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), Signal::SIGKILL);
            }
        }
        crate::process::reap(&doomed, Duration::from_secs(10));
        self.daemon.stop();
        remove_cgroups(&cgroups);
    }
}

/// The cgroups (paths below each hierarchy's root) that `pids` run in, other than the
/// root: runc made one per container, which nobody removes once the containers are
/// killed together with their shims.
fn container_cgroups(pids: &[u32]) -> BTreeSet<String> {
    let mut paths = BTreeSet::new();
    for pid in pids {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        for line in text.lines() {
            // `<id>:<controllers>:<path>`
            if let Some(path) = line.splitn(3, ':').nth(2)
                && path != "/"
            {
                paths.insert(path.to_owned());
            }
        }
    }
    paths
}

/// Removes each of `paths` from every cgroup hierarchy that has it, then their parents
/// while empty (runc's `/k8s.io`, unless another node still uses it).
fn remove_cgroups(paths: &BTreeSet<String>) {
    let Ok(hierarchies) = std::fs::read_dir(CGROUP_ROOT) else {
        return;
    };
    let hierarchies: Vec<PathBuf> = hierarchies.flatten().map(|e| e.path()).collect();
    for path in paths {
        let mut relative = Path::new(path.trim_start_matches('/'));
        loop {
            for hierarchy in &hierarchies {
                let _ = std::fs::remove_dir(hierarchy.join(relative));
            }
            match relative.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => relative = parent,
                _ => break,
            }
        }
    }
}

/// containerd's configuration (version 2, as Debian's 1.6 reads it).
fn config_toml(root: &Path, socket: &Path, cni_conf: &Path, sandbox_image: &str) -> String {
    format!(
        r#"version = 2
root = "{root}/root"
state = "{root}/state"
disabled_plugins = [
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.devmapper",
]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{sandbox_image}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf}"
"#,
        root = root.display(),
        socket = socket.display(),
        cni_conf = cni_conf.display(),
    )
}
