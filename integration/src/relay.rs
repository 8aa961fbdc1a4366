//! TCP relays from a network namespace to the host's loopback.
//!
//! Processes inside a test's namespace (the operator, a kubelet) must reach services that
//! listen on the host's loopback (the shared kube-apiserver, the agent, the span
//! receiver). A [`LoopbackRelay`] listens on `127.0.0.1:PORT` inside the namespace and
//! forwards every connection to `127.0.0.1:PORT` outside, so the same address (and the
//! apiserver's certificate for it) works on both sides; [`LoopbackRelay::start_on`]
//! listens on another address of the namespace (all of them, for a node whose pods reach
//! the apiserver at the node's address), and [`LoopbackRelay::start_into`] relays the
//! other way, from the host's loopback to the namespace's (the apiserver to a kubelet).
//! Traffic stays on loopback and in the namespace.

use std::net::{Ipv4Addr, SocketAddr};

use tokio::task::JoinHandle;

use crate::netns::{bind_tcp_in, connect_tcp_in};

/// One relayed port; stops accepting when dropped.
#[derive(Debug)]
pub struct LoopbackRelay {
    port: u16,
    task: JoinHandle<()>,
}

impl LoopbackRelay {
    /// Relays `127.0.0.1:port` in `netns` to `127.0.0.1:port` here, on `runtime`.
    pub fn start(runtime: &tokio::runtime::Handle, netns: &str, port: u16) -> anyhow::Result<Self> {
        Self::start_on(
            runtime,
            netns,
            SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
        )
    }

    /// Relays `listen` in `netns` to `127.0.0.1:<listen's port>` here, on `runtime`.
    pub fn start_on(
        runtime: &tokio::runtime::Handle,
        netns: &str,
        listen: SocketAddr,
    ) -> anyhow::Result<Self> {
        let port = listen.port();
        let target = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let listener = bind_tcp_in(netns, listen)?;
        listener.set_nonblocking(true)?;
        let task = runtime.spawn(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            while let Ok((mut inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Ok(Self { port, task })
    }

    /// The other way: listens on a free port of the host's loopback and relays every
    /// connection to the same port on `127.0.0.1` inside `netns`, on `runtime`.
    pub fn start_into(runtime: &tokio::runtime::Handle, netns: &str) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let port = listener.local_addr()?.port();
        listener.set_nonblocking(true)?;
        let target = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let netns = netns.to_owned();
        let task = runtime.spawn(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            while let Ok((mut inbound, _)) = listener.accept().await {
                let netns = netns.clone();
                tokio::spawn(async move {
                    // connect_tcp_in enters the namespace on a fresh thread of its own, so
                    // the blocking pool's thread stays in the host's namespace.
                    let connected =
                        tokio::task::spawn_blocking(move || connect_tcp_in(&netns, target)).await;
                    let Ok(Ok(outbound)) = connected else { return };
                    if outbound.set_nonblocking(true).is_err() {
                        return;
                    }
                    if let Ok(mut outbound) = tokio::net::TcpStream::from_std(outbound) {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Ok(Self { port, task })
    }

    /// The relayed port.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for LoopbackRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}
