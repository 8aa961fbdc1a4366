//! What the image cache holds on a host, for `/metrics`: its complete bases (a base
//! with its marker; a base without one is half-written or being evicted) and the bytes
//! they take in the storage pool.
//!
//! One bounded call lists the pool's volumes and reads each complete base's
//! allocation. The pool is not refreshed first: a refresh is refused while a volume of
//! the pool is being uploaded, and libvirt reads a volume's allocation afresh on each
//! `virStorageVolGetInfo` anyway.

use std::collections::BTreeSet;
use std::sync::Arc;

use tokio::time::Instant;
use virt::error::ErrorNumber;

use super::base_volume::marker_volume;
use super::eviction::is_base;
use super::host_volumes::is;
use crate::images::error::ImageError;
use crate::transport::call::LibvirtOp;
use crate::transport::pool::HostPool;

/// The complete bases on one host.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUsage {
    /// How many complete bases the pool holds.
    pub images: u64,
    /// The bytes they take (their allocation, not their virtual size).
    pub bytes: u64,
}

/// Measures what the cache holds on `host` by `deadline`.
pub(super) async fn measure(
    host: &Arc<HostPool>,
    deadline: Instant,
) -> Result<CacheUsage, ImageError> {
    let pool_name = host.config().storage_pool.clone();
    let op = LibvirtOp::new("virStoragePoolListAllVolumes");
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool_name)?;
        let volumes = pool.list_all_volumes(0)?;
        let names: BTreeSet<String> = volumes.iter().filter_map(|v| v.name().ok()).collect();
        let mut usage = CacheUsage::default();
        for volume in &volumes {
            let Ok(name) = volume.name() else {
                continue;
            };
            if !is_base(&name) || !names.contains(&marker_volume(&name)) {
                continue;
            }
            match volume.info() {
                Ok(info) => {
                    usage.images += 1;
                    usage.bytes = usage.bytes.saturating_add(info.allocation);
                }
                // Evicted since the listing: no longer held.
                Err(e) if is(&e, ErrorNumber::NoStorageVolume) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(usage)
    })
    .await
}
