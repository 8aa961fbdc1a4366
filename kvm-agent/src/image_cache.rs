//! The content-addressed base image cache: one verified base volume per host and image.
//!
//! [`ImageCache::ensure_base`] makes sure an image is complete in a host's storage pool:
//! 1. **Name by content.** The base volume is [`naming::base_volume`] of the image's
//!    configured `sha256`, or, without one, of the SHA-256 of its URL string
//!    (`printf %s URL | sha256sum`). A changed URL or checksum thus names a new base beside
//!    the old one, which stays for the overlays that use it as their backing file.
//!    Its completion marker is a second, empty volume named `<base>.complete`
//!    ([`marker_volume`]); libvirt cannot rename volumes, so "complete" cannot be a rename.
//! 2. **Single flight.** One download per (host, digest) runs at a time in this process;
//!    every caller, the first included, waits for the same detached task. The task runs
//!    under `transport.imageDownloadTimeout`; a caller waits only until its own deadline
//!    and then gets [`Error::ImageDownloading`] (transient, with the bytes so far and a
//!    retry hint from the rate so far), while the download goes on and a later call finds
//!    it done. Each cheap libvirt call of the download has `transport.defaultCallTimeout`.
//! 3. **Check.** Base and marker both present: done (no HTTP request). A base without
//!    marker is what a killed agent leaves half-written: it is deleted and fetched again.
//!    A marker without base is deleted.
//! 4. **Fetch.** [`image_fetch::fetch`] classifies the answer (404/403 permanent, 5xx and
//!    network errors transient) and hashes the body as it passes. A server silent for
//!    [`DEFAULT_IDLE_TIMEOUT`] fails the download (transient) long before
//!    `imageDownloadTimeout`.
//! 5. **Stage.** With a `Content-Length`, a sparse raw volume of that size is created and
//!    the body streams straight into [`upload_volume`] (a dedicated bulk connection).
//!    Without one, the body is first spooled to an unnamed file in
//!    `transport.imageSpoolDir` (libvirt needs the length before the first byte; the
//!    container's root is read-only), then uploaded from there. Memory stays bounded
//!    either way.
//! 6. **Verify.** The reader fails the read that would hand out the last bytes when the
//!    digest is wrong (permanent) or the body is short (transient), so the upload never
//!    completes with wrong content. On any failure the download is cancelled, the upload
//!    call is awaited (at most `UPLOAD_SETTLE`, so the volume is not deleted under a
//!    stream still writing it), and the volume is deleted on the spot (retried while
//!    libvirt reports it in use; libvirt 11 does not on a dir pool, a test shows); when
//!    even that fails (or the agent is killed), step 3 deletes it next time.
//! 7. **Inspect.** A pool refresh makes libvirt probe the file: its format must be the
//!    configured one and it must not name a backing file (a guest could otherwise read a
//!    file of the hypervisor); its capacity is the virtual size, which an overlay must
//!    not undercut.
//! 8. **Mark.** The marker volume is created last.
//!
//! The libvirt calls of each step are in `host_volumes`. [`ImageCache::evict_unused`]
//! ([`eviction`]) deletes every base (marker first) that no volume in the pool uses as its
//! backing file, that is not being downloaded by this process and that is older than
//! [`DEFAULT_EVICTION_MIN_AGE`] (by default). See
//! `docs/adr/0003-content-addressed-base-images.md` for the reasoning, and its caveat: the
//! single flight is per process, so one agent (one replica) serves a host.

pub mod eviction;
mod host_volumes;

use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Seek, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;

pub use self::eviction::{EvictionReport, KeptBecause};
use self::host_volumes::{
    Existing, check_existing, check_format, create_marker, create_upload_target,
    delete_half_written, inspect,
};
use crate::config::{ImageConfig, ImageFormat, TransportConfig};
use crate::error::{ConfigProblem, Error, ErrorClass};
use crate::image_fetch::{self, Download};
use crate::naming;
use crate::pool::HostPool;
use crate::volume_upload::upload_volume;

/// Suffix of a base volume's completion marker.
pub const MARKER_SUFFIX: &str = ".complete";

/// Buffer of the spool copy; the size the upload sends, too.
const SPOOL_CHUNK: usize = 256 * 1024;

/// How long a failed download waits for its upload call to return before deleting the
/// half-written volume anyway (the next attempt deletes it when this one cannot).
const UPLOAD_SETTLE: Duration = Duration::from_secs(5);

/// Bounds of the retry hint given to a caller whose deadline passed mid-download.
const RETRY_HINT_MIN: Duration = Duration::from_secs(1);
const RETRY_HINT_MAX: Duration = Duration::from_secs(60);

/// A verified base volume on a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseImage {
    /// libvirt volume name in the host's storage pool.
    pub volume: String,
    /// Its file path on the host (disks are file-type, lesson 1).
    pub path: String,
    /// Its disk format, as configured and checked by libvirt's probe.
    pub format: ImageFormat,
    /// Virtual size of the base: an overlay must be at least this large.
    pub capacity_bytes: u64,
}

/// The completion marker volume of base volume `base`.
pub fn marker_volume(base: &str) -> String {
    format!("{base}{MARKER_SUFFIX}")
}

/// The digest that names `image`'s base volume: its configured SHA-256 (lowercased), or
/// the SHA-256 of its URL when none is configured. See the module docs.
pub fn image_digest(image: &ImageConfig) -> String {
    match &image.sha256 {
        Some(sum) => sum.to_ascii_lowercase(),
        None => hex(&Sha256::digest(image.url.as_bytes())),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Settings of an [`ImageCache`].
#[derive(Debug, Clone)]
pub struct ImageCacheOptions {
    /// Where a download without `Content-Length` is spooled before its upload.
    pub spool_dir: PathBuf,
    /// How long one download (fetch, upload, inspection, marker) may take in all.
    pub download_timeout: Duration,
    /// Deadline of each cheap libvirt call of a download (lookups, create, refresh).
    pub call_timeout: Duration,
    /// Longest silence of the image server (no headers, no body bytes) before the
    /// download fails as transient; [`DEFAULT_IDLE_TIMEOUT`].
    pub idle_timeout: Duration,
    /// Eviction keeps a base (or marker) written more recently than this, by the
    /// hypervisor's clock; [`DEFAULT_EVICTION_MIN_AGE`].
    pub eviction_min_age: Duration,
}

/// Another agent process may be uploading a base this young, or a Create may be about to
/// put an overlay on it: eviction leaves it.
pub const DEFAULT_EVICTION_MIN_AGE: Duration = Duration::from_secs(15 * 60);

/// A server silent this long while the agent waits for bytes has stalled.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

impl ImageCacheOptions {
    /// `transport.imageSpoolDir` (default: the system temp dir),
    /// `transport.imageDownloadTimeout` and `transport.defaultCallTimeout`; the idle
    /// timeout is [`DEFAULT_IDLE_TIMEOUT`], the eviction minimum age
    /// [`DEFAULT_EVICTION_MIN_AGE`].
    pub fn from_transport(transport: &TransportConfig) -> Self {
        Self {
            spool_dir: transport
                .image_spool_dir
                .clone()
                .unwrap_or_else(std::env::temp_dir),
            download_timeout: transport.image_download_timeout,
            call_timeout: transport.default_call_timeout,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            eviction_min_age: DEFAULT_EVICTION_MIN_AGE,
        }
    }
}

impl Default for ImageCacheOptions {
    fn default() -> Self {
        Self::from_transport(&TransportConfig::default())
    }
}

/// Bytes of a download so far.
#[derive(Debug)]
struct Progress {
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
    fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    fn expected(&self) -> Option<u64> {
        Some(self.expected.load(Ordering::Relaxed)).filter(|e| *e != u64::MAX)
    }

    /// When to ask again: the time the rest should take at the rate so far, within
    /// [`RETRY_HINT_MIN`] and [`RETRY_HINT_MAX`] (the maximum when nothing is known).
    fn retry_hint(&self) -> Duration {
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

type FlightResult = Option<Result<BaseImage, Arc<Error>>>;
/// (host name, digest).
type FlightKey = (String, String);

/// A download in progress that callers wait for.
#[derive(Debug, Clone)]
struct Flight {
    progress: Arc<Progress>,
    done: watch::Receiver<FlightResult>,
}

/// The base image cache of every host. See the module docs.
#[derive(Debug, Default)]
pub struct ImageCache {
    options: ImageCacheOptions,
    flights: Arc<Mutex<HashMap<FlightKey, Flight>>>,
}

/// Names of one image's volumes.
#[derive(Debug, Clone)]
struct BaseNames {
    digest: String,
    base: String,
    marker: String,
}

impl BaseNames {
    fn for_image(image_name: &str, image: &ImageConfig) -> Result<Self, Error> {
        let digest = image_digest(image);
        let base = naming::base_volume(&digest).map_err(|e| {
            Error::config(vec![ConfigProblem::new(
                format!("images.{image_name}.sha256"),
                e.to_string(),
            )])
        })?;
        Ok(Self {
            digest,
            marker: marker_volume(&base),
            base,
        })
    }
}

impl ImageCache {
    /// An empty cache (nothing in flight) with `options`.
    pub fn new(options: ImageCacheOptions) -> Self {
        Self {
            options,
            flights: Arc::default(),
        }
    }

    /// Makes sure `image` is present and complete on `host`, downloading it at most once
    /// per (host, image digest) at a time; other callers wait. `deadline` bounds only how
    /// long this caller waits, never the download itself.
    pub async fn ensure_base(
        &self,
        host: &Arc<HostPool>,
        image_name: &str,
        image: &ImageConfig,
        deadline: Instant,
    ) -> Result<BaseImage, Error> {
        let names = BaseNames::for_image(image_name, image)?;
        let flight = self.join_or_start(host, image_name, image, names);
        let mut done = flight.done.clone();
        let waited = tokio::time::timeout_at(deadline, done.wait_for(Option::is_some)).await;
        match waited {
            Err(_) => Err(Error::ImageDownloading {
                image: image_name.to_owned(),
                host: host.name().to_owned(),
                received: flight.progress.received(),
                expected: flight.progress.expected(),
                retry_in: flight.progress.retry_hint(),
            }),
            Ok(Err(_)) => Err(abnormal_end(host.name())),
            Ok(Ok(result)) => match &*result {
                Some(Ok(base)) => Ok(base.clone()),
                Some(Err(error)) => Err(Error::Shared(error.clone())),
                None => Err(abnormal_end(host.name())),
            },
        }
    }

    /// The flight of `names` on `host`: the one in progress, or a new detached one.
    fn join_or_start(
        &self,
        host: &Arc<HostPool>,
        image_name: &str,
        image: &ImageConfig,
        names: BaseNames,
    ) -> Flight {
        let key = (host.name().to_owned(), names.digest.clone());
        let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(flight) = flights.get(&key) {
            return flight.clone();
        }
        let (done_tx, done_rx) = watch::channel(None);
        let flight = Flight {
            progress: Arc::default(),
            done: done_rx,
        };
        flights.insert(key.clone(), flight.clone());
        drop(flights);
        let landing = Landing {
            flights: self.flights.clone(),
            key,
        };
        let span = tracing::info_span!(
            "image download",
            otel.name = "image download",
            image.name = image_name,
            image.volume = %names.base,
            host = host.name(),
        );
        let job = Job {
            host: host.clone(),
            pool: host.config().storage_pool.clone(),
            image: image.clone(),
            names,
            options: self.options.clone(),
            progress: flight.progress.clone(),
            deadline: Instant::now() + self.options.download_timeout,
            uploading: Arc::default(),
        };
        tokio::spawn(
            async move {
                let result = job.run().await;
                if let Err(e) = &result {
                    tracing::warn!(error = %e, "image download failed");
                }
                // Leave the map first: a caller arriving now starts afresh instead of
                // receiving this (possibly failed) result.
                drop(landing);
                done_tx.send_replace(Some(result.map_err(Arc::new)));
            }
            .instrument(span),
        );
        flight
    }

    /// Deletes the base volumes on `host` that no volume of its pool uses as backing file
    /// (and their markers, first), except those this process is downloading and those
    /// written less than `eviction_min_age` ago; also deletes markers left without their
    /// base. See [`eviction`].
    pub async fn evict_unused(
        &self,
        host: &Arc<HostPool>,
        deadline: Instant,
    ) -> Result<EvictionReport, Error> {
        let in_flight: BTreeSet<String> = self
            .flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .filter(|(h, _)| h == host.name())
            .filter_map(|(_, digest)| naming::base_volume(digest).ok())
            .collect();
        let min_age = self.options.eviction_min_age;
        eviction::evict(host, in_flight, min_age, deadline).await
    }
}

fn abnormal_end(host: &str) -> Error {
    Error::Worker {
        host: host.to_owned(),
        op: "image download",
        reason: "the download task ended without a result".into(),
    }
}

/// Removes a flight from the map when its task ends, normally or by panic.
struct Landing {
    flights: Arc<Mutex<HashMap<FlightKey, Flight>>>,
    key: FlightKey,
}

impl Drop for Landing {
    fn drop(&mut self) {
        self.flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

/// The detached work of one flight: steps 3 to 8 of the module docs.
struct Job {
    host: Arc<HostPool>,
    pool: String,
    image: ImageConfig,
    names: BaseNames,
    options: ImageCacheOptions,
    progress: Arc<Progress>,
    /// The end of `imageDownloadTimeout`.
    deadline: Instant,
    /// Locked while the upload's libvirt call runs.
    uploading: Arc<tokio::sync::Mutex<()>>,
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

    async fn run(self) -> Result<BaseImage, Error> {
        let (host, pool) = (&self.host, self.pool.as_str());
        if let Existing::Complete { path, capacity } =
            check_existing(host, pool, &self.names, self.call_deadline()).await?
        {
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
        match attempt {
            Ok((path, capacity)) => Ok(self.base(path, capacity)),
            Err(error) => {
                if created {
                    // Not under a stream still writing it: let the upload call return
                    // first (its source is cancelled, its connection cut at the
                    // deadline), within a bound.
                    let uploading = self.uploading.clone();
                    if tokio::time::timeout(UPLOAD_SETTLE, uploading.lock_owned())
                        .await
                        .is_err()
                    {
                        tracing::warn!(
                            volume = %self.names.base,
                            "the upload has not returned {UPLOAD_SETTLE:?} after its failure; deleting the volume anyway"
                        );
                    }
                    delete_half_written(host, pool, &self.names.base).await;
                }
                Err(error)
            }
        }
    }

    fn timed_out(&self) -> Error {
        Error::ImageTruncated {
            url: image_fetch::redact_url(&self.image.url),
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
    async fn download(&self, created: &mut bool) -> Result<(String, u64), Error> {
        let (host, pool, names) = (&self.host, self.pool.as_str(), &self.names);
        let image = &self.image;
        let idle = self.options.idle_timeout;
        let download = image_fetch::fetch(&image.url, image.sha256.as_deref(), idle).await?;
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
            return Err(Error::ImageFetch {
                url: image_fetch::redact_url(&image.url),
                reason: "the server sent an empty image".into(),
                permanent: true,
            });
        }
        // Held by the upload task until its libvirt call returns, even after this future
        // is dropped (timeout): `run` waits for it before deleting a failed volume.
        let uploading = self.uploading.clone().lock_owned().await;
        create_upload_target(host, pool, &names.base, length, self.call_deadline()).await?;
        *created = true;
        let upload = tokio::spawn({
            let (host, pool, volume) = (host.clone(), pool.to_owned(), names.base.clone());
            let deadline = self.deadline;
            async move {
                let _uploading = uploading;
                upload_volume(&host, &pool, &volume, source, length, deadline).await
            }
            .in_current_span()
        });
        upload
            .await
            .unwrap_or_else(|join| {
                Err(Error::Worker {
                    host: host.name().to_owned(),
                    op: "virStorageVolUpload",
                    reason: join.to_string(),
                })
            })
            .map_err(|e| take_failure().unwrap_or(e))?;
        let inspected = inspect(host, pool, &names.base, self.call_deadline()).await?;
        check_format(image, &inspected)?;
        create_marker(host, pool, &names.marker, self.call_deadline()).await?;
        Ok((inspected.path, inspected.capacity))
    }
}

struct CancelOnDrop(image_fetch::Canceller);

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
) -> Result<(std::fs::File, u64), Error> {
    let spooled = tokio::task::spawn_blocking(move || {
        let mut file = tempfile::tempfile_in(&dir).map_err(|e| {
            Error::io(
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
                Err(e) => return Err(Error::io("read the image download", e)),
            };
            file.write_all(&buf[..n])
                .map_err(|e| Error::io(format!("write a spool file in {}", dir.display()), e))?;
            length += n as u64;
        }
        file.rewind()
            .map_err(|e| Error::io("rewind the spool file", e))?;
        Ok((file, length))
    })
    .await;
    spooled.unwrap_or_else(|join| {
        Err(Error::io(
            "spool the image download",
            std::io::Error::other(join.to_string()),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_the_checksum_or_the_urls() {
        let mut image = ImageConfig {
            url: "http://127.0.0.1/i.qcow2".into(),
            sha256: Some("AB".repeat(32)),
            format: ImageFormat::Qcow2,
            firmware: Default::default(),
            guest_agent: Default::default(),
        };
        assert_eq!(image_digest(&image), "ab".repeat(32));
        image.sha256 = None;
        // printf %s http://127.0.0.1/i.qcow2 | sha256sum
        assert_eq!(
            image_digest(&image),
            hex(&Sha256::digest(b"http://127.0.0.1/i.qcow2"))
        );
        let names = BaseNames::for_image("i", &image).unwrap();
        assert_eq!(names.marker, format!("{}.complete", names.base));
        assert!(eviction::is_base(&names.base));
        assert!(!eviction::is_base(&names.marker));
    }
}
