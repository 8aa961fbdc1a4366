//! An instance's volumes, as blocking functions of one libvirt connection, each safe to
//! repeat after any earlier attempt stopped half-way.
//!
//! They run inside [`crate::transport::pool::HostPool::call`] (off the runtime, traced, bounded by
//! the caller's deadline) and return plain data, never libvirt objects. Guarantees:
//! - [`ensure_overlay`] creates the qcow2 overlay with one `virStorageVolCreateXML`
//!   (libvirt writes it whole or not at all), or reuses the one an earlier attempt made
//!   when its backing file and size are the wanted ones (else deletes and remakes it);
//!   a concurrent creator's volume counts as found;
//! - [`recreate_seed_volume`] always deletes a seed left by an earlier attempt (it may be
//!   truncated by a cancelled Create) and creates an empty one of the new seed's size.

use std::path::PathBuf;

use virt::connect::Connect;
use virt::error::ErrorNumber;
use virt::storage_pool::StoragePool;
use virt::storage_vol::StorageVol;

use crate::config::ImageFormat;
use crate::libvirt::error::LibvirtError;
use crate::libvirt::xml::XmlError;
use crate::libvirt::xml::volume::{VolumeFacts, overlay_volume, raw_volume};
use crate::transport::call::CallFailure;

/// The storage pool `name` (libvirt refuses volume calls on an inactive one).
fn active_pool(conn: &Connect, name: &str) -> Result<StoragePool, CallFailure<LibvirtError>> {
    let pool = conn.lookup_storage_pool_by_name(name)?;
    Ok(pool)
}

/// The volume `name` of `pool`, or `None` if there is none.
pub(crate) fn lookup_volume<E>(
    pool: &StoragePool,
    name: &str,
) -> Result<Option<StorageVol>, CallFailure<E>> {
    match pool.lookup_storage_vol_by_name(name) {
        Ok(vol) => Ok(Some(vol)),
        Err(e) if e.code().is(ErrorNumber::NoStorageVolume) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn xml_failure(e: XmlError) -> CallFailure<LibvirtError> {
    CallFailure::Agent(LibvirtError::xml("volume", e))
}

/// The overlay as found or made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Overlay {
    /// Its path on the hypervisor.
    pub path: PathBuf,
    /// Whether this call created it (false: an earlier attempt's was reused).
    pub created: bool,
    /// Whether an earlier attempt's overlay was deleted first because it was made for
    /// another base or size (the spec changed between the attempts).
    pub replaced: bool,
}

/// The qcow2 overlay `name` of `capacity_bytes` on the base file `base_path` in pool
/// `pool`: reused when present and made for this base and size, else created in one call.
///
/// An overlay an earlier attempt made for another base or size (the request's image or
/// machine type changed after a Create that failed before its domain was defined) is
/// deleted and made again. The caller holds the key's lock and has checked that no
/// domain exists for the key, so nothing uses that overlay.
pub(crate) fn ensure_overlay(
    conn: &Connect,
    pool: &str,
    name: &str,
    capacity_bytes: u64,
    base_path: &str,
    base_format: ImageFormat,
) -> Result<Overlay, CallFailure<LibvirtError>> {
    let pool = active_pool(conn, pool)?;
    let mut replaced = false;
    if let Some(vol) = lookup_volume(&pool, name)? {
        let facts = VolumeFacts::parse(&vol.xml_desc(0)?).map_err(xml_failure)?;
        if facts.is_overlay_of(capacity_bytes, base_path, base_format) {
            return Ok(Overlay {
                path: vol.path()?.into(),
                created: false,
                replaced: false,
            });
        }
        match vol.delete(0) {
            Ok(()) => {}
            Err(e) if e.code().is(ErrorNumber::NoStorageVolume) => {}
            Err(e) => return Err(e.into()),
        }
        replaced = true;
    }
    let xml = overlay_volume(name, capacity_bytes, base_path.as_ref(), base_format)
        .map_err(xml_failure)?;
    match StorageVol::create_xml(&pool, &xml, 0) {
        Ok(vol) => Ok(Overlay {
            path: vol.path()?.into(),
            created: true,
            replaced,
        }),
        Err(e) if e.code().is(ErrorNumber::StorageVolExist) => {
            let vol = pool.lookup_storage_vol_by_name(name)?;
            Ok(Overlay {
                path: vol.path()?.into(),
                created: false,
                replaced,
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// Deletes any seed volume `name` and creates an empty raw one of `length` bytes;
/// returns its path.
pub(crate) fn recreate_seed_volume(
    conn: &Connect,
    pool: &str,
    name: &str,
    length: u64,
) -> Result<PathBuf, CallFailure<LibvirtError>> {
    let pool = active_pool(conn, pool)?;
    if let Some(old) = lookup_volume(&pool, name)? {
        match old.delete(0) {
            Ok(()) => {}
            Err(e) if e.code().is(ErrorNumber::NoStorageVolume) => {}
            Err(e) => return Err(e.into()),
        }
    }
    let xml = raw_volume(name, length).map_err(xml_failure)?;
    let vol = StorageVol::create_xml(&pool, &xml, 0)?;
    Ok(vol.path()?.into())
}
