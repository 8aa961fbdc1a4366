//! A TCP relay in front of the apiserver that can freeze its connections: the effect of
//! a connection that died on the way (a NAT or firewall dropped it) with the request
//! already sent, so the call hangs until the caller gives up. Connections opened after
//! [`FreezingRelay::thaw`] work again; frozen ones stay frozen.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

#[derive(Default)]
struct State {
    next_id: u64,
    open: HashSet<u64>,
    frozen: HashSet<u64>,
    /// While set, new connections are frozen from the start.
    freezing: bool,
}

/// A relay to one address; stops when dropped.
pub struct FreezingRelay {
    address: SocketAddr,
    state: Arc<Mutex<State>>,
    /// Bytes that arrived on frozen connections and were held back.
    held: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl FreezingRelay {
    /// Relays 127.0.0.1:(a free port) to `target`.
    pub async fn start(target: SocketAddr) -> FreezingRelay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let held = watch::Sender::new(0);
        let task = tokio::spawn({
            let state = state.clone();
            let held = held.clone();
            async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    let Ok(outbound) = tokio::net::TcpStream::connect(target).await else {
                        continue;
                    };
                    let id = {
                        let mut state = state.lock().unwrap();
                        let id = state.next_id;
                        state.next_id += 1;
                        state.open.insert(id);
                        if state.freezing {
                            state.frozen.insert(id);
                        }
                        id
                    };
                    let (in_read, in_write) = inbound.into_split();
                    let (out_read, out_write) = outbound.into_split();
                    tokio::spawn(pump(id, in_read, out_write, state.clone(), held.clone()));
                    tokio::spawn(pump(id, out_read, in_write, state.clone(), held.clone()));
                }
            }
        });
        FreezingRelay {
            address,
            state,
            held,
            task,
        }
    }

    /// The relay's address.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Freezes every open connection and every new one until [`FreezingRelay::thaw`].
    pub fn freeze(&self) {
        let mut state = self.state.lock().unwrap();
        state.freezing = true;
        let open: Vec<u64> = state.open.iter().copied().collect();
        state.frozen.extend(open);
    }

    /// New connections work again; frozen ones stay frozen.
    pub fn thaw(&self) {
        self.state.lock().unwrap().freezing = false;
    }

    /// Waits until a frozen connection has held back some bytes: a request is stuck.
    pub async fn wait_for_a_stuck_request(&self) {
        let mut held = self.held.subscribe();
        tokio::time::timeout(super::WAIT, held.wait_for(|bytes| *bytes > 0))
            .await
            .expect("no request reached a frozen connection")
            .unwrap();
    }
}

impl Drop for FreezingRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to` until the connection is frozen, then holds what arrives.
async fn pump(
    id: u64,
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<Mutex<State>>,
    held: watch::Sender<u64>,
) {
    let mut buffer = vec![0; 64 * 1024];
    loop {
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if state.lock().unwrap().frozen.contains(&id) {
            held.send_modify(|bytes| *bytes += read as u64);
            // Keep both halves open and say nothing more: the peer waits for ever.
            std::future::pending::<()>().await;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    state.lock().unwrap().open.remove(&id);
}
