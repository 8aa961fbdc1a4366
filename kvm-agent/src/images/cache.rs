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
//!    and then gets [`ImageError::Downloading`] (transient, with the bytes so far and a
//!    retry hint from the rate so far), while the download goes on and a later call finds
//!    it done. Each cheap libvirt call of the download has `transport.defaultCallTimeout`.
//! 3. **Check.** Base and marker both present: done (no HTTP request). A base without
//!    marker is what a killed agent leaves half-written: it is deleted and fetched again.
//!    A marker without base is deleted.
//! 4. **Fetch.** [`fetch::fetch`](super::fetch::fetch) classifies the answer (404/403 permanent, 5xx and
//!    network errors transient) and hashes the body as it passes. A server silent for
//!    [`DEFAULT_IDLE_TIMEOUT`] fails the download (transient) long before
//!    `imageDownloadTimeout`.
//! 5. **Stage.** With a `Content-Length`, a sparse raw volume of that size is created and
//!    the body streams straight into [`upload_volume`](crate::transport::bulk::upload_volume) (a dedicated bulk connection).
//!    Without one, the body is first spooled to an unnamed file in
//!    `transport.imageSpoolDir` (libvirt needs the length before the first byte; the
//!    container's root is read-only), then uploaded from there. Memory stays bounded
//!    either way. Create and upload run in one task that outlives a timed-out download,
//!    and the create is bounded by `defaultCallTimeout` alone: cut at the download's
//!    deadline, libvirtd could still finish it after the cleanup below had found
//!    nothing to delete.
//! 6. **Verify.** The reader fails the read that would hand out the last bytes when the
//!    digest is wrong (permanent) or the body is short (transient), so the upload never
//!    completes with wrong content. On any failure the download is cancelled, the create
//!    and upload calls are awaited (at most `UPLOAD_SETTLE` or `defaultCallTimeout`,
//!    whichever is longer, so the volume is neither deleted before its create returns
//!    nor under a stream still writing it), and the volume is deleted on the spot
//!    (retried while libvirt reports it in use; libvirt 11 does not on a dir pool, a test
//!    shows); when even that fails (a create cut at its own timeout that libvirtd still
//!    finishes, or an agent killed), step 3 deletes it next time.
//! 7. **Inspect.** A pool refresh makes libvirt probe the file: its format must be the
//!    configured one and it must not name a backing file (a guest could otherwise read a
//!    file of the hypervisor); its capacity is the virtual size, which an overlay must
//!    not undercut.
//! 8. **Mark.** The marker volume is created last.
//!
//! The libvirt calls of each step are in `host_volumes`. [`ImageCache::evict_unused`]
//! (`eviction`) deletes every base (marker first) that no volume in the pool uses as its
//! backing file, that is not being downloaded by this process and that is older than
//! [`DEFAULT_EVICTION_MIN_AGE`] (by default). [`ImageCache::usage`] (`usage`) counts the
//! complete bases and the bytes they take, for `/metrics`. See
//! `docs/adr/0003-content-addressed-base-images.md` for the reasoning, and its caveat: the
//! single flight is per process, so one agent (one replica) serves a host.

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::time::Instant;
use tracing::Instrument;

use super::base_volume::BaseNames;
pub use super::base_volume::{BaseImage, marker_volume};
pub use super::cache_options::{DEFAULT_EVICTION_MIN_AGE, DEFAULT_IDLE_TIMEOUT, ImageCacheOptions};
use super::download::{Job, Progress};
pub use super::eviction::{EvictionReport, KeptBecause};
pub use super::usage::CacheUsage;
use crate::config::ImageConfig;
use crate::images::error::ImageError;
use crate::libvirt::naming;
use crate::single_flight::{Flight, SingleFlight, Waited};
use crate::transport::error::TransportError;
use crate::transport::pool::HostPool;

/// (host name, digest).
type FlightKey = (String, String);

/// The downloads in progress: each shows its progress, and ends in the base or an error
/// that every waiting caller shares.
type Downloads = SingleFlight<FlightKey, Arc<Progress>, Result<BaseImage, Arc<ImageError>>>;

/// The base image cache of every host. See the module docs.
#[derive(Debug, Default)]
pub struct ImageCache {
    options: ImageCacheOptions,
    flights: Downloads,
}

impl ImageCache {
    /// An empty cache (nothing in flight) with `options`.
    pub fn new(options: ImageCacheOptions) -> Self {
        Self {
            options,
            flights: Downloads::default(),
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
    ) -> Result<BaseImage, ImageError> {
        let names = BaseNames::for_image(image_name, image)?;
        let flight = self.join_or_start(host, image_name, image, names);
        match flight.wait(deadline).await {
            Waited::DeadlinePassed => Err(ImageError::Downloading {
                image: image_name.to_owned(),
                host: host.name().to_owned(),
                received: flight.meta.received(),
                expected: flight.meta.expected(),
                retry_in: flight.meta.retry_hint(),
            }),
            Waited::Lost => Err(abnormal_end(host.name())),
            Waited::Done(Ok(base)) => Ok(base),
            Waited::Done(Err(error)) => Err(ImageError::Shared(error)),
        }
    }

    /// The flight of `names` on `host`: the one in progress, or a new detached one.
    fn join_or_start(
        &self,
        host: &Arc<HostPool>,
        image_name: &str,
        image: &ImageConfig,
        names: BaseNames,
    ) -> Flight<Arc<Progress>, Result<BaseImage, Arc<ImageError>>> {
        let key = (host.name().to_owned(), names.digest.clone());
        self.flights.join_or_start(key, || {
            let progress = Arc::<Progress>::default();
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
                image_name: image_name.to_owned(),
                image: image.clone(),
                names,
                options: self.options.clone(),
                progress: progress.clone(),
                deadline: Instant::now() + self.options.download_timeout,
                uploading: Arc::default(),
            };
            let work = async move {
                let result = job.run().await;
                if let Err(e) = &result {
                    tracing::warn!(error = %e, "image download failed");
                }
                result.map_err(Arc::new)
            }
            .instrument(span);
            (progress, work)
        })
    }

    /// Deletes the base volumes on `host` that no volume of its pool uses as backing file
    /// (and their markers, first), except those this process is downloading and those
    /// written less than `eviction_min_age` ago; also deletes markers left without their
    /// base. See `images::eviction`.
    pub async fn evict_unused(
        &self,
        host: &Arc<HostPool>,
        deadline: Instant,
    ) -> Result<EvictionReport, ImageError> {
        let in_flight: BTreeSet<String> = self
            .flights
            .keys()
            .into_iter()
            .filter(|(h, _)| h == host.name())
            .filter_map(|(_, digest)| naming::base_volume(&digest).ok())
            .collect();
        let min_age = self.options.eviction_min_age;
        super::eviction::evict(host, in_flight, min_age, deadline).await
    }

    /// How many complete bases `host` holds and the bytes they take. See
    /// `images::usage`.
    pub async fn usage(
        &self,
        host: &Arc<HostPool>,
        deadline: Instant,
    ) -> Result<CacheUsage, ImageError> {
        super::usage::measure(host, deadline).await
    }
}

fn abnormal_end(host: &str) -> ImageError {
    ImageError::from(TransportError::Worker {
        host: host.to_owned(),
        op: "image download",
        reason: "the download task ended without a result".into(),
    })
}
