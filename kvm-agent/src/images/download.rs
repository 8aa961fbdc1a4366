//! One base image download, the detached work of a flight of the cache: steps 3 to 8
//! of [`super::cache`]'s docs (check, fetch, stage, verify, inspect, mark), with its
//! progress, which a caller that stops waiting reports with a retry hint.

use std::io::{Read, Seek, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::base_volume::{BaseImage, BaseNames};
use super::cache_options::ImageCacheOptions;
use super::host_volumes::{
    Existing, check_existing, check_format, create_marker, create_upload_target,
    delete_half_written, inspect, pool_available,
};
use crate::classification::ErrorClass;
use crate::config::{ImageConfig, redact_url};
use crate::images::error::ImageError;
use crate::images::fetch::{self, Download};
use crate::transport::bulk::upload_volume;
use crate::transport::error::TransportError;
use crate::transport::pool::HostPool;

/// Buffer of the spool copy; the size the upload sends, too.
const SPOOL_CHUNK: usize = 256 * 1024;

/// How long a failed download waits for its upload call to return before deleting the
/// half-written volume anyway (the next attempt deletes it when this one cannot). The
/// wait is at least `call_timeout`, which bounds the create that precedes the upload.
const UPLOAD_SETTLE: Duration = Duration::from_secs(5);

/// Bounds of the retry hint given to a caller whose deadline passed mid-download.
const RETRY_HINT_MIN: Duration = Duration::from_secs(1);
const RETRY_HINT_MAX: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub(super) struct Progress {
    started: std::time::Instant,
    received: AtomicU64,
    /// `u64::MAX` while unknown.
    expected: AtomicU64,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            started: std::time::Instant::now(),
            received: AtomicU64::new(0),
            expected: AtomicU64::new(u64::MAX),
        }
    }
}

impl Progress {
    pub(super) fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    pub(super) fn expected(&self) -> Option<u64> {
        Some(self.expected.load(Ordering::Relaxed)).filter(|e| *e != u64::MAX)
    }

    /// When to ask again: the time the rest should take at the rate so far, within
    /// [`RETRY_HINT_MIN`] and [`RETRY_HINT_MAX`] (the maximum when nothing is known).
    pub(super) fn retry_hint(&self) -> Duration {
        let received = self.received();
        let elapsed = self.started.elapsed().as_secs_f64();
        let estimate = match self.expected() {
            Some(expected) if received > 0 && elapsed > 0.0 => {
                let rate = received as f64 / elapsed;
                Duration::from_secs_f64(expected.saturating_sub(received) as f64 / rate)
            }
            _ => RETRY_HINT_MAX,
        };
        estimate.clamp(RETRY_HINT_MIN, RETRY_HINT_MAX)
    }
}

/// The detached work of one flight: steps 3 to 8 of the module docs.
pub(super) struct Job {
    pub(super) host: Arc<HostPool>,
    pub(super) pool: String,
    /// The image's name in the configuration.
    pub(super) image_name: String,
    pub(super) image: ImageConfig,
    pub(super) names: BaseNames,
    pub(super) options: ImageCacheOptions,
    pub(super) progress: Arc<Progress>,
    /// The end of `imageDownloadTimeout`.
    pub(super) deadline: Instant,
    /// Locked while the upload task's libvirt calls (create, then upload) run.
    pub(super) uploading: Arc<tokio::sync::Mutex<()>>,
}

impl Job {
    /// The deadline of a cheap call: `call_timeout` from now, within the download's.
    fn call_deadline(&self) -> Instant {
        (Instant::now() + self.options.call_timeout).min(self.deadline)
    }

    fn base(&self, path: String, capacity_bytes: u64) -> BaseImage {
        BaseImage {
            volume: self.names.base.clone(),
            path,
            format: self.image.format,
            capacity_bytes,
        }
    }

    pub(super) async fn run(self) -> Result<BaseImage, ImageError> {
        let (host, pool) = (&self.host, self.pool.as_str());
        let metrics = crate::metrics::global();
        let existing = check_existing(host, pool, &self.names, self.call_deadline()).await;
        if existing.is_err() {
            metrics.image_lookup(host.name(), "failed");
        }
        if let Existing::Complete { path, capacity } = existing? {
            metrics.image_lookup(host.name(), "hit");
            return Ok(self.base(path, capacity));
        }
        let mut created = false;
        let attempt = tokio::time::timeout_at(self.deadline, self.download(&mut created)).await;
        let attempt = match attempt {
            // The upload's own deadline is the download's: whichever fires first, the
            // download timed out. The download is cancelled (dropped) by now.
            Err(_) => Err(self.timed_out()),
            Ok(Err(e))
                if e.class() == ErrorClass::DeadlineExceeded && Instant::now() >= self.deadline =>
            {
                Err(self.timed_out())
            }
            Ok(result) => result,
        };
        metrics.image_downloaded(host.name(), self.progress.received());
        match attempt {
            Ok((path, capacity)) => {
                metrics.image_lookup(host.name(), "downloaded");
                Ok(self.base(path, capacity))
            }
            Err(error) => {
                metrics.image_lookup(host.name(), "failed");
                if created {
                    // Not before a create still running, nor under a stream still
                    // writing: let the upload task's calls return first (the create
                    // within `call_timeout`, the upload's source cancelled and its
                    // connection cut at the deadline), within a bound.
                    let settle = UPLOAD_SETTLE.max(self.options.call_timeout);
                    let uploading = self.uploading.clone();
                    if tokio::time::timeout(settle, uploading.lock_owned())
                        .await
                        .is_err()
                    {
                        tracing::warn!(
                            volume = %self.names.base,
                            "the upload has not returned {settle:?} after its failure; deleting the volume anyway"
                        );
                    }
                    delete_half_written(host, pool, &self.names.base).await;
                }
                Err(error)
            }
        }
    }

    fn timed_out(&self) -> ImageError {
        ImageError::Truncated {
            url: redact_url(&self.image.url),
            received: self.progress.received(),
            expected: self.progress.expected(),
            reason: format!(
                "transport.imageDownloadTimeout ({}) passed",
                humantime::format_duration(self.options.download_timeout)
            ),
        }
    }

    /// Steps 4 to 8; sets `created` once the base volume exists. Returns path and
    /// capacity.
    async fn download(&self, created: &mut bool) -> Result<(String, u64), ImageError> {
        let (host, pool, names) = (&self.host, self.pool.as_str(), &self.names);
        let image = &self.image;
        let idle = self.options.idle_timeout;
        let download = fetch::fetch(&image.url, image.sha256.as_deref(), idle).await?;
        // Dropped with this future (deadline): a read blocked on a stalled server returns.
        let _cancel = CancelOnDrop(download.canceller());
        let failure = download.failure();
        let take_failure = || failure.lock().unwrap_or_else(|p| p.into_inner()).take();
        let (source, length): (Box<dyn Read + Send>, u64) = match download.length() {
            Some(length) => {
                self.progress.expected.store(length, Ordering::Relaxed);
                let counted = Counted {
                    inner: download,
                    progress: self.progress.clone(),
                };
                (Box::new(counted), length)
            }
            None => {
                let spool_dir = self.options.spool_dir.clone();
                let spooled = spool(download, spool_dir, self.progress.clone()).await;
                let (file, length) = spooled.map_err(|e| take_failure().unwrap_or(e))?;
                self.progress.expected.store(length, Ordering::Relaxed);
                (Box::new(file), length)
            }
        };
        if length == 0 {
            return Err(ImageError::Fetch {
                url: redact_url(&image.url),
                reason: "the server sent an empty image".into(),
                permanent: true,
            });
        }
        // Held by the upload task until its libvirt calls return, even after this future
        // is dropped (timeout): `run` waits for it before deleting a failed volume.
        let uploading = self.uploading.clone().lock_owned().await;
        // A full pool fails here, named, before a volume exists.
        self.ensure_space(length).await?;
        // From here the volume may exist. The create runs in the upload task, under the
        // call timeout alone: were it cut at the download's deadline, libvirtd could
        // finish it after `run` had deleted nothing, and the volume would stay.
        *created = true;
        let create_deadline = Instant::now() + self.options.call_timeout;
        let upload = tokio::spawn({
            let (host, pool, volume) = (host.clone(), pool.to_owned(), names.base.clone());
            let deadline = self.deadline;
            async move {
                let _uploading = uploading;
                // Past the download's deadline nothing more is started: `run` reports the
                // timeout and deletes what the create made. (A bulk dial that cannot
                // succeed would count as a failed SSH connect and back the host off.)
                if let Some(late) = too_late(&host, deadline) {
                    return Ok::<_, ImageError>(Err(late));
                }
                create_upload_target(&host, &pool, &volume, length, create_deadline).await?;
                if let Some(late) = too_late(&host, deadline) {
                    return Ok::<_, ImageError>(Err(late));
                }
                Ok::<_, ImageError>(
                    upload_volume(&host, &pool, &volume, source, length, deadline).await,
                )
            }
            .in_current_span()
        });
        let upload: Result<u64, TransportError> = match upload.await {
            Ok(outcome) => outcome?,
            Err(join) => Err(TransportError::Worker {
                host: host.name().to_owned(),
                op: "virStorageVolUpload",
                reason: join.to_string(),
            }),
        };
        let upload = upload.map_err(|e| take_failure().unwrap_or_else(|| e.into()));
        if let Err(error) = upload {
            // libvirt reports a pool that filled up during the upload as its helper's
            // end of file: name the cause when the pool has no room for the rest.
            let rest = length.saturating_sub(self.progress.received());
            return Err(self.ensure_space(rest).await.err().unwrap_or(error));
        }
        let inspected = inspect(host, pool, &names.base, self.call_deadline()).await?;
        check_format(image, &inspected)?;
        create_marker(host, pool, &names.marker, self.call_deadline()).await?;
        Ok((inspected.path, inspected.capacity))
    }
}

impl Job {
    /// Fails with [`ImageError::PoolFull`] when the pool has less than `needed` bytes free.
    async fn ensure_space(&self, needed: u64) -> Result<(), ImageError> {
        let available = pool_available(&self.host, &self.pool, self.call_deadline()).await?;
        if available >= needed {
            return Ok(());
        }
        Err(ImageError::PoolFull {
            host: self.host.name().to_owned(),
            pool: self.pool.clone(),
            image: self.image_name.clone(),
            needed,
            available,
        })
    }
}

/// The upload's deadline error when `deadline` has passed.
fn too_late(host: &HostPool, deadline: Instant) -> Option<TransportError> {
    (Instant::now() >= deadline).then(|| TransportError::DeadlineExceeded {
        host: host.name().to_owned(),
        op: "virStorageVolUpload",
        after: Duration::ZERO,
    })
}

struct CancelOnDrop(fetch::Canceller);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// A reader that counts the bytes it hands out into a flight's progress.
struct Counted<R> {
    inner: R,
    progress: Arc<Progress>,
}

impl<R: Read> Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress
            .received
            .fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Copies a download without `Content-Length` into an unnamed file in `dir` (gone when
/// closed, even if the agent dies) and rewinds it.
async fn spool(
    download: Download,
    dir: PathBuf,
    progress: Arc<Progress>,
) -> Result<(std::fs::File, u64), ImageError> {
    let spooled = tokio::task::spawn_blocking(move || {
        let mut file = tempfile::tempfile_in(&dir).map_err(|e| {
            ImageError::io(
                format!(
                    "create a spool file in {} (transport.imageSpoolDir)",
                    dir.display()
                ),
                e,
            )
        })?;
        let mut source = Counted {
            inner: download,
            progress,
        };
        let mut buf = vec![0u8; SPOOL_CHUNK];
        let mut length = 0u64;
        loop {
            let n = match source.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ImageError::io("read the image download", e)),
            };
            file.write_all(&buf[..n]).map_err(|e| {
                ImageError::io(format!("write a spool file in {}", dir.display()), e)
            })?;
            length += n as u64;
        }
        file.rewind()
            .map_err(|e| ImageError::io("rewind the spool file", e))?;
        Ok((file, length))
    })
    .await;
    spooled.unwrap_or_else(|join| {
        Err(ImageError::io(
            "spool the image download",
            std::io::Error::other(join.to_string()),
        ))
    })
}
