//! Kubernetes' garbage collector beside the test process's own apiserver:
//! kube-controller-manager running that one controller, so that objects whose owner is
//! deleted are deleted too, as in a real cluster. Only tests that assert a cascade
//! start it; everywhere else no controller runs beside the apiserver (see
//! [`crate::kube_env`]).
//!
//! The collector discovers the API's kinds when it starts (and again only every 30
//! seconds): start it after the CRDs whose objects it must collect are applied.

use anyhow::Context;

use crate::kube_apiserver::KubeApiserver;
use crate::process::Daemon;
use crate::tools;

/// The running collector; stopped when dropped.
#[derive(Debug)]
pub struct GarbageCollector {
    daemon: Option<Daemon>,
    _dir: Option<tempfile::TempDir>,
}

impl GarbageCollector {
    /// Starts the collector on `apiserver`. An external apiserver (a real cluster's)
    /// has its own collector: then nothing is started.
    pub fn start(apiserver: &KubeApiserver) -> anyhow::Result<Self> {
        if apiserver.is_external() {
            return Ok(GarbageCollector {
                daemon: None,
                _dir: None,
            });
        }
        let dir = tempfile::tempdir().context("garbage collector log directory")?;
        let kubeconfig = apiserver.kubeconfig_path();
        let mut command = std::process::Command::new(tools::bin("kube-node")?);
        command.arg("kube-controller-manager");
        for flag in [
            "--kubeconfig",
            "--authentication-kubeconfig",
            "--authorization-kubeconfig",
        ] {
            command.arg(format!("{flag}={}", kubeconfig.display()));
        }
        command.args([
            "--controllers=garbagecollector",
            "--leader-elect=false",
            "--secure-port=0",
            "--use-service-account-credentials=false",
        ]);
        let log = dir.path().join("kube-controller-manager.log");
        let daemon = Daemon::spawn("kube-controller-manager", command, &log)?;
        Ok(GarbageCollector {
            daemon: Some(daemon),
            _dir: Some(dir),
        })
    }

    /// Fails with the collector's log if it has exited.
    pub fn ensure_running(&mut self) -> anyhow::Result<()> {
        match &mut self.daemon {
            Some(daemon) => daemon.ensure_running(),
            None => Ok(()),
        }
    }
}
