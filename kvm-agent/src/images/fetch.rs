//! Downloading a base image over HTTP(S) (or reading a `file://` image on the agent's own
//! filesystem), streamed through SHA-256, never held in memory.
//!
//! [`fetch`] sends the GET through the `http` module (reqwest: redirects, basic
//! authentication from the URL's `user:password@`, TLS) and classifies the answer: 404,
//! 410, 403 and 401 are permanent (the URL is wrong or forbidden: fix the image's
//! configuration), 5xx, 429 and 408 transient, as are network errors; more than
//! `MAX_REDIRECTS` redirects are permanent. On success it returns a [`Download`]: a
//! blocking [`Read`] over the body, fed by a task through a bounded channel (at most
//! [`BUFFERED_CHUNKS`] chunks in flight), so it can be the source of a libvirt volume
//! upload on a blocking thread while memory stays bounded whatever the image's size.
//!
//! A server that stays silent for the `idle` time given to [`fetch`] (no response
//! headers, or no body bytes while the reader waits for more) fails the download as
//! transient; a slow reader (the upload) never counts as the server's silence. A
//! [`Canceller`] stops a download from elsewhere, e.g. when its overall deadline passes.
//!
//! Errors name the URL as [`redact_url`] shows it: no credentials, no query.
//!
//! The bytes are hashed as they pass. The check is made before the **last** byte is
//! handed out: when the announced length is reached (or the body ends, when the server
//! sent no `Content-Length`), a wrong digest or a short body fails that read instead of
//! returning the final chunk, so an upload never completes with wrong content. The
//! classified failure ([`ImageError::Checksum`] permanent, [`ImageError::Truncated`]
//! transient) is kept for the caller ([`Download::failure`]), since `Read` can only return
//! an `io::Error`.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use super::http::{self, Chunk};
use crate::config::redact_url;
use crate::images::error::ImageError;

/// Body chunks buffered between the network and the reader.
pub const BUFFERED_CHUNKS: usize = 16;

/// An image download in progress. See the module docs.
#[derive(Debug)]
pub struct Download {
    url: String,
    length: Option<u64>,
    expected_sha256: Option<String>,
    body: mpsc::Receiver<Chunk>,
    pending: Bytes,
    hasher: Sha256,
    received: u64,
    finished: bool,
    failure: Arc<Mutex<Option<ImageError>>>,
    cancelled: Arc<AtomicBool>,
    body_task: tokio::task::AbortHandle,
}

/// Cancels a [`Download`] from elsewhere; see [`Download::canceller`].
#[derive(Debug, Clone)]
pub struct Canceller {
    cancelled: Arc<AtomicBool>,
    body_task: tokio::task::AbortHandle,
}

impl Canceller {
    /// Stops the network side. A read waiting for bytes then fails at once with
    /// [`ImageError::Truncated`], so a stalled server cannot pin the reading thread.
    pub fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.body_task.abort();
    }
}

impl Download {
    fn new(
        url: String,
        length: Option<u64>,
        expected_sha256: Option<&str>,
        body: mpsc::Receiver<Chunk>,
        body_task: tokio::task::AbortHandle,
    ) -> Self {
        Self {
            url,
            length,
            expected_sha256: expected_sha256.map(str::to_owned),
            body,
            pending: Bytes::new(),
            hasher: Sha256::new(),
            received: 0,
            finished: false,
            failure: Arc::default(),
            cancelled: Arc::default(),
            body_task,
        }
    }

    /// A handle that cancels this download (e.g. when its deadline passes).
    pub fn canceller(&self) -> Canceller {
        Canceller {
            cancelled: self.cancelled.clone(),
            body_task: self.body_task.clone(),
        }
    }

    /// The length the server announced (`Content-Length`), if any.
    pub fn length(&self) -> Option<u64> {
        self.length
    }

    /// Where the classified failure of a read is kept; take it after a failed upload.
    pub fn failure(&self) -> Arc<Mutex<Option<ImageError>>> {
        self.failure.clone()
    }

    fn fail(&mut self, error: ImageError) -> std::io::Error {
        let io = std::io::Error::other(error.to_string());
        *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
        self.finished = true;
        io
    }

    /// Checks the digest once all bytes have been hashed.
    fn verify(&mut self) -> Result<String, ImageError> {
        let actual: String = std::mem::take(&mut self.hasher)
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        match &self.expected_sha256 {
            Some(expected) if !expected.eq_ignore_ascii_case(&actual) => {
                Err(ImageError::Checksum {
                    url: self.url.clone(),
                    expected: expected.clone(),
                    actual,
                })
            }
            _ => Ok(actual),
        }
    }
}

impl Read for Download {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.finished {
            return Ok(0);
        }
        while self.pending.is_empty() {
            match self.body.blocking_recv() {
                Some(Ok(chunk)) => self.pending = chunk,
                Some(Err(reason)) => {
                    let error = ImageError::Truncated {
                        url: self.url.clone(),
                        received: self.received,
                        expected: self.length,
                        reason,
                    };
                    return Err(self.fail(error));
                }
                None if self.cancelled.load(Ordering::SeqCst) => {
                    let error = ImageError::Truncated {
                        url: self.url.clone(),
                        received: self.received,
                        expected: self.length,
                        reason: "the download was cancelled".into(),
                    };
                    return Err(self.fail(error));
                }
                None => {
                    // End of body.
                    if let Some(expected) = self.length
                        && self.received < expected
                    {
                        let error = ImageError::Truncated {
                            url: self.url.clone(),
                            received: self.received,
                            expected: Some(expected),
                            reason: "the connection ended early".into(),
                        };
                        return Err(self.fail(error));
                    }
                    self.finished = true;
                    // With a known length the digest was checked with the last chunk.
                    if matches!(self.length, None | Some(0))
                        && let Err(error) = self.verify()
                    {
                        return Err(self.fail(error));
                    }
                    return Ok(0);
                }
            }
        }
        let mut n = buf.len().min(self.pending.len());
        if let Some(expected) = self.length {
            let left = expected - self.received;
            if left == 0 {
                let error = ImageError::Truncated {
                    url: self.url.clone(),
                    received: self.received,
                    expected: Some(expected),
                    reason: "the server sent more than its Content-Length".into(),
                };
                return Err(self.fail(error));
            }
            n = n.min(usize::try_from(left).unwrap_or(usize::MAX));
        }
        self.hasher.update(&self.pending[..n]);
        self.received += n as u64;
        if self.length == Some(self.received)
            && let Err(error) = self.verify()
        {
            // Withhold the last bytes: the upload must not complete.
            return Err(self.fail(error));
        }
        buf[..n].copy_from_slice(&self.pending[..n]);
        self.pending = self.pending.slice(n..);
        Ok(n)
    }
}

/// Starts downloading `url`; `expected_sha256` (hex) is verified as the bytes pass. The
/// server may stay silent for at most `idle` at a time (see the module docs).
///
/// Must be called inside a tokio runtime; the returned reader is read on a blocking
/// thread.
pub async fn fetch(
    url: &str,
    expected_sha256: Option<&str>,
    idle: Duration,
) -> Result<Download, ImageError> {
    let shown = redact_url(url);
    if let Some(path) = url.strip_prefix("file://") {
        return open_file(shown, path, expected_sha256).await;
    }
    let response = http::get(url, &shown, idle).await?;
    let length = response.content_length();
    let (tx, rx) = mpsc::channel(BUFFERED_CHUNKS);
    let body_task = tokio::spawn(http::forward_body(response, idle, tx));
    Ok(Download::new(
        shown,
        length,
        expected_sha256,
        rx,
        body_task.abort_handle(),
    ))
}

/// Chunks read at a time from a `file://` image.
const FILE_CHUNK: usize = 256 * 1024;

/// A `file://` image: a file on the agent's own filesystem (e.g. a mounted volume), read
/// by a task into the same bounded channel as an HTTP body.
async fn open_file(
    shown: String,
    path: &str,
    expected_sha256: Option<&str>,
) -> Result<Download, ImageError> {
    use tokio::io::AsyncReadExt;

    if !path.starts_with('/') {
        return Err(ImageError::Fetch {
            url: shown,
            reason: "a file:// URL needs an absolute path (file:///dir/image.qcow2)".into(),
            permanent: true,
        });
    }
    let opened = match tokio::fs::File::open(path).await {
        Ok(file) => file.metadata().await.map(|m| (file, m.len())),
        Err(e) => Err(e),
    };
    let (mut file, length) = opened.map_err(|e| ImageError::Fetch {
        url: shown.clone(),
        reason: format!("cannot read {path} on the agent: {e}"),
        permanent: matches!(
            e.kind(),
            std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
        ),
    })?;
    let (tx, rx) = mpsc::channel(BUFFERED_CHUNKS);
    let body_task = tokio::spawn(async move {
        loop {
            let mut chunk = bytes::BytesMut::with_capacity(FILE_CHUNK);
            match file.read_buf(&mut chunk).await {
                Ok(0) => break,
                Ok(_) => {
                    if tx.send(Ok(chunk.freeze())).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Err(e.to_string())).await;
                    break;
                }
            }
        }
    });
    Ok(Download::new(
        shown,
        Some(length),
        expected_sha256,
        rx,
        body_task.abort_handle(),
    ))
}
