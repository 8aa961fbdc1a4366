//! Faults that restart or hang one part of the [`Stack`] in place, as they happen to a
//! running installation, for the fault matrix (`integration/tests/e2e_faults`):
//! - libvirtd restarted alone: its guests keep running and the new daemon reconnects to
//!   them ([`Stack::restart_libvirtd`]);
//! - libvirtd hung: SIGSTOPped with its guests, then continued ([`Stack::pause_libvirtd`]);
//! - the kube-apiserver crashed and started again on the same port and data
//!   ([`Stack::restart_apiserver`]);
//! - the hypervisor presenting another SSH host key, and back
//!   ([`Stack::restart_sshd_with_other_host_key`]).

use std::path::PathBuf;

use super::Stack;

impl Stack {
    /// Restarts libvirtd alone (SIGTERM, then the same daemon again with the same
    /// directories): the guests keep running and the new daemon reconnects to them.
    /// Blocks for a few seconds.
    pub fn restart_libvirtd(&mut self) -> anyhow::Result<()> {
        self.libvirtd.restart_daemon()
    }

    /// Processes that outlived an earlier libvirtd ([`Stack::restart_libvirtd`]) and
    /// still run: its guests' QEMU, dnsmasq.
    pub fn libvirtd_adopted(&self) -> Vec<u32> {
        self.libvirtd.adopted()
    }

    /// SIGSTOPs libvirtd and everything it started (its guests too): connections are
    /// accepted and never answered.
    pub fn pause_libvirtd(&mut self) -> anyhow::Result<()> {
        self.libvirtd.pause()
    }

    /// SIGCONTs what [`Stack::pause_libvirtd`] stopped.
    pub fn resume_libvirtd(&mut self) -> anyhow::Result<()> {
        self.libvirtd.resume()
    }

    /// The pid of running `domain`'s QEMU, from libvirt's state directory.
    pub fn guest_pid(&self, domain: &str) -> Option<u32> {
        let file = self
            .libvirtd
            .dir()
            .join("run/qemu")
            .join(format!("{domain}.pid"));
        std::fs::read_to_string(file).ok()?.trim().parse().ok()
    }

    /// libvirtd's log (its stderr).
    pub fn libvirtd_log(&self) -> PathBuf {
        self.libvirtd.log()
    }

    /// Crashes the shared kube-apiserver and starts it again on the same port with the
    /// same data and certificates ([`crate::kube_apiserver::KubeApiserver::restart`]).
    /// Every test of the process shares it: only for a test binary with a single test.
    /// Blocks until it is ready again.
    pub fn restart_apiserver(&self) -> anyhow::Result<()> {
        self.kube.apiserver().restart()
    }

    /// Restarts sshd (every session drops) presenting another host key than the one in
    /// the agent's `known_hosts`.
    pub fn restart_sshd_with_other_host_key(&mut self) -> anyhow::Result<()> {
        self.sshd.restart_with_other_host_key()
    }

    /// Restarts sshd presenting its own host key again.
    pub fn restart_sshd_with_own_host_key(&mut self) -> anyhow::Result<()> {
        self.sshd.restart_with_own_host_key()
    }

    /// sshd's log (connections and logins at VERBOSE level).
    pub fn sshd_log(&self) -> PathBuf {
        self.sshd.log()
    }

    /// Whether the operator's process still runs (it exits when it loses its Lease).
    pub fn operator_running(&mut self) -> bool {
        self.operator
            .as_mut()
            .is_some_and(|operator| operator.ensure_running().is_ok())
    }
}
