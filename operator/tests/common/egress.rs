//! A destination that answers its caller's address (an echo service, as
//! `https://api.ipify.org`), and a stand-in for a VM's proxy that forwards plain HTTP
//! from a source address of the test's choosing, as a proxy behind NAT does: the
//! address the destination sees is not the one the proxy listens on.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// An echo service on 127.0.0.1 that records every caller's address.
pub struct EchoService {
    pub address: SocketAddr,
    callers: Arc<Mutex<Vec<IpAddr>>>,
    task: tokio::task::JoinHandle<()>,
}

impl EchoService {
    pub async fn start() -> EchoService {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let callers = Arc::new(Mutex::new(Vec::new()));
        let seen = callers.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut stream, peer)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    if read_head(&mut stream).await.is_empty() {
                        return;
                    }
                    seen.lock().unwrap().push(peer.ip());
                    let body = format!("{}\n", peer.ip());
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                });
            }
        });
        EchoService {
            address,
            callers,
            task,
        }
    }

    /// The addresses of its callers so far, in order.
    pub fn callers(&self) -> Vec<IpAddr> {
        self.callers.lock().unwrap().clone()
    }
}

impl Drop for EchoService {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A forwarding HTTP proxy listening on `listen` whose outgoing connections leave
/// from [`NattingProxy::set_source`]'s address. A connection that sends nothing (the
/// operator's TCP health check) is closed.
pub struct NattingProxy {
    source: Arc<Mutex<IpAddr>>,
    task: tokio::task::JoinHandle<()>,
}

impl NattingProxy {
    pub async fn start(listen: SocketAddr, source: IpAddr) -> NattingProxy {
        let listener = TcpListener::bind(listen).await.unwrap();
        let source = Arc::new(Mutex::new(source));
        let from = source.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let from = *from.lock().unwrap();
                tokio::spawn(forward(stream, from));
            }
        });
        NattingProxy { source, task }
    }

    /// Later connections leave from `source`.
    pub fn set_source(&self, source: IpAddr) {
        *self.source.lock().unwrap() = source;
    }
}

impl Drop for NattingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Forwards one absolute-form `GET http://host:port/path` to its destination from
/// `source`; 502 when the destination cannot be reached.
async fn forward(mut client: TcpStream, source: IpAddr) {
    let head = read_head(&mut client).await;
    let text = String::from_utf8_lossy(&head).into_owned();
    let Some(target) = text
        .split_whitespace()
        .nth(1)
        .and_then(|url| url.strip_prefix("http://"))
    else {
        return;
    };
    let (authority, path) = target.split_at(target.find('/').unwrap_or(target.len()));
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    let Ok(destination) = authority.parse::<SocketAddr>() else {
        return;
    };
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(source, 0)).unwrap();
    let Ok(mut upstream) = socket.connect(destination).await else {
        let _ = client
            .write_all(
                b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            )
            .await;
        return;
    };
    let path = if path.is_empty() { "/" } else { path };
    let rest = text.split_once("\r\n").map_or("", |(_, rest)| rest);
    let request = format!("GET {path} HTTP/1.1\r\n{rest}");
    if upstream.write_all(request.as_bytes()).await.is_err() {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}

/// Reads up to the end of a request head (or the connection's end).
async fn read_head(stream: &mut TcpStream) -> Vec<u8> {
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&chunk[..n]),
        }
    }
    head
}
