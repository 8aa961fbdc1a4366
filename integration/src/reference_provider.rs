//! The reference provider as a separate process, the way the operator and users meet
//! a provider: spawned from the workspace's `reference-provider` binary on a free
//! loopback port, killed when dropped (also while a test unwinds).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, bail};

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
    /// `["--provisioning-delay", "0s"]`) and waits until it listens.
    pub fn start(args: &[&str]) -> anyhow::Result<Self> {
        Self::start_at("127.0.0.1:0", args)
    }

    /// Like [`ReferenceProvider::start`], on a given `listen` address.
    pub fn start_at(listen: &str, args: &[&str]) -> anyhow::Result<Self> {
        let binary = workspace_binary("reference-provider")?;
        let mut child = Command::new(&binary)
            .args(["--listen", listen])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("spawn {}", binary.display()))?;
        // A thread reads the address line, then keeps draining stdout so the provider
        // never meets a closed pipe; the first line must come within 30 s.
        let stdout = child.stdout.take().context("reference-provider stdout")?;
        let (first_line, line) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = first_line.send(lines.next().and_then(Result::ok).unwrap_or_default());
            for _ in lines {}
        });
        let line = line
            .recv_timeout(std::time::Duration::from_secs(30))
            .unwrap_or_default();
        let Some(address) = line.trim().strip_prefix("listening on ") else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("reference-provider did not start (first line: {line:?}); see its stderr above");
        };
        Ok(ReferenceProvider {
            endpoint: format!("http://{address}"),
            child,
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
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
