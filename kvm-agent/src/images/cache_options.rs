//! The settings of the base image cache, from the transport configuration.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::TransportConfig;

/// Settings of the image cache ([`super::cache::ImageCache`]).
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
