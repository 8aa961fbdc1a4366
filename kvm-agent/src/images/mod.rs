//! Base images: downloaded once per host and image, verified, named by content.
//!
//! - [`error`]: the layer's error type, [`ImageError`], which holds the libvirt layer's.
//! - [`cache`]: the per-host cache of base volumes, one download per base at a time.
//! - `base_volume`: a base's volumes named by content (digest, base, marker) and the
//!   verified base; `cache_options`: the cache's settings. Shared by the modules below
//!   `cache`, so none of them names `cache`.
//! - [`fetch`]: an image's HTTP(S) or `file://` body, streamed through SHA-256.
//! - `http`: the HTTP(S) side of a fetch (reqwest), its answer classified.
//! - `download`: one download of a base, the detached work the cache waits on.
//! - `host_volumes`: the cache's libvirt steps (look up, create, inspect, delete).
//! - `eviction`: deleting base volumes no domain uses any more.
//! - `usage`: what the cache holds on a host (complete bases and their bytes).

mod base_volume;
pub mod cache;
mod cache_options;
mod download;
pub mod error;
pub(crate) mod eviction;
pub mod fetch;
mod host_volumes;
mod http;
mod usage;

pub use error::ImageError;
