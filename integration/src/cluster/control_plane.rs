//! kube-scheduler and kube-controller-manager: the control plane beside the apiserver.
//!
//! They only talk to the apiserver, so they run on the host like it, with the harness's
//! admin credentials, without leader election (one of each per apiserver) and without
//! serving anything (`--secure-port=0`). The controller manager publishes the apiserver's
//! CA to every namespace (`kube-root-ca.crt`, which every pod's token volume needs),
//! creates the `default` ServiceAccounts, and runs the Deployment, ReplicaSet,
//! EndpointSlice, namespace and garbage-collection controllers a release relies on.

use std::path::Path;

use crate::process::Daemon;
use crate::tools;

/// The running scheduler and controller manager.
#[derive(Debug)]
pub(crate) struct ControlPlane {
    scheduler: Daemon,
    controller_manager: Daemon,
}

impl ControlPlane {
    /// Starts both with `kubeconfig`; `ca` is the apiserver's CA, `dir` holds their logs.
    pub(crate) fn start(dir: &Path, kubeconfig: &Path, ca: &Path) -> anyhow::Result<Self> {
        let binary = tools::bin("kube-node")?;
        let kubeconfig_flags = |command: &mut std::process::Command| {
            for flag in [
                "--kubeconfig",
                "--authentication-kubeconfig",
                "--authorization-kubeconfig",
            ] {
                command.arg(format!("{flag}={}", kubeconfig.display()));
            }
        };
        let mut command = std::process::Command::new(&binary);
        command.arg("kube-controller-manager");
        kubeconfig_flags(&mut command);
        command
            .arg(format!("--root-ca-file={}", ca.display()))
            .args([
                "--use-service-account-credentials=false",
                "--leader-elect=false",
                "--secure-port=0",
                "--controllers=*",
            ]);
        let controller_manager = Daemon::spawn(
            "kube-controller-manager",
            command,
            &dir.join("kube-controller-manager.log"),
        )?;
        let mut command = std::process::Command::new(&binary);
        command.arg("kube-scheduler");
        kubeconfig_flags(&mut command);
        command.args(["--leader-elect=false", "--secure-port=0"]);
        let scheduler = Daemon::spawn("kube-scheduler", command, &dir.join("kube-scheduler.log"))?;
        Ok(Self {
            scheduler,
            controller_manager,
        })
    }

    /// Fails with the log of whichever has exited.
    pub(crate) fn ensure_running(&mut self) -> anyhow::Result<()> {
        self.scheduler.ensure_running()?;
        self.controller_manager.ensure_running()
    }
}
