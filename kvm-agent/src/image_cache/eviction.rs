//! Eviction of base volumes that no overlay uses (`kvm-agent evict-images`).
//!
//! One bounded libvirt call per host:
//! 1. refresh the pool, so volumes made or changed outside libvirt are seen;
//! 2. list every volume with its path and backing file (a volume that vanishes meanwhile
//!    is skipped; one that cannot be read fails the eviction: never delete what you cannot
//!    see);
//! 3. plan (`eviction_plan`): a base (`egressproxy-base-*.img`) is kept when any volume's
//!    backing file is its path, or when this process is downloading it; otherwise its
//!    marker is deleted first, then the base (an interrupted eviction leaves a base without
//!    marker, which the next `ensure_base` treats as half-written). A marker whose base is
//!    gone is deleted too;
//! 4. delete in that order; a volume already gone counts as deleted by someone else.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;

use tokio::time::Instant;
use virt::error::ErrorNumber;
use virt::storage_vol::StorageVol;

use super::host_volumes::{is, parse_volume_xml, refresh_pool};
use super::{MARKER_SUFFIX, marker_volume};
use crate::error::Error;
use crate::libvirt_call::LibvirtOp;
use crate::naming::BASE_PREFIX;
use crate::pool::HostPool;

/// Lists, plans and deletes on `host` in one call; `in_flight` are base volume names this
/// process is downloading.
pub(super) async fn evict(
    host: &Arc<HostPool>,
    in_flight: BTreeSet<String>,
    deadline: Instant,
) -> Result<EvictionReport, Error> {
    let pool_name = host.config().storage_pool.clone();
    let host_name = host.name().to_owned();
    let op = LibvirtOp::new("virStoragePoolListAllVolumes");
    host.call(op, deadline, move |c| {
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
    })
    .await
}

/// What [`ImageCache::evict_unused`](super::ImageCache::evict_unused) did on one host.
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

pub(super) fn is_base(name: &str) -> bool {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::naming;

    fn volume(name: &str, path: &str, backing: Option<&str>) -> ListedVolume {
        ListedVolume {
            name: name.into(),
            path: path.into(),
            backing_path: backing.map(str::to_owned),
        }
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
}
