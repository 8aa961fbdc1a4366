//! Loopback relays into a network namespace.
//!
//! Processes inside the test's namespace (the operator) must reach services that listen on
//! the host's loopback (the shared kube-apiserver, the agent, the span receiver). A
//! [`LoopbackRelay`] listens on `127.0.0.1:PORT` inside the namespace and forwards every
//! connection to `127.0.0.1:PORT` outside, so the same address (and the apiserver's
//! certificate for it) works on both sides. Traffic stays on loopback.

use std::net::{Ipv4Addr, SocketAddr};

use tokio::task::JoinHandle;

use super::netns::bind_tcp_in;

/// One relayed port; stops accepting when dropped.
#[derive(Debug)]
pub struct LoopbackRelay {
    port: u16,
    task: JoinHandle<()>,
}

impl LoopbackRelay {
    /// Relays `127.0.0.1:port` in `netns` to `127.0.0.1:port` here, on `runtime`.
    pub fn start(runtime: &tokio::runtime::Handle, netns: &str, port: u16) -> anyhow::Result<Self> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let listener = bind_tcp_in(netns, addr)?;
        listener.set_nonblocking(true)?;
        let task = runtime.spawn(async move {
            let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                return;
            };
            while let Ok((mut inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(addr).await {
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
