//! Bulk streams: volume uploads on a low-priority runtime, so they yield the CPU to
//! cheap calls.
//!
//! A volume upload keeps several threads busy (the libvirt stream writer, the relay, SSH
//! encryption). On the same threads as cheap calls, or at the same OS priority, it delays
//! them by whole scheduler slices on a small machine. Everything of a bulk stream on the
//! agent's side therefore runs on this runtime: its SSH session task, its relay, and its
//! blocking libvirt thread. Every thread of the runtime lowers its own scheduling priority
//! (Linux `nice` is per thread) to [`BULK_NICE`] when it starts.
//!
//! The runtime lives for the process; it is created on the first bulk stream.

//!
//! Streaming bytes into a storage volume (`virStorageVolUpload`, [`upload_volume`]) runs
//! on its own libvirt connection and SSH session, on this runtime ([`HostPool::bulk`]), so
//! cheap calls on the host's shared connection never wait behind it, and under the
//! caller's deadline like any call: on expiry the dedicated connection's relay is cut and
//! the stream ends at once. Data goes in 256 KiB chunks (the fastest size measured over
//! the SSH relay); `send` may accept less than offered, so each chunk is sent until it is
//! consumed.

use std::io::Read;
use std::sync::{Arc, OnceLock};

use tokio::time::Instant;
use virt::stream::Stream;

use crate::transport::call::{CallFailure, LibvirtOp};
use crate::transport::error::TransportError;
use crate::transport::pool::HostPool;

/// The nice value of bulk-stream threads (0 is normal, 19 the lowest priority).
pub const BULK_NICE: i32 = 10;

static RUNTIME: OnceLock<std::io::Result<tokio::runtime::Runtime>> = OnceLock::new();

/// The bulk runtime's handle, or `None` if it could not be built (then the caller's own
/// runtime is used).
pub(crate) fn handle() -> Option<tokio::runtime::Handle> {
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("kvm-agent-bulk")
                .on_thread_start(lower_priority)
                .enable_all()
                .build()
        })
        .as_ref()
        .map(|runtime| runtime.handle().clone())
        .inspect_err(|e| tracing::warn!(error = %e, "cannot start the bulk runtime; bulk streams run at normal priority"))
        .ok()
}

fn lower_priority() {
    // `None`: the calling thread (Linux applies PRIO_PROCESS with who=0 per thread).
    if let Err(e) = rustix::process::setpriority_process(None, BULK_NICE) {
        tracing::debug!(error = %e, "cannot lower a bulk thread's priority");
    }
}

const CHUNK: usize = 256 * 1024;

/// Writes `length` bytes from `source` into volume `volume` of pool `pool` on `host`,
/// starting at offset 0. Returns the bytes sent.
pub async fn upload_volume(
    host: &Arc<HostPool>,
    pool: &str,
    volume: &str,
    mut source: impl Read + Send + 'static,
    length: u64,
    deadline: Instant,
) -> Result<u64, TransportError> {
    let (pool, volume) = (pool.to_owned(), volume.to_owned());
    let host_name = host.name().to_owned();
    let op = LibvirtOp::new("virStorageVolUpload")
        .volume(volume.clone())
        .bytes(length);
    host.bulk(op, deadline, move |conn| {
        let pool = conn.lookup_storage_pool_by_name(&pool)?;
        let vol = pool.lookup_storage_vol_by_name(&volume)?;
        let stream = Stream::new(conn, 0)?;
        vol.upload(&stream, 0, length, 0)?;
        let mut buf = vec![0u8; CHUNK];
        let mut sent = 0u64;
        while sent < length {
            let want = usize::try_from(length - sent).unwrap_or(CHUNK).min(CHUNK);
            let read = match source.read(&mut buf[..want]) {
                Ok(0) => {
                    let _ = stream.abort();
                    return Err(CallFailure::Agent(TransportError::io(
                        format!(
                            "host {host_name}: upload source ended after {sent} of {length} bytes"
                        ),
                        std::io::Error::from(std::io::ErrorKind::UnexpectedEof),
                    )));
                }
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = stream.abort();
                    return Err(CallFailure::Agent(TransportError::io(
                        format!("host {host_name}: read upload source"),
                        e,
                    )));
                }
            };
            let mut chunk = &buf[..read];
            while !chunk.is_empty() {
                let n = stream.send(chunk)?;
                let n = usize::try_from(n).unwrap_or(0);
                chunk = &chunk[n.min(chunk.len())..];
            }
            sent += read as u64;
        }
        stream.finish()?;
        Ok(sent)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bulk_threads_run_at_lower_priority() {
        let runtime = handle().expect("bulk runtime");
        let (worker, blocking) = runtime.block_on(async {
            let worker =
                tokio::spawn(async { rustix::process::getpriority_process(None).unwrap() });
            let blocking =
                tokio::task::spawn_blocking(|| rustix::process::getpriority_process(None).unwrap());
            (worker.await.unwrap(), blocking.await.unwrap())
        });
        let own = rustix::process::getpriority_process(None).unwrap();
        assert_eq!(worker, BULK_NICE);
        assert_eq!(blocking, BULK_NICE);
        assert_ne!(own, BULK_NICE, "the caller's thread keeps its priority");
    }
}
