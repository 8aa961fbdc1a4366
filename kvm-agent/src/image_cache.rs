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
//!    and then gets [`Error::ImageDownloading`] (transient, with the bytes so far), while
//!    the download goes on and a later call finds it done.
//! 3. **Check.** Base and marker both present: done (no HTTP request). A base without
//!    marker is what a killed agent leaves half-written: it is deleted and fetched again.
//!    A marker without base is deleted.
//! 4. **Fetch.** [`image_fetch::fetch`] classifies the answer (404/403 permanent, 5xx and
//!    network errors transient) and hashes the body as it passes.
//! 5. **Stage.** With a `Content-Length`, a sparse raw volume of that size is created and
//!    the body streams straight into [`upload_volume`] (a dedicated bulk connection).
//!    Without one, the body is first spooled to an unnamed file in
//!    `transport.imageSpoolDir` (libvirt needs the length before the first byte; the
//!    container's root is read-only), then uploaded from there. Memory stays bounded
//!    either way.
//! 6. **Verify.** The reader fails the read that would hand out the last bytes when the
//!    digest is wrong (permanent) or the body is short (transient), so the upload never
//!    completes with wrong content. On any failure the volume is deleted on the spot;
//!    when even that fails (or the agent is killed), step 3 deletes it next time.
//! 7. **Inspect.** A pool refresh makes libvirt probe the file: its format must be the
//!    configured one and it must not name a backing file (a guest could otherwise read a
//!    file of the hypervisor); its capacity is the virtual size, which an overlay must
//!    not undercut.
//! 8. **Mark.** The marker volume is created last.
//!
//! [`ImageCache::evict_unused`] deletes every base (marker first) that no volume in the
//! pool uses as its backing file and that is not being downloaded by this process. See
//! `docs/adr/0003-content-addressed-base-images.md` for the reasoning, and its caveat: the
//! single flight is per process, so one agent (one replica) serves a host.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::io::{Read, Seek, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::Instrument;
use virt::error::ErrorNumber;
use virt::storage_pool::StoragePool;
use virt::storage_vol::StorageVol;

use crate::config::{ImageConfig, ImageFormat, TransportConfig};
use crate::error::{ConfigProblem, Error};
use crate::image_fetch::{self, Download};
use crate::libvirt_call::{CallFailure, LibvirtOp};
use crate::naming::{self, BASE_PREFIX};
use crate::pool::HostPool;
use crate::volume_upload::upload_volume;
use crate::volume_xml::sparse_raw_volume;

/// Suffix of a base volume's completion marker.
pub const MARKER_SUFFIX: &str = ".complete";

/// Deadline of the clean-up of a failed download (deleting the half-written volume).
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(30);

/// Buffer of the spool copy; the size the upload sends, too.
const SPOOL_CHUNK: usize = 256 * 1024;

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
}

impl ImageCacheOptions {
    /// `transport.imageSpoolDir` (default: the system temp dir) and
    /// `transport.imageDownloadTimeout`.
    pub fn from_transport(transport: &TransportConfig) -> Self {
        Self {
            spool_dir: transport
                .image_spool_dir
                .clone()
                .unwrap_or_else(std::env::temp_dir),
            download_timeout: transport.image_download_timeout,
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
    received: AtomicU64,
    /// `u64::MAX` while unknown.
    expected: AtomicU64,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            received: AtomicU64::new(0),
            expected: AtomicU64::new(u64::MAX),
        }
    }
}

impl Progress {
    fn expected(&self) -> Option<u64> {
        Some(self.expected.load(Ordering::Relaxed)).filter(|e| *e != u64::MAX)
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
                received: flight.progress.received.load(Ordering::Relaxed),
                expected: flight.progress.expected(),
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
        let work = fetch_base(
            host.clone(),
            image.clone(),
            names,
            self.options.clone(),
            flight.progress.clone(),
        );
        tokio::spawn(
            async move {
                let result = work.await;
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
    /// (and their markers, first), except those this process is downloading; also
    /// deletes markers left without their base. See the module docs.
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
        let pool_name = host.config().storage_pool.clone();
        let host_name = host.name().to_owned();
        host.call(
            LibvirtOp::new("virStoragePoolListAllVolumes"),
            deadline,
            move |c| {
                let pool = c.lookup_storage_pool_by_name(&pool_name)?;
                refresh_pool(&pool)?;
                let mut listed = Vec::new();
                for vol in pool.list_all_volumes(0)? {
                    match describe(&vol) {
                        Ok(volume) => listed.push(volume),
                        // Gone since the listing: nothing of it to keep.
                        Err(e) if is(&e, ErrorNumber::NoStorageVolume) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                let plan = eviction_plan(&listed, &in_flight);
                let mut deleted = Vec::new();
                for name in plan.delete {
                    match pool
                        .lookup_storage_vol_by_name(&name)
                        .and_then(|v| v.delete(0))
                    {
                        Ok(()) => deleted.push(name),
                        Err(e) if is(&e, ErrorNumber::NoStorageVolume) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                Ok(EvictionReport {
                    host: host_name,
                    deleted,
                    kept: plan.kept,
                })
            },
        )
        .await
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

/// What [`ImageCache::evict_unused`] did on one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictionReport {
    /// The host's name.
    pub host: String,
    /// Volumes deleted (markers and bases).
    pub deleted: Vec<String>,
    /// Bases kept, each with why: the volumes backed by it, or that it is downloading.
    pub kept: BTreeMap<String, Vec<String>>,
}

impl fmt::Display for EvictionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{}: deleted {} volume(s), kept {} base(s)",
            self.host,
            self.deleted.len(),
            self.kept.len()
        )?;
        for name in &self.deleted {
            writeln!(f, "  deleted {name}")?;
        }
        for (base, users) in &self.kept {
            writeln!(f, "  kept    {base} (used by {})", users.join(", "))?;
        }
        Ok(())
    }
}

/// A volume of the pool as eviction sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct ListedVolume {
    name: String,
    path: String,
    backing_path: Option<String>,
}

#[derive(Debug, Default, PartialEq, Eq)]
struct EvictionPlan {
    /// In order: a base's marker before the base.
    delete: Vec<String>,
    kept: BTreeMap<String, Vec<String>>,
}

fn is_base(name: &str) -> bool {
    name.starts_with(BASE_PREFIX) && name.ends_with(".img")
}

fn eviction_plan(volumes: &[ListedVolume], in_flight: &BTreeSet<String>) -> EvictionPlan {
    let names: BTreeSet<&str> = volumes.iter().map(|v| v.name.as_str()).collect();
    let mut users: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for volume in volumes {
        if let Some(backing) = &volume.backing_path {
            users
                .entry(backing.as_str())
                .or_default()
                .push(volume.name.clone());
        }
    }
    let mut plan = EvictionPlan::default();
    for volume in volumes.iter().filter(|v| is_base(&v.name)) {
        let marker = marker_volume(&volume.name);
        if in_flight.contains(&volume.name) {
            plan.kept
                .insert(volume.name.clone(), vec!["a download in progress".into()]);
        } else if let Some(users) = users.get(volume.path.as_str()) {
            plan.kept.insert(volume.name.clone(), users.clone());
        } else {
            if names.contains(marker.as_str()) {
                plan.delete.push(marker);
            }
            plan.delete.push(volume.name.clone());
        }
    }
    for volume in volumes {
        if let Some(base) = volume.name.strip_suffix(MARKER_SUFFIX)
            && is_base(base)
            && !names.contains(base)
            && !in_flight.contains(base)
        {
            plan.delete.push(volume.name.clone());
        }
    }
    plan
}

/// The parts of libvirt's volume XML the cache reads.
#[derive(Debug, Deserialize)]
struct VolumeDesc {
    target: VolumeTarget,
    #[serde(rename = "backingStore", default)]
    backing_store: Option<BackingStoreDesc>,
}

#[derive(Debug, Deserialize)]
struct VolumeTarget {
    #[serde(default)]
    format: Option<FormatDesc>,
}

#[derive(Debug, Deserialize)]
struct FormatDesc {
    #[serde(rename = "@type")]
    kind: String,
}

#[derive(Debug, Deserialize)]
struct BackingStoreDesc {
    #[serde(default)]
    path: Option<String>,
}

/// The format libvirt probed and the backing file, from a volume's XML.
fn parse_volume_xml(xml: &str) -> Result<(Option<String>, Option<String>), String> {
    let desc: VolumeDesc = quick_xml::de::from_str(xml).map_err(|e| e.to_string())?;
    Ok((
        desc.target.format.map(|f| f.kind),
        desc.backing_store.and_then(|b| b.path),
    ))
}

fn describe(vol: &StorageVol) -> Result<ListedVolume, virt::error::Error> {
    let name = vol.name()?;
    let path = vol.path()?;
    let xml = vol.xml_desc(0)?;
    // An XML libvirt wrote that does not parse: keep everything (no backing known means
    // "unused" only for bases, so treat it as using nothing but log it).
    let backing_path = match parse_volume_xml(&xml) {
        Ok((_, backing)) => backing,
        Err(e) => {
            tracing::warn!(volume = %name, error = %e, "cannot parse volume XML");
            None
        }
    };
    Ok(ListedVolume {
        name,
        path,
        backing_path,
    })
}

fn is(error: &virt::error::Error, code: ErrorNumber) -> bool {
    error.code().is_any(vec![code])
}

/// `virStoragePoolRefresh`, retried while libvirt refuses because another volume of the
/// pool is being built.
fn refresh_pool(pool: &StoragePool) -> Result<(), virt::error::Error> {
    let mut attempts = 0;
    loop {
        match pool.refresh(0) {
            Err(e) if attempts < 50 && e.message().contains("asynchronous jobs") => {
                attempts += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            other => return other,
        }
    }
}

fn lookup_volume(pool: &StoragePool, name: &str) -> Result<Option<StorageVol>, CallFailure> {
    match pool.lookup_storage_vol_by_name(name) {
        Ok(vol) => Ok(Some(vol)),
        Err(e) if is(&e, ErrorNumber::NoStorageVolume) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// What step 3 found.
enum Existing {
    Complete { path: String, capacity: u64 },
    Absent,
}

/// The detached work of one flight: steps 3 to 8 of the module docs.
async fn fetch_base(
    host: Arc<HostPool>,
    image: ImageConfig,
    names: BaseNames,
    options: ImageCacheOptions,
    progress: Arc<Progress>,
) -> Result<BaseImage, Error> {
    let deadline = Instant::now() + options.download_timeout;
    let pool = host.config().storage_pool.clone();
    let base = |path: String, capacity_bytes: u64| BaseImage {
        volume: names.base.clone(),
        path,
        format: image.format,
        capacity_bytes,
    };
    if let Existing::Complete { path, capacity } =
        check_existing(&host, &pool, &names, deadline).await?
    {
        return Ok(base(path, capacity));
    }
    let mut created = false;
    let attempt = tokio::time::timeout_at(
        deadline,
        download_and_upload(
            &host,
            &pool,
            &image,
            &names,
            &options,
            &progress,
            &mut created,
            deadline,
        ),
    )
    .await
    .unwrap_or_else(|_| {
        Err(Error::ImageTruncated {
            url: image.url.clone(),
            received: progress.received.load(Ordering::Relaxed),
            expected: progress.expected(),
            reason: format!(
                "transport.imageDownloadTimeout ({}) passed",
                humantime::format_duration(options.download_timeout)
            ),
        })
    });
    match attempt {
        Ok((path, capacity)) => Ok(base(path, capacity)),
        Err(error) => {
            if created {
                delete_half_written(&host, &pool, &names.base).await;
            }
            Err(error)
        }
    }
}

/// Step 3: a complete base, or nothing (after deleting a half-written base or a stray
/// marker).
async fn check_existing(
    host: &Arc<HostPool>,
    pool: &str,
    names: &BaseNames,
    deadline: Instant,
) -> Result<Existing, Error> {
    let (pool, names) = (pool.to_owned(), names.clone());
    let op = LibvirtOp::new("virStorageVolLookupByName").volume(names.base.clone());
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool)?;
        let base = lookup_volume(&pool, &names.base)?;
        let marker = lookup_volume(&pool, &names.marker)?;
        match (base, marker) {
            (Some(base), Some(_)) => Ok(Existing::Complete {
                path: base.path()?,
                capacity: base.info()?.capacity,
            }),
            (Some(base), None) => {
                tracing::warn!(
                    volume = %names.base,
                    "deleting a base volume without completion marker (an earlier download was interrupted)"
                );
                base.delete(0)?;
                Ok(Existing::Absent)
            }
            (None, Some(marker)) => {
                marker.delete(0)?;
                Ok(Existing::Absent)
            }
            (None, None) => Ok(Existing::Absent),
        }
    })
    .await
}

/// Steps 4 to 8; sets `created` once the base volume exists. Returns path and capacity.
#[allow(clippy::too_many_arguments)]
async fn download_and_upload(
    host: &Arc<HostPool>,
    pool: &str,
    image: &ImageConfig,
    names: &BaseNames,
    options: &ImageCacheOptions,
    progress: &Arc<Progress>,
    created: &mut bool,
    deadline: Instant,
) -> Result<(String, u64), Error> {
    let download = image_fetch::fetch(&image.url, image.sha256.as_deref()).await?;
    // Dropped when this future is (deadline): a read blocked on a stalled server returns.
    let _cancel = CancelOnDrop(download.canceller());
    let failure = download.failure();
    let take_failure = || failure.lock().unwrap_or_else(|p| p.into_inner()).take();
    let (source, length): (Box<dyn Read + Send>, u64) = match download.length() {
        Some(length) => {
            progress.expected.store(length, Ordering::Relaxed);
            let counted = Counted {
                inner: download,
                progress: progress.clone(),
            };
            (Box::new(counted), length)
        }
        None => {
            let spooled = spool(download, options.spool_dir.clone(), progress.clone()).await;
            let (file, length) = spooled.map_err(|e| take_failure().unwrap_or(e))?;
            progress.expected.store(length, Ordering::Relaxed);
            (Box::new(file), length)
        }
    };
    if length == 0 {
        return Err(Error::ImageFetch {
            url: image.url.clone(),
            reason: "the server sent an empty image".into(),
            permanent: true,
        });
    }
    create_upload_target(host, pool, &names.base, length, deadline).await?;
    *created = true;
    upload_volume(host, pool, &names.base, source, length, deadline)
        .await
        .map_err(|e| take_failure().unwrap_or(e))?;
    let inspected = inspect(host, pool, &names.base, deadline).await?;
    check_format(image, &inspected)?;
    create_marker(host, pool, &names.marker, deadline).await?;
    Ok((inspected.path, inspected.capacity))
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

async fn create_upload_target(
    host: &Arc<HostPool>,
    pool: &str,
    volume: &str,
    length: u64,
    deadline: Instant,
) -> Result<(), Error> {
    let xml = sparse_raw_volume(volume, length).map_err(|e| {
        Error::io(
            format!("volume XML for {volume}"),
            std::io::Error::other(e.to_string()),
        )
    })?;
    let pool = pool.to_owned();
    let op = LibvirtOp::new("virStorageVolCreateXML")
        .volume(volume)
        .bytes(length);
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool)?;
        StorageVol::create_xml(&pool, &xml, 0)?;
        Ok(())
    })
    .await
}

async fn create_marker(
    host: &Arc<HostPool>,
    pool: &str,
    marker: &str,
    deadline: Instant,
) -> Result<(), Error> {
    let xml = sparse_raw_volume(marker, 0).map_err(|e| {
        Error::io(
            format!("volume XML for {marker}"),
            std::io::Error::other(e.to_string()),
        )
    })?;
    let pool = pool.to_owned();
    let op = LibvirtOp::new("virStorageVolCreateXML").volume(marker);
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool)?;
        match StorageVol::create_xml(&pool, &xml, 0) {
            Ok(_) => Ok(()),
            Err(e) if is(&e, ErrorNumber::StorageVolExist) => Ok(()),
            Err(e) => Err(e.into()),
        }
    })
    .await
}

/// What libvirt's probe says about an uploaded base.
#[derive(Debug)]
struct Inspected {
    path: String,
    capacity: u64,
    format: Option<String>,
    backing_path: Option<String>,
}

/// Step 7: refresh the pool so libvirt probes the file, then read the volume back.
async fn inspect(
    host: &Arc<HostPool>,
    pool: &str,
    volume: &str,
    deadline: Instant,
) -> Result<Inspected, Error> {
    let (pool, volume) = (pool.to_owned(), volume.to_owned());
    let op = LibvirtOp::new("virStoragePoolRefresh").volume(volume.clone());
    let host_name = host.name().to_owned();
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool)?;
        refresh_pool(&pool)?;
        let vol = pool.lookup_storage_vol_by_name(&volume)?;
        let xml = vol.xml_desc(0)?;
        let (format, backing_path) = parse_volume_xml(&xml).map_err(|e| {
            CallFailure::Agent(Error::io(
                format!("host {host_name}: parse the XML of volume {volume}"),
                std::io::Error::other(e),
            ))
        })?;
        Ok(Inspected {
            path: vol.path()?,
            capacity: vol.info()?.capacity,
            format,
            backing_path,
        })
    })
    .await
}

fn check_format(image: &ImageConfig, inspected: &Inspected) -> Result<(), Error> {
    let found = inspected.format.as_deref().unwrap_or("unknown");
    let expected_ok = match image.format {
        ImageFormat::Qcow2 => found == "qcow2",
        // A raw disk may look like an ISO or carry no recognisable header; any format
        // with a header of its own would be misread as raw bytes.
        ImageFormat::Raw => matches!(found, "raw" | "iso" | "unknown"),
    };
    let configured = match image.format {
        ImageFormat::Qcow2 => "qcow2",
        ImageFormat::Raw => "raw",
    };
    if !expected_ok {
        return Err(Error::ImageFormat {
            url: image.url.clone(),
            problem: format!(
                "libvirt probed the file as {found}, the configuration says {configured}"
            ),
        });
    }
    if let Some(backing) = &inspected.backing_path {
        return Err(Error::ImageFormat {
            url: image.url.clone(),
            problem: format!(
                "the image names a backing file ({backing}); a base image must be self-contained"
            ),
        });
    }
    Ok(())
}

/// Deletes a base whose download failed; on failure the next attempt deletes it (step 3).
async fn delete_half_written(host: &Arc<HostPool>, pool: &str, volume: &str) {
    let (pool_name, name) = (pool.to_owned(), volume.to_owned());
    let op = LibvirtOp::new("virStorageVolDelete").volume(volume);
    let deleted = host
        .call(op, Instant::now() + CLEANUP_TIMEOUT, move |c| {
            let pool = c.lookup_storage_pool_by_name(&pool_name)?;
            if let Some(vol) = lookup_volume(&pool, &name)? {
                vol.delete(0)?;
            }
            Ok(())
        })
        .await;
    if let Err(e) = deleted {
        tracing::warn!(volume, error = %e, "cannot delete a half-written base volume; the next attempt will");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn volume(name: &str, path: &str, backing: Option<&str>) -> ListedVolume {
        ListedVolume {
            name: name.into(),
            path: path.into(),
            backing_path: backing.map(str::to_owned),
        }
    }

    #[test]
    fn digests_are_the_checksum_or_the_urls() {
        let mut image = ImageConfig {
            url: "http://127.0.0.1/i.qcow2".into(),
            sha256: Some("AB".repeat(32)),
            format: ImageFormat::Qcow2,
            firmware: Default::default(),
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
        assert!(is_base(&names.base));
        assert!(!is_base(&names.marker));
    }

    #[test]
    fn eviction_keeps_used_and_downloading_bases_and_deletes_markers_first() {
        let (a, b, c) = (
            naming::base_volume(&"aa".repeat(32)).unwrap(),
            naming::base_volume(&"bb".repeat(32)).unwrap(),
            naming::base_volume(&"cc".repeat(32)).unwrap(),
        );
        let stray = marker_volume(&naming::base_volume(&"dd".repeat(32)).unwrap());
        let volumes = vec![
            volume(&a, "/p/a", None),
            volume(&marker_volume(&a), "/p/am", None),
            volume(&b, "/p/b", None),
            volume(&marker_volume(&b), "/p/bm", None),
            volume(&c, "/p/c", None),
            volume("egressproxy-k.root.qcow2", "/p/o", Some("/p/a")),
            volume(&stray, "/p/dm", None),
            volume("someone-elses.qcow2", "/p/x", None),
        ];
        let plan = eviction_plan(&volumes, &[c.clone()].into());
        assert_eq!(plan.delete, [marker_volume(&b), b.clone(), stray]);
        assert_eq!(plan.kept[&a], ["egressproxy-k.root.qcow2"]);
        assert!(plan.kept.contains_key(&c));
    }

    #[test]
    fn volume_xml_yields_format_and_backing_file() {
        let xml = "<volume type='file'><name>o</name><capacity unit='bytes'>1</capacity>\
                   <target><path>/p/o</path><format type='qcow2'/></target>\
                   <backingStore><path>/p/a</path><format type='qcow2'/></backingStore></volume>";
        assert_eq!(
            parse_volume_xml(xml).unwrap(),
            (Some("qcow2".into()), Some("/p/a".into()))
        );
        let xml = "<volume type='file'><name>a</name><target><path>/p/a</path>\
                   <format type='raw'/></target></volume>";
        assert_eq!(parse_volume_xml(xml).unwrap(), (Some("raw".into()), None));
    }

    #[test]
    fn a_format_other_than_configured_or_a_backing_file_is_refused() {
        let image = |format| ImageConfig {
            url: "u".into(),
            sha256: None,
            format,
            firmware: Default::default(),
        };
        let inspected = |format: &str, backing: Option<&str>| Inspected {
            path: "/p".into(),
            capacity: 1,
            format: Some(format.into()),
            backing_path: backing.map(str::to_owned),
        };
        check_format(&image(ImageFormat::Qcow2), &inspected("qcow2", None)).unwrap();
        check_format(&image(ImageFormat::Raw), &inspected("raw", None)).unwrap();
        for (format, found, backing) in [
            (ImageFormat::Qcow2, "raw", None),
            (ImageFormat::Raw, "qcow2", None),
            (ImageFormat::Qcow2, "qcow2", Some("/etc/shadow")),
        ] {
            let err = check_format(&image(format), &inspected(found, backing)).unwrap_err();
            assert_eq!(err.class(), crate::ErrorClass::Permanent, "{err}");
        }
    }
}
