//! The reference provider as a separate process, the way the operator and users meet
//! a provider: spawned from the workspace's `reference-provider` binary on a free
//! loopback port, killed when dropped (also while a test unwinds).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};

use crate::process::spawn_listening;

/// Path of a binary built from this workspace (`cargo test --workspace` and
/// `cargo build --workspace` put them next to the test executables' `deps/` dir).
/// `EGRESSPROXY_BIN_DIR` overrides the directory.
pub fn workspace_binary(name: &str) -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("EGRESSPROXY_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().context("locate the test executable")?;
            let deps = exe.parent().context("test executable has no directory")?;
            deps.parent()
                .context("deps directory has no parent")?
                .to_owned()
        }
    };
    let path = dir.join(name);
    if !path.is_file() {
        bail!(
            "{} not found: run `cargo build --workspace --bins` first",
            path.display()
        );
    }
    Ok(path)
}

/// A running `reference-provider` process.
#[derive(Debug)]
pub struct ReferenceProvider {
    child: Child,
    endpoint: String,
}

impl ReferenceProvider {
    /// Starts the provider with extra command-line `args` (for example
    /// `["--provisioning-delay", "0s"]`) and waits until it listens. It serves its test
    /// controls (`--fault-injection`): tests inject faults through them.
    ///
    /// It offers no address identities (`--no-address-identities`): the addresses it
    /// would grant lie in TEST-NET-1, where no test's proxy answers, while its other
    /// instances answer at 127.0.0.1. [`ReferenceProvider::start_keeping_addresses`]
    /// offers them.
    pub fn start(args: &[&str]) -> anyhow::Result<Self> {
        Self::start_at("127.0.0.1:0", args)
    }

    /// Like [`ReferenceProvider::start`], but the provider keeps addresses for address
    /// identities (`CAPABILITY_ADDRESS_IDENTITY`, `CAPABILITY_REQUESTED_ADDRESS`).
    pub fn start_keeping_addresses(args: &[&str]) -> anyhow::Result<Self> {
        Self::spawn("127.0.0.1:0", args)
    }

    /// Like [`ReferenceProvider::start`], on a given `listen` address.
    pub fn start_at(listen: &str, args: &[&str]) -> anyhow::Result<Self> {
        Self::spawn(listen, &[&["--no-address-identities"], args].concat())
    }

    fn spawn(listen: &str, args: &[&str]) -> anyhow::Result<Self> {
        let binary = workspace_binary("reference-provider")?;
        let (child, address) = spawn_listening(
            Command::new(&binary)
                .args(["--listen", listen, "--fault-injection"])
                .args(args)
                .stdin(Stdio::null())
                .stderr(Stdio::inherit()),
            "reference-provider",
        )?;
        Ok(ReferenceProvider {
            endpoint: format!("http://{address}"),
            child,
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// SIGKILLs the provider and reaps it (its in-memory instances are gone).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The provider's process id (for its CPU time in benchmarks).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `127.0.0.1:PORT`, the form grpcurl takes.
    pub fn address(&self) -> &str {
        self.endpoint.trim_start_matches("http://")
    }
}

impl Drop for ReferenceProvider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
