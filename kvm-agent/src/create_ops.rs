//! What Create does on a hypervisor, as blocking functions of one libvirt connection,
//! each safe to repeat after any earlier attempt stopped half-way.
//!
//! They run inside [`crate::pool::HostPool::call`] (off the runtime, traced, bounded by
//! the caller's deadline) and return plain data, never libvirt objects. Guarantees:
//! - [`find_domain`] tells an instance's domain apart from a foreign one with its name;
//! - [`ensure_overlay`] creates the qcow2 overlay with one `virStorageVolCreateXML`
//!   (libvirt writes it whole or not at all), or reuses the one an earlier attempt made
//!   when its backing file and size are the wanted ones (else deletes and remakes it);
//!   a concurrent creator's volume counts as found;
//! - [`recreate_seed_volume`] always deletes a seed left by an earlier attempt (it may be
//!   truncated, lesson 6) and creates an empty one of the new seed's size;
//! - [`define_domain`] and [`start_domain`] accept a domain that is already defined or
//!   already running.

use std::path::PathBuf;

use virt::connect::Connect;
use virt::error::ErrorNumber;
use virt::storage_pool::StoragePool;
use virt::storage_vol::StorageVol;
use virt::sys;

use crate::config::ImageFormat;
use crate::domain_xml::XmlError;
use crate::error::Error;
use crate::instance_ops::{lookup_domain, read_metadata};
use crate::libvirt_call::CallFailure;
use crate::volume_xml::{overlay_volume, raw_volume};

/// What holds an instance's domain name on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FoundDomain {
    /// No domain by that name.
    Nothing,
    /// The agent's domain, created from the spec with this digest.
    Ours {
        /// `specSha256` from its metadata.
        spec_sha256: String,
        /// Whether it runs (running, blocked or paused by libvirt's start).
        running: bool,
    },
    /// A domain by that name without the agent's metadata.
    Foreign,
}

/// Looks up the domain `name` and reads its metadata once.
pub fn find_domain(conn: &Connect, name: &str) -> Result<FoundDomain, CallFailure> {
    let Some(domain) = lookup_domain(conn, name)? else {
        return Ok(FoundDomain::Nothing);
    };
    let Some(metadata) = read_metadata(&domain)? else {
        return Ok(FoundDomain::Foreign);
    };
    Ok(FoundDomain::Ours {
        spec_sha256: metadata.spec_sha256,
        running: domain.is_active()?,
    })
}

/// Starts the domain `name` unless it already runs.
pub fn start_domain(conn: &Connect, name: &str) -> Result<(), CallFailure> {
    let domain = conn.lookup_domain_by_name(name)?;
    if domain.is_active()? {
        return Ok(());
    }
    match domain.create() {
        Ok(()) => Ok(()),
        // Started by a concurrent caller between the check and the start.
        Err(e) if e.code().is(ErrorNumber::OperationInvalid) && domain.is_active()? => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Defines (or redefines, after an interrupted attempt) the domain from `xml`.
pub fn define_domain(conn: &Connect, xml: &str) -> Result<(), CallFailure> {
    conn.define_domain_xml(xml)?;
    Ok(())
}

/// The storage pool `name` (libvirt refuses volume calls on an inactive one).
fn active_pool(conn: &Connect, name: &str) -> Result<StoragePool, CallFailure> {
    let pool = conn.lookup_storage_pool_by_name(name)?;
    Ok(pool)
}

fn lookup_volume(pool: &StoragePool, name: &str) -> Result<Option<StorageVol>, CallFailure> {
    match pool.lookup_storage_vol_by_name(name) {
        Ok(vol) => Ok(Some(vol)),
        Err(e) if e.code().is(ErrorNumber::NoStorageVolume) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn xml_failure(e: XmlError) -> CallFailure {
    CallFailure::Agent(Error::io(
        e.to_string(),
        std::io::Error::from(std::io::ErrorKind::InvalidData),
    ))
}

/// The overlay as found or made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overlay {
    /// Its path on the hypervisor.
    pub path: PathBuf,
    /// Whether this call created it (false: an earlier attempt's was reused).
    pub created: bool,
    /// Whether an earlier attempt's overlay was deleted first because it was made for
    /// another base or size (the spec changed between the attempts).
    pub replaced: bool,
}

/// What an existing overlay volume's XML says about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayFacts {
    /// Virtual size in bytes.
    pub capacity_bytes: u64,
    /// The backing file's path, if it has one.
    pub backing_path: Option<String>,
    /// The backing file's format, if libvirt reports it.
    pub backing_format: Option<String>,
}

impl OverlayFacts {
    /// Parses the parts of a volume's XML (`virStorageVolGetXMLDesc`) that matter here.
    pub fn parse(xml: &str) -> Result<Self, XmlError> {
        #[derive(serde::Deserialize)]
        struct Volume {
            capacity: Capacity,
            #[serde(rename = "backingStore")]
            backing_store: Option<BackingStore>,
        }
        #[derive(serde::Deserialize)]
        struct Capacity {
            #[serde(rename = "@unit")]
            unit: Option<String>,
            #[serde(rename = "$text")]
            value: u64,
        }
        #[derive(serde::Deserialize)]
        struct BackingStore {
            path: Option<String>,
            format: Option<Format>,
        }
        #[derive(serde::Deserialize)]
        struct Format {
            #[serde(rename = "@type")]
            kind: String,
        }
        let volume: Volume = quick_xml::de::from_str(xml).map_err(|source| XmlError::Parse {
            what: "volume XML",
            source,
        })?;
        // libvirt reports bytes; any other unit is scaled as libvirt's own parser would.
        let scale: u64 = match volume.capacity.unit.as_deref().unwrap_or("bytes") {
            "b" | "bytes" => 1,
            "KB" => 1_000,
            "k" | "KiB" => 1 << 10,
            "MB" => 1_000_000,
            "M" | "MiB" => 1 << 20,
            "GB" => 1_000_000_000,
            "G" | "GiB" => 1 << 30,
            "TB" => 1_000_000_000_000,
            "T" | "TiB" => 1 << 40,
            _ => 1,
        };
        let backing = volume.backing_store;
        Ok(Self {
            capacity_bytes: volume.capacity.value.saturating_mul(scale),
            backing_path: backing
                .as_ref()
                .and_then(|b| b.path.clone())
                .filter(|p| !p.is_empty()),
            backing_format: backing.and_then(|b| b.format).map(|f| f.kind),
        })
    }

    /// Whether this is the overlay of `capacity_bytes` on `base_path` in `base_format`.
    pub fn matches(&self, capacity_bytes: u64, base_path: &str, base_format: ImageFormat) -> bool {
        let format = match base_format {
            ImageFormat::Qcow2 => "qcow2",
            ImageFormat::Raw => "raw",
        };
        // qemu-img rounds a size up to whole 512-byte sectors.
        (self.capacity_bytes == capacity_bytes
            || self.capacity_bytes == capacity_bytes.next_multiple_of(512))
            && self.backing_path.as_deref() == Some(base_path)
            && self.backing_format.as_deref().is_none_or(|f| f == format)
    }
}

/// The qcow2 overlay `name` of `capacity_bytes` on the base file `base_path` in pool
/// `pool`: reused when present and made for this base and size, else created in one call.
///
/// An overlay an earlier attempt made for another base or size (the request's image or
/// machine type changed after a Create that failed before its domain was defined) is
/// deleted and made again. The caller holds the key's lock and has checked that no
/// domain exists for the key, so nothing uses that overlay.
pub fn ensure_overlay(
    conn: &Connect,
    pool: &str,
    name: &str,
    capacity_bytes: u64,
    base_path: &str,
    base_format: ImageFormat,
) -> Result<Overlay, CallFailure> {
    let pool = active_pool(conn, pool)?;
    let mut replaced = false;
    if let Some(vol) = lookup_volume(&pool, name)? {
        let facts = OverlayFacts::parse(&vol.xml_desc(0)?).map_err(xml_failure)?;
        if facts.matches(capacity_bytes, base_path, base_format) {
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
pub fn recreate_seed_volume(
    conn: &Connect,
    pool: &str,
    name: &str,
    length: u64,
) -> Result<PathBuf, CallFailure> {
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

/// libvirt's state of the domain `name` (`virDomainState`), for tests and logs.
pub fn domain_state(conn: &Connect, name: &str) -> Result<sys::virDomainState, CallFailure> {
    Ok(conn.lookup_domain_by_name(name)?.state()?.0.to_raw())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_facts_parse_libvirt_volume_xml() {
        let xml = "<volume type='file'>\n  <name>egressproxy-k.root.qcow2</name>\n  \
                   <key>/p/egressproxy-k.root.qcow2</key>\n  <capacity unit='bytes'>1073741824</capacity>\n  \
                   <allocation unit='bytes'>200704</allocation>\n  <physical unit='bytes'>196624</physical>\n  \
                   <target>\n    <path>/p/egressproxy-k.root.qcow2</path>\n    <format type='qcow2'/>\n  </target>\n  \
                   <backingStore>\n    <path>/p/egressproxy-base-ab.img</path>\n    <format type='qcow2'/>\n  </backingStore>\n</volume>";
        let facts = OverlayFacts::parse(xml).unwrap();
        assert_eq!(
            facts,
            OverlayFacts {
                capacity_bytes: 1 << 30,
                backing_path: Some("/p/egressproxy-base-ab.img".into()),
                backing_format: Some("qcow2".into()),
            }
        );
        assert!(facts.matches(1 << 30, "/p/egressproxy-base-ab.img", ImageFormat::Qcow2));
        assert!(!facts.matches(2 << 30, "/p/egressproxy-base-ab.img", ImageFormat::Qcow2));
        assert!(!facts.matches(1 << 30, "/p/egressproxy-base-cd.img", ImageFormat::Qcow2));
        assert!(!facts.matches(1 << 30, "/p/egressproxy-base-ab.img", ImageFormat::Raw));
        // A size qemu-img rounded up to whole sectors is the wanted one.
        assert!(facts.matches(
            (1 << 30) - 100,
            "/p/egressproxy-base-ab.img",
            ImageFormat::Qcow2
        ));

        let plain = OverlayFacts::parse(
            "<volume><name>v</name><capacity unit='KiB'>64</capacity><target/></volume>",
        )
        .unwrap();
        assert_eq!(plain.capacity_bytes, 64 << 10);
        assert_eq!(plain.backing_path, None);
        assert!(!plain.matches(64 << 10, "/p/base", ImageFormat::Raw));
    }
}
