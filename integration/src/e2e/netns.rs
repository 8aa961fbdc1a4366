//! Sockets and processes inside a network namespace the test created.
//!
//! A socket belongs to the namespace of the thread that created it, for its whole life.
//! [`bind_tcp_in`] creates a listener on a short-lived thread that has entered the
//! namespace; the listener then serves from any thread, so one test process holds
//! sockets on both sides (the relays in [`super::relay`] use this).

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::Command;

use anyhow::Context;
use nix::sched::{CloneFlags, setns};

/// Binds a TCP listener at `addr` inside the named network namespace.
pub fn bind_tcp_in(netns: &str, addr: SocketAddr) -> anyhow::Result<TcpListener> {
    let path = Path::new("/run/netns").join(netns);
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> anyhow::Result<TcpListener> {
                let file = std::fs::File::open(&path)
                    .with_context(|| format!("open {}", path.display()))?;
                setns(&file, CloneFlags::CLONE_NEWNET)
                    .with_context(|| format!("enter network namespace {netns}"))?;
                TcpListener::bind(addr).with_context(|| format!("bind {addr} in {netns}"))
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the thread binding {addr} in {netns} panicked"))?
    })
}

/// `program` to run inside the named network namespace (`ip netns exec`).
pub fn command_in(netns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut command = Command::new("ip");
    command.args(["netns", "exec", netns]).arg(program);
    command
}
