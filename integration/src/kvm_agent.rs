//! `kvm-agent serve` as a process, for the agent's tests and benchmarks: started with a
//! config file on a listen address, waited on until it prints where it listens, and
//! SIGKILLed and reaped when dropped.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::process::spawn_listening;
use crate::reference_provider::workspace_binary;

/// A running `kvm-agent serve`; see the module docs.
#[derive(Debug)]
pub struct ServedAgent {
    child: Child,
    address: String,
}

impl ServedAgent {
    /// Serves `config` on a free loopback port, its stderr inherited.
    pub fn start(config: &Path) -> anyhow::Result<Self> {
        Self::start_with(config, "127.0.0.1:0", |_| {})
    }

    /// Serves `config` on `listen`; `customise` adds flags or environment.
    pub fn start_with(
        config: &Path,
        listen: &str,
        customise: impl FnOnce(&mut Command),
    ) -> anyhow::Result<Self> {
        let mut command = Command::new(workspace_binary("kvm-agent")?);
        command
            .args(["serve", "--listen", listen, "--config"])
            .arg(config)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit());
        customise(&mut command);
        let (child, address) = spawn_listening(&mut command, "kvm-agent serve")?;
        Ok(Self { child, address })
    }

    /// `127.0.0.1:PORT`, where it listens.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, once it has exited.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// SIGKILLs and reaps it (nothing of its own clean-up runs).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ServedAgent {
    fn drop(&mut self) {
        self.kill();
    }
}
