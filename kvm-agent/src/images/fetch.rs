//! Downloading a base image over HTTP(S) (or reading a `file://` image on the agent's own
//! filesystem), streamed through SHA-256, never held in memory.
//!
//! [`fetch`] sends the GET (following up to 5 redirects) and classifies the answer: 404,
//! 410, 403 and 401 are permanent
//! (the URL is wrong or forbidden: fix the image's configuration), 5xx, 429 and 408
//! transient, as are network errors. On success it returns a [`Download`]: a blocking
//! [`Read`] over the body, fed by a task through a bounded channel (at most
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
//! classified failure ([`Error::ImageChecksum`] permanent, [`Error::ImageTruncated`]
//! transient) is kept for the caller ([`Download::failure`]), since `Read` can only return
//! an `io::Error`.

use std::io::Read;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::error::Error;

/// Body chunks buffered between the network and the reader.
pub const BUFFERED_CHUNKS: usize = 16;

/// An image download in progress. See the module docs.
#[derive(Debug)]
pub struct Download {
    url: String,
    length: Option<u64>,
    expected_sha256: Option<String>,
    body: mpsc::Receiver<Result<Bytes, String>>,
    pending: Bytes,
    hasher: Sha256,
    received: u64,
    finished: bool,
    failure: Arc<Mutex<Option<Error>>>,
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
    /// [`Error::ImageTruncated`], so a stalled server cannot pin the reading thread.
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
        body: mpsc::Receiver<Result<Bytes, String>>,
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
    pub fn failure(&self) -> Arc<Mutex<Option<Error>>> {
        self.failure.clone()
    }

    fn fail(&mut self, error: Error) -> std::io::Error {
        let io = std::io::Error::other(error.to_string());
        *self.failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
        self.finished = true;
        io
    }

    /// Checks the digest once all bytes have been hashed.
    fn verify(&mut self) -> Result<String, Error> {
        let actual: String = std::mem::take(&mut self.hasher)
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        match &self.expected_sha256 {
            Some(expected) if !expected.eq_ignore_ascii_case(&actual) => {
                Err(Error::ImageChecksum {
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
                    let error = Error::ImageTruncated {
                        url: self.url.clone(),
                        received: self.received,
                        expected: self.length,
                        reason,
                    };
                    return Err(self.fail(error));
                }
                None if self.cancelled.load(Ordering::SeqCst) => {
                    let error = Error::ImageTruncated {
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
                        let error = Error::ImageTruncated {
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
                let error = Error::ImageTruncated {
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
) -> Result<Download, Error> {
    let shown = redact_url(url);
    if let Some(path) = url.strip_prefix("file://") {
        return open_file(shown, path, expected_sha256).await;
    }
    let uri: hyper::Uri = url.parse().map_err(|e| Error::ImageFetch {
        url: shown.clone(),
        reason: format!("not a valid URL: {e}"),
        permanent: true,
    })?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(Error::ImageFetch {
            url: shown.clone(),
            reason: "only http://, https:// and file:// URLs are fetched".into(),
            permanent: true,
        });
    }
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_native_roots()
        .map_err(|e| Error::ImageFetch {
            url: shown.clone(),
            reason: format!("cannot load the system's CA certificates: {e}"),
            permanent: true,
        })?
        .https_or_http()
        .enable_http1()
        .build();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build::<_, http_body_util::Empty<Bytes>>(connector);
    let (mut uri, credentials) = take_credentials(uri).map_err(|reason| Error::ImageFetch {
        url: shown.clone(),
        reason,
        permanent: true,
    })?;
    let origin = (uri.scheme().cloned(), uri.authority().cloned());
    let mut redirects = 0;
    let response = loop {
        let mut request = hyper::Request::get(uri.clone());
        // Credentials go only to the URL's own origin, never to a redirect elsewhere.
        if let Some(credentials) = &credentials
            && (uri.scheme().cloned(), uri.authority().cloned()) == origin
        {
            request = request.header(hyper::header::AUTHORIZATION, credentials.clone());
        }
        let request =
            request
                .body(http_body_util::Empty::new())
                .map_err(|e| Error::ImageFetch {
                    url: shown.clone(),
                    reason: format!("not a valid request: {e}"),
                    permanent: true,
                })?;
        let response = tokio::time::timeout(idle, client.request(request))
            .await
            .map_err(|_| Error::ImageFetch {
                url: shown.clone(),
                reason: format!("no response within {}", humantime::format_duration(idle)),
                permanent: false,
            })?
            .map_err(|e| Error::ImageFetch {
                url: shown.clone(),
                reason: error_chain(&e),
                permanent: false,
            })?;
        if !response.status().is_redirection() || redirects == MAX_REDIRECTS {
            break response;
        }
        let location = response
            .headers()
            .get(hyper::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| resolve_location(&uri, v))
            .ok_or_else(|| Error::ImageFetch {
                url: shown.clone(),
                reason: format!("{} without a usable Location", response.status()),
                permanent: true,
            })?;
        uri = location;
        redirects += 1;
    };
    let status = response.status();
    if !status.is_success() {
        return Err(Error::ImageHttp {
            url: shown.clone(),
            status: status.as_u16(),
        });
    }
    let length = response
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let (tx, rx) = mpsc::channel(BUFFERED_CHUNKS);
    let mut body = response.into_body();
    let body_task = tokio::spawn(async move {
        loop {
            // Only the wait for the server is bounded; `send` below waits for the reader.
            let Ok(frame) = tokio::time::timeout(idle, body.frame()).await else {
                let silence = humantime::format_duration(idle);
                let _ = tx
                    .send(Err(format!("the server sent nothing for {silence}")))
                    .await;
                break;
            };
            match frame {
                None => break,
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data()
                        && tx.send(Ok(data)).await.is_err()
                    {
                        // The reader is gone: stop downloading.
                        break;
                    }
                }
                Some(Err(e)) => {
                    let _ = tx.send(Err(error_chain(&e))).await;
                    break;
                }
            }
        }
    });
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
) -> Result<Download, Error> {
    use tokio::io::AsyncReadExt;

    if !path.starts_with('/') {
        return Err(Error::ImageFetch {
            url: shown,
            reason: "a file:// URL needs an absolute path (file:///dir/image.qcow2)".into(),
            permanent: true,
        });
    }
    let opened = match tokio::fs::File::open(path).await {
        Ok(file) => file.metadata().await.map(|m| (file, m.len())),
        Err(e) => Err(e),
    };
    let (mut file, length) = opened.map_err(|e| Error::ImageFetch {
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

/// `url` as errors and logs show it: without credentials (`user:password@`) and without
/// its query (pre-signed URLs carry their signature there).
pub fn redact_url(url: &str) -> String {
    let (without_query, had_query) = match url.find(['?', '#']) {
        Some(at) => (&url[..at], url[at..].starts_with('?')),
        None => (url, false),
    };
    let shown = match without_query.split_once("://") {
        Some((scheme, rest)) => {
            let authority_end = rest.find('/').unwrap_or(rest.len());
            let (authority, path) = rest.split_at(authority_end);
            match authority.rsplit_once('@') {
                Some((_, host)) => format!("{scheme}://…@{host}{path}"),
                None => without_query.to_owned(),
            }
        }
        None => without_query.to_owned(),
    };
    if had_query {
        format!("{shown}?…")
    } else {
        shown
    }
}

/// Splits `user:password@` off `uri`: the URI without it, and the `Authorization` header
/// (HTTP basic, RFC 7617) it stands for. hyper sends no credentials of its own.
fn take_credentials(
    uri: hyper::Uri,
) -> Result<(hyper::Uri, Option<hyper::header::HeaderValue>), String> {
    let Some((userinfo, host)) = uri.authority().and_then(|a| a.as_str().rsplit_once('@')) else {
        return Ok((uri, None));
    };
    let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let pair = [
        percent_decode(user)?,
        b":".to_vec(),
        percent_decode(password)?,
    ]
    .concat();
    let mut value = hyper::header::HeaderValue::try_from(format!("Basic {}", base64(&pair)))
        .map_err(|e| format!("unusable credentials in the URL: {e}"))?;
    value.set_sensitive(true);
    let host: hyper::http::uri::Authority = host
        .parse()
        .map_err(|e| format!("not a valid host after the credentials: {e}"))?;
    let mut parts = uri.into_parts();
    parts.authority = Some(host);
    let uri = hyper::Uri::from_parts(parts).map_err(|e| format!("not a valid URL: {e}"))?;
    Ok((uri, Some(value)))
}

fn percent_decode(text: &str) -> Result<Vec<u8>, String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let byte = text
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or("a bad %-escape in the URL's credentials")?;
            out.push(byte);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    Ok(out)
}

/// Standard base64 with padding.
fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Redirects followed before the answer counts as an error.
const MAX_REDIRECTS: usize = 5;

/// The target of a `Location` header, absolute or relative to `base`.
fn resolve_location(base: &hyper::Uri, location: &str) -> Option<hyper::Uri> {
    let target: hyper::Uri = location.parse().ok()?;
    if target.scheme().is_some() {
        return Some(target);
    }
    let mut parts = base.clone().into_parts();
    parts.path_and_query = target.path_and_query().cloned();
    hyper::Uri::from_parts(parts).ok()
}

fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_in_a_url_become_basic_authentication() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(
            base64(b"Aladdin:open sesame"),
            "QWxhZGRpbjpvcGVuIHNlc2FtZQ=="
        );
        let (uri, auth) =
            take_credentials("http://Aladdin:open%20sesame@h:8080/i?x".parse().unwrap()).unwrap();
        assert_eq!(uri.to_string(), "http://h:8080/i?x");
        let auth = auth.unwrap();
        assert_eq!(auth, "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ==");
        assert!(auth.is_sensitive());
        let (uri, auth) = take_credentials("https://h/i".parse().unwrap()).unwrap();
        assert_eq!((uri.to_string(), auth), ("https://h/i".to_owned(), None));
        assert!(take_credentials("http://u:%zz@h/".parse().unwrap()).is_err());
    }

    #[test]
    fn shown_urls_keep_no_credentials_or_query() {
        for (url, shown) in [
            ("https://example.org/d.qcow2", "https://example.org/d.qcow2"),
            (
                "https://user:secret@example.org:8443/d.qcow2",
                "https://…@example.org:8443/d.qcow2",
            ),
            (
                "https://bucket.s3.example/d.qcow2?X-Amz-Signature=secret",
                "https://bucket.s3.example/d.qcow2?…",
            ),
            ("http://u:p@h?sig=secret#frag", "http://…@h?…"),
            ("http://h/a#frag", "http://h/a"),
            ("not a url", "not a url"),
        ] {
            assert_eq!(redact_url(url), shown, "{url}");
        }
    }
}
