//! Bulk streams: streaming bytes into a storage volume (`virStorageVolUpload`,
//! [`upload_volume`]).
//!
//! An upload runs on its own libvirt connection and SSH session, on the low-priority
//! runtime of `bulk_runtime` ([`HostPool::bulk`]), so cheap calls on the host's shared
//! connection never wait behind it, and under the caller's deadline like any call: on
//! expiry the dedicated connection's relay is cut and the stream ends at once. Data goes
//! in 256 KiB chunks (the fastest size measured over the SSH relay); `send` may accept
//! less than offered, so each chunk is sent until it is consumed.

use std::io::Read;
use std::sync::Arc;

use tokio::time::Instant;
use virt::stream::Stream;

use crate::transport::call::{CallFailure, LibvirtOp};
use crate::transport::error::TransportError;
use crate::transport::pool::HostPool;

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
