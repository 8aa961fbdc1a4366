//! The node's private mount namespace, shared by containerd, the kubelet and kube-proxy.
//!
//! The kubelet mounts pod volumes (tmpfs Secrets, projected tokens) that containerd must
//! see to bind them into containers, so both run in one mount namespace; containerd mounts
//! each container's root filesystem there too. Kept private, none of these mounts reaches
//! the host, and all of them vanish with the namespace, whatever state the node was in.
//!
//! 1. [`NodeMounts::start`] runs `unshare --mount --propagation private` with a script
//!    that mounts a fresh tmpfs over `/run` (containerd's shim sockets and runc state, the
//!    pods' network namespace files, the iptables lock) and `/var/log` (the kubelet's
//!    `containers/` links), writes a marker file, and sleeps: that process holds the
//!    namespace open.
//! 2. [`NodeMounts::command`] builds `nsenter --mount=<holder's> --net=<node's> PROGRAM`:
//!    nsenter opens both namespace files before it enters either, so the node's network
//!    namespace file is found under the host's `/run`.
//! 3. Drop stops the holder; the namespace, and every mount in it, goes once the last
//!    process in it has exited (the cluster stops those first).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::Context;

use crate::process::{Daemon, wait_until};

/// How long the holder may take to make its mounts.
const MOUNTS_READY: Duration = Duration::from_secs(10);

/// The holder of the node's mount namespace; see the module docs.
#[derive(Debug)]
pub(crate) struct NodeMounts {
    holder: Daemon,
    netns_path: PathBuf,
}

impl NodeMounts {
    /// Starts the holder (its log in `dir`) and waits until its mounts are made.
    pub(crate) fn start(dir: &Path, netns_path: &Path) -> anyhow::Result<Self> {
        let marker = dir.join("mounts-ready");
        let script = format!(
            "set -e\n\
             mount -t tmpfs -o mode=0755 node-run /run\n\
             mkdir -p /run/netns\n\
             mount -t tmpfs -o mode=0755 node-log /var/log\n\
             mkdir -p /var/log/containers /var/log/pods\n\
             touch '{marker}'\n\
             exec sleep infinity\n",
            marker = marker.display()
        );
        let mut command = Command::new("unshare");
        command
            .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
            .arg(script);
        let mut holder = Daemon::spawn("node mount namespace", command, &dir.join("mounts.log"))?;
        wait_until("the node's mount namespace", MOUNTS_READY, || {
            holder.ensure_running()?;
            Ok(marker.exists())
        })?;
        Ok(Self {
            holder,
            netns_path: netns_path.to_owned(),
        })
    }

    /// `program` to run in the node's mount and network namespaces.
    pub(crate) fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--mount=/proc/{}/ns/mnt", self.holder.pid()))
            .arg(format!("--net={}", self.netns_path.display()))
            .arg("--")
            .arg(program);
        command
    }

    /// Fails with the holder's log if it has exited.
    pub(crate) fn ensure_running(&mut self) -> anyhow::Result<()> {
        self.holder
            .ensure_running()
            .context("the node's mount namespace is gone")
    }
}
