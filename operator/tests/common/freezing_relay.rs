//! A TCP relay in front of the apiserver that can freeze its connections: the effect of
//! a connection that died on the way (a NAT or firewall dropped it) with the request
//! already sent, so the call hangs until the caller gives up. Connections opened after
//! [`FreezingRelay::thaw`] work again; frozen ones stay frozen. [`FreezingRelay::cut`]
//! closes every open connection instead, as a peer that went away would, and
//! [`FreezingRelay::refuse`] closes new ones until the thaw.

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
    /// While set, new connections are closed at once (a peer that is down).
    refusing: bool,
}

/// A relay to one address; stops when dropped.
pub struct FreezingRelay {
    address: SocketAddr,
    state: Arc<Mutex<State>>,
    /// Bytes that arrived on frozen connections and were held back.
    held: watch::Sender<u64>,
    /// Connections with an id below this are cut.
    cut_below: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl FreezingRelay {
    /// Relays 127.0.0.1:(a free port) to `target`.
    pub async fn start(target: SocketAddr) -> FreezingRelay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let held = watch::Sender::new(0);
        let cut_below = watch::Sender::new(0);
        let task = tokio::spawn({
            let state = state.clone();
            let held = held.clone();
            let cut_below = cut_below.clone();
            async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    if state.lock().unwrap().refusing {
                        drop(inbound);
                        continue;
                    }
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
                    let ends = Ends {
                        id,
                        state: state.clone(),
                        held: held.clone(),
                        cuts: cut_below.subscribe(),
                    };
                    tokio::spawn(pump(in_read, out_write, ends.clone()));
                    tokio::spawn(pump(out_read, in_write, ends));
                }
            }
        });
        FreezingRelay {
            address,
            state,
            held,
            cut_below,
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

    /// Closes every connection open now (frozen or not); later ones are not affected.
    pub fn cut(&self) {
        let next = self.state.lock().unwrap().next_id;
        self.cut_below.send_replace(next);
    }

    /// Closes every new connection at once until [`FreezingRelay::thaw`], as a peer
    /// that is down would.
    pub fn refuse(&self) {
        self.state.lock().unwrap().refusing = true;
    }

    /// New connections work again; frozen ones stay frozen.
    pub fn thaw(&self) {
        let mut state = self.state.lock().unwrap();
        state.freezing = false;
        state.refusing = false;
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

/// What a pump needs to know about its connection.
#[derive(Clone)]
struct Ends {
    id: u64,
    state: Arc<Mutex<State>>,
    held: watch::Sender<u64>,
    cuts: watch::Receiver<u64>,
}

/// Copies `from` to `to` until the connection is frozen, then holds what arrives; ends
/// (closing both halves) when the connection is cut.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut ends: Ends,
) {
    let id = ends.id;
    let mut buffer = vec![0; 64 * 1024];
    loop {
        let read = tokio::select! {
            read = from.read(&mut buffer) => match read {
                Ok(0) | Err(_) => break,
                Ok(read) => read,
            },
            _ = ends.cuts.wait_for(|below| id < *below) => break,
        };
        if ends.state.lock().unwrap().frozen.contains(&id) {
            ends.held.send_modify(|bytes| *bytes += read as u64);
            // Keep both halves open and say nothing more: the peer waits until cut.
            let _ = ends.cuts.wait_for(|below| id < *below).await;
            break;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            break;
        }
    }
    ends.state.lock().unwrap().open.remove(&id);
}
