//! Network namespaces a test creates, and sockets and processes inside them.
//!
//! A socket belongs to the namespace of the thread that created it, for its whole life.
//! [`bind_tcp_in`] creates a listener on a short-lived thread that has entered the
//! namespace; the listener then serves from any thread, so one test process holds
//! sockets on both sides (the relays in [`crate::relay`] use this); [`connect_tcp_in`]
//! does the same for a connection.
//!
//! [`NetworkNamespace::create`] makes a namespace under a name unique to this process
//! (`ip netns add`), with `lo` up, and deletes it when dropped, with every interface
//! and firewall rule in it.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use anyhow::{Context, bail};
use nix::sched::{CloneFlags, setns};

/// Binds a TCP listener at `addr` inside the named network namespace.
pub fn bind_tcp_in(netns: &str, addr: SocketAddr) -> anyhow::Result<TcpListener> {
    in_namespace(netns, &format!("bind {addr}"), || TcpListener::bind(addr))
}

/// Connects to `addr` inside the named network namespace.
pub fn connect_tcp_in(netns: &str, addr: SocketAddr) -> anyhow::Result<TcpStream> {
    in_namespace(netns, &format!("connect to {addr}"), || {
        TcpStream::connect(addr)
    })
}

/// Runs `make` (which creates a socket) on a short-lived thread that has entered the
/// named network namespace, so that the socket belongs to it; `what` names it in errors.
fn in_namespace<T: Send>(
    netns: &str,
    what: &str,
    make: impl FnOnce() -> std::io::Result<T> + Send,
) -> anyhow::Result<T> {
    let path = Path::new("/run/netns").join(netns);
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> anyhow::Result<T> {
                let file = std::fs::File::open(&path)
                    .with_context(|| format!("open {}", path.display()))?;
                setns(&file, CloneFlags::CLONE_NEWNET)
                    .with_context(|| format!("enter network namespace {netns}"))?;
                make().with_context(|| format!("{what} in {netns}"))
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the thread to {what} in {netns} panicked"))?
    })
}

/// `program` to run inside the named network namespace (`ip netns exec`).
pub fn command_in(netns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut command = Command::new("ip");
    command.args(["netns", "exec", netns]).arg(program);
    command
}

/// A named network namespace made for this test process; deleted on drop.
#[derive(Debug)]
pub struct NetworkNamespace {
    name: String,
}

impl NetworkNamespace {
    /// Creates `<prefix>-<pid>-<n>` with only `lo`, up.
    pub fn create(prefix: &str) -> anyhow::Result<Self> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{prefix}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        ip(&["netns", "add", &name])?;
        let netns = Self { name };
        netns.ip(&["link", "set", "lo", "up"])?;
        Ok(netns)
    }

    /// The namespace's name (`ip netns` and [`command_in`] take it).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's file, which `nsenter --net=` and `setns` take.
    pub fn path(&self) -> PathBuf {
        Path::new("/run/netns").join(&self.name)
    }

    /// Runs `ip -n <name> ARGS...`.
    pub fn ip(&self, args: &[&str]) -> anyhow::Result<()> {
        let mut all = vec!["-n", &self.name];
        all.extend_from_slice(args);
        ip(&all)
    }
}

impl Drop for NetworkNamespace {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// Runs `ip ARGS...` and fails with its error output.
pub fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("run ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
