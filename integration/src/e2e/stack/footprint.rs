//! What a run may leave behind, listed before the stack is dropped and checked after:
//! processes, the network namespaces, the system user, directories, and any process that
//! names libvirtd's or the cluster's directory (a guest's QEMU, dnsmasq, a container's
//! shim), whichever daemon started it.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::Stack;
use crate::e2e::system_user::user_exists;
use crate::process::process_tree;

/// What a finished run may have left behind.
#[derive(Debug, Clone)]
pub struct Footprint {
    netns: String,
    user: String,
    paths: Vec<PathBuf>,
    pids: Vec<u32>,
    /// libvirtd's directory: a process whose command line names it (a guest's QEMU,
    /// dnsmasq) is left over, whichever libvirtd started it.
    libvirt_dir: PathBuf,
    /// The cluster's node namespace and directory (with the chart): a process naming the
    /// directory (containerd, a kubelet, a container's shim) is left over.
    cluster: Option<(String, PathBuf)>,
}

impl Stack {
    /// What to look for after the stack is dropped.
    pub fn footprint(&self) -> Footprint {
        let mut pids = Vec::new();
        for process in [&self.operator, &self.agent].into_iter().flatten() {
            pids.extend(process_tree(process.pid()));
        }
        if let Ok(pid) = self.libvirtd.libvirtd_pid() {
            pids.extend(process_tree(pid));
        }
        Footprint {
            netns: self.netns().to_owned(),
            user: self.user.name().to_owned(),
            paths: vec![
                self.dir.path().to_owned(),
                self.libvirtd.dir().to_owned(),
                self.sshd
                    .log()
                    .parent()
                    .map(Path::to_owned)
                    .unwrap_or_default(),
                Path::new("/home").join(self.user.name()),
                // The chart install's hosts file for the namespace.
                Path::new("/etc/netns").join(self.netns()),
            ],
            pids,
            libvirt_dir: self.libvirtd.dir().to_owned(),
            cluster: self
                .cluster
                .as_ref()
                .map(|c| (c.netns().to_owned(), c.dir().to_owned())),
        }
    }
}

impl Footprint {
    /// Everything of the run that still exists: processes, the namespace, the user,
    /// directories. Empty after a clean tear-down.
    pub fn leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        for pid in &self.pids {
            if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) {
                left.push(format!("process {pid}: {}", stat.trim()));
            }
        }
        let namespaces = Command::new("ip")
            .args(["netns", "list"])
            .output()
            .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
            .unwrap_or_default();
        let mut ours = vec![self.netns.as_str()];
        if let Some((node, dir)) = &self.cluster {
            ours.push(node);
            left.extend(processes_naming(dir));
            if dir.exists() {
                left.push(format!("path {}", dir.display()));
            }
        }
        for netns in ours {
            if namespaces.split_whitespace().any(|n| n == netns) {
                left.push(format!("network namespace {netns}"));
            }
        }
        if user_exists(&self.user) {
            left.push(format!("user {}", self.user));
        }
        let by_user = Command::new("pgrep").args(["-u", &self.user]).output();
        if let Ok(out) = by_user
            && !out.stdout.is_empty()
        {
            left.push(format!("processes of {}", self.user));
        }
        left.extend(processes_naming(&self.libvirt_dir));
        for path in &self.paths {
            if path.exists() {
                left.push(format!("path {}", path.display()));
            }
        }
        left
    }
}

/// Processes (pid and command line) whose command line contains `path`.
fn processes_naming(path: &Path) -> Vec<String> {
    let needle = path.display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline.contains(&needle).then(|| {
                format!(
                    "process {} naming {needle}: {}",
                    e.file_name().to_string_lossy(),
                    cmdline.trim()
                )
            })
        })
        .collect()
}
