//! The relay under one libvirt connection: a private unix socket pumped to the hypervisor.
//!
//! libvirt's client library only speaks to sockets it opens itself, so every libvirt
//! connection the agent makes goes through its own relay:
//! 1. [`Forward::listen`] binds `c<N>.sock` in the agent's private directory (mode 0700);
//! 2. `virt` opens `qemu+unix:///system?socket=<that path>` ([`Forward::uri`]);
//! 3. the pump task accepts that one connection, removes the socket file, and opens the
//!    upstream: a `direct-streamlocal@openssh.com` channel to the remote libvirt socket
//!    (SSH mode) or the local libvirt socket (local mode);
//! 4. it copies bytes both ways until either side closes.
//!
//! Guarantees:
//! - One channel per libvirt connection: a stalled connection never stalls another.
//! - [`Forward::abort`] ends the pump at once. libvirt then sees EOF and a call blocked on
//!   this connection returns within milliseconds: the only way to free a thread stuck in a
//!   libvirt call on a hung host. The SSH session is unaffected.
//! - A refused upstream (forwarding denied, socket missing) is remembered
//!   ([`Forward::upstream_error`]), since libvirt only reports "connection reset".
//! - Dropping a `Forward` aborts the pump and removes the socket file.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::io::AsyncWriteExt;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinHandle;

use crate::transport::error::TransportError;
use crate::transport::ssh::SshSession;

/// 256 KiB: the relay's copy buffer in each direction (fastest for volume uploads).
const RELAY_BUFFER: usize = 256 * 1024;

/// Where the relay's upstream leads.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// A `direct-streamlocal` channel on an SSH session to this remote socket.
    Ssh {
        /// The session.
        session: Arc<SshSession>,
        /// libvirt's socket on the hypervisor.
        remote_socket: PathBuf,
    },
    /// A local unix socket (the agent runs on the hypervisor).
    Local {
        /// Host name, for errors.
        host: String,
        /// libvirt's socket.
        socket: PathBuf,
    },
}

/// The relay of one libvirt connection. See the module docs.
#[derive(Debug)]
pub struct Forward {
    socket: PathBuf,
    pump: JoinHandle<()>,
    upstream_error: Arc<Mutex<Option<TransportError>>>,
}

impl Forward {
    /// Binds `socket` and starts the pump that serves its first connection.
    pub fn listen(socket: PathBuf, upstream: Upstream) -> Result<Self, TransportError> {
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).map_err(|e| {
            TransportError::io(format!("bind relay socket {}", socket.display()), e)
        })?;
        let upstream_error = Arc::new(Mutex::new(None));
        let pump = tokio::spawn(pump(
            listener,
            socket.clone(),
            upstream,
            upstream_error.clone(),
        ));
        Ok(Self {
            socket,
            pump,
            upstream_error,
        })
    }

    /// The URI `virt` opens to use this relay; the path is percent-escaped.
    pub fn uri(&self) -> String {
        format!(
            "qemu+unix:///system?socket={}",
            escape_uri_value(&self.socket)
        )
    }

    /// Ends the pump now; libvirt sees EOF on this connection.
    pub fn abort(&self) {
        self.pump.abort();
    }

    /// Whether the pump has ended (either side closed, or aborted): the connection is dead.
    pub fn is_finished(&self) -> bool {
        self.pump.is_finished()
    }

    /// Why the upstream could not be opened, if it could not.
    pub fn upstream_error(&self) -> Option<TransportError> {
        self.upstream_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.pump.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

async fn pump(
    listener: UnixListener,
    socket: PathBuf,
    upstream: Upstream,
    upstream_error: Arc<Mutex<Option<TransportError>>>,
) {
    let accepted = listener.accept().await;
    drop(listener);
    let _ = std::fs::remove_file(&socket);
    let Ok((mut local, _)) = accepted else {
        return;
    };
    let result = match &upstream {
        Upstream::Ssh {
            session,
            remote_socket,
        } => match session.open_streamlocal(remote_socket).await {
            Ok(channel) => {
                relay(&mut local, &mut channel.into_stream()).await;
                if session.is_closed() {
                    Err(TransportError::SshSessionClosed {
                        host: session.host().to_owned(),
                    })
                } else {
                    Ok(())
                }
            }
            Err(e) => Err(e),
        },
        Upstream::Local { host, socket } => match UnixStream::connect(socket).await {
            Ok(mut stream) => {
                relay(&mut local, &mut stream).await;
                Ok(())
            }
            Err(source) => Err(TransportError::LocalSocket {
                host: host.clone(),
                socket: socket.clone(),
                source,
            }),
        },
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "libvirt relay upstream failed");
        *upstream_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
    }
    let _ = local.shutdown().await;
}

async fn relay<U>(local: &mut UnixStream, upstream: &mut U)
where
    U: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    // An I/O error here is the link dying under an open connection; libvirt reports it
    // to the call as a transport error, so there is nothing more to remember.
    let _ =
        tokio::io::copy_bidirectional_with_sizes(local, upstream, RELAY_BUFFER, RELAY_BUFFER).await;
}

/// Percent-escapes a path for a libvirt URI query value.
fn escape_uri_value(path: &Path) -> String {
    let mut out = String::new();
    for byte in path.as_os_str().as_encoded_bytes() {
        match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'/' | b'-' | b'_' | b'.' | b'~' => {
                out.push(*byte as char)
            }
            other => out.push_str(&format!("%{other:02X}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_path_is_escaped_in_the_uri() {
        assert_eq!(
            escape_uri_value(Path::new("/tmp/a b&c=d/c1.sock")),
            "/tmp/a%20b%26c%3Dd/c1.sock"
        );
    }
}
