//! Eviction of base volumes that no overlay uses (`kvm-agent evict-images`).
//!
//! One bounded libvirt call per host:
//! 1. refresh the pool, so volumes made or changed outside libvirt are seen;
//! 2. list every volume with its path and backing file (a volume that vanishes meanwhile
//!    is skipped; one that cannot be read, or whose XML does not parse, fails the eviction
//!    before anything is deleted: never delete what you cannot see);
//! 3. plan (`eviction_plan`): a base (`egressproxy-base-*.img`) is kept when any volume's
//!    backing file is its path, when this process is downloading it, or when it or its
//!    marker was written less than `min_age` ago by the hypervisor's clock (another agent
//!    process may be uploading it, or a Create may be about to put an overlay on it);
//!    otherwise its marker is deleted first, then the base (an interrupted eviction leaves
//!    a base without marker, which the next `ensure_base` treats as half-written). A
//!    marker whose base is gone is deleted too;
//! 4. delete in that order; a volume already gone counts as deleted by someone else.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::time::Instant;
use virt::error::ErrorNumber;
use virt::storage_vol::StorageVol;

use super::base_volume::{MARKER_SUFFIX, marker_volume};
use super::host_volumes::{is, refresh_pool};
use crate::images::error::ImageError;
use crate::libvirt::LibvirtError;
use crate::libvirt::naming::BASE_PREFIX;
use crate::libvirt::xml::volume::VolumeFacts;
use crate::transport::call::{CallFailure, LibvirtOp};
use crate::transport::pool::HostPool;

/// Lists, plans and deletes on `host` in one call; `in_flight` are base volume names this
/// process is downloading.
pub(super) async fn evict(
    host: &Arc<HostPool>,
    in_flight: BTreeSet<String>,
    min_age: Duration,
    deadline: Instant,
) -> Result<EvictionReport, ImageError> {
    let pool_name = host.config().storage_pool.clone();
    let host_name = host.name().to_owned();
    let op = LibvirtOp::new("virStoragePoolListAllVolumes");
    host.call(op, deadline, move |c| {
        let pool = c.lookup_storage_pool_by_name(&pool_name)?;
        refresh_pool(&pool)?;
        let mut listed = Vec::new();
        for vol in pool.list_all_volumes(0)? {
            match describe(&vol, &host_name) {
                Ok(volume) => listed.push(volume),
                // Gone since the listing: nothing of it to keep.
                Err(CallFailure::Libvirt(e)) if is(&e, ErrorNumber::NoStorageVolume) => {}
                Err(e) => return Err(e),
            }
        }
        let plan = eviction_plan(&listed, &in_flight, SystemTime::now(), min_age);
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

/// What [`ImageCache::evict_unused`](super::cache::ImageCache::evict_unused) did on one host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvictionReport {
    /// The host's name.
    pub host: String,
    /// Volumes deleted (markers and bases), in the order deleted.
    pub deleted: Vec<String>,
    /// Bases kept, each with why.
    pub kept: BTreeMap<String, KeptBecause>,
}

/// Why eviction kept a base.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeptBecause {
    /// These volumes use it as their backing file.
    UsedBy(Vec<String>),
    /// This process is downloading it.
    Downloading,
    /// It (or its marker) was written this long ago, less than the minimum age.
    Recent(Duration),
}

impl fmt::Display for KeptBecause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeptBecause::UsedBy(users) => write!(f, "used by {}", users.join(", ")),
            KeptBecause::Downloading => f.write_str("being downloaded by this agent"),
            KeptBecause::Recent(age) => {
                let age = Duration::from_secs(age.as_secs());
                write!(f, "written {} ago", humantime::format_duration(age))
            }
        }
    }
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
        for (base, why) in &self.kept {
            writeln!(f, "  kept    {base} ({why})")?;
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
    modified: Option<SystemTime>,
}

#[derive(Debug, Default, PartialEq, Eq)]
struct EvictionPlan {
    /// In order: a base's marker before the base.
    delete: Vec<String>,
    kept: BTreeMap<String, KeptBecause>,
}

pub(super) fn is_base(name: &str) -> bool {
    name.starts_with(BASE_PREFIX) && name.ends_with(".img")
}

fn eviction_plan(
    volumes: &[ListedVolume],
    in_flight: &BTreeSet<String>,
    now: SystemTime,
    min_age: Duration,
) -> EvictionPlan {
    let by_name: BTreeMap<&str, &ListedVolume> =
        volumes.iter().map(|v| (v.name.as_str(), v)).collect();
    let mut users: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for volume in volumes {
        if let Some(backing) = &volume.backing_path {
            users
                .entry(backing.as_str())
                .or_default()
                .push(volume.name.clone());
        }
    }
    // Unknown times count as old: a dir pool always reports them.
    let age = |v: &ListedVolume| {
        v.modified
            .map_or(Duration::MAX, |m| now.duration_since(m).unwrap_or_default())
    };
    let mut plan = EvictionPlan::default();
    for volume in volumes.iter().filter(|v| is_base(&v.name)) {
        let marker = marker_volume(&volume.name);
        let marker_volume = by_name.get(marker.as_str());
        let youngest = marker_volume
            .map_or(Duration::MAX, |m| age(m))
            .min(age(volume));
        let kept = if in_flight.contains(&volume.name) {
            Some(KeptBecause::Downloading)
        } else if let Some(users) = users.get(volume.path.as_str()) {
            Some(KeptBecause::UsedBy(users.clone()))
        } else if youngest < min_age {
            Some(KeptBecause::Recent(youngest))
        } else {
            None
        };
        match kept {
            Some(why) => {
                plan.kept.insert(volume.name.clone(), why);
            }
            None => {
                if marker_volume.is_some() {
                    plan.delete.push(marker);
                }
                plan.delete.push(volume.name.clone());
            }
        }
    }
    for volume in volumes {
        if let Some(base) = volume.name.strip_suffix(MARKER_SUFFIX)
            && is_base(base)
            && !by_name.contains_key(base)
            && !in_flight.contains(base)
            && age(volume) >= min_age
        {
            plan.delete.push(volume.name.clone());
        }
    }
    plan
}

fn describe(vol: &StorageVol, host: &str) -> Result<ListedVolume, CallFailure<ImageError>> {
    let name = vol.name()?;
    let path = vol.path()?;
    let xml = vol.xml_desc(0)?;
    listed_volume(host, name, path, &xml).map_err(CallFailure::Agent)
}

/// A volume as eviction sees it, from its XML. XML that does not parse fails the eviction:
/// the volume could be an overlay whose backing file is a base (never delete what you
/// cannot see).
fn listed_volume(
    host: &str,
    name: String,
    path: String,
    xml: &str,
) -> Result<ListedVolume, ImageError> {
    let facts = VolumeFacts::parse(xml).map_err(|e| {
        ImageError::from(LibvirtError::xml(
            format!(
                "host {host}: eviction stopped, nothing deleted: cannot read the XML of volume \
                 {name} (is it an overlay on a base?)"
            ),
            e,
        ))
    })?;
    Ok(ListedVolume {
        name,
        path,
        backing_path: facts.backing_path,
        modified: facts.modified,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::libvirt::naming;

    const NOW: Duration = Duration::from_secs(1_800_000_000);

    fn volume(name: &str, path: &str, backing: Option<&str>, age_secs: u64) -> ListedVolume {
        ListedVolume {
            name: name.into(),
            path: path.into(),
            backing_path: backing.map(str::to_owned),
            modified: Some(SystemTime::UNIX_EPOCH + NOW - Duration::from_secs(age_secs)),
        }
    }

    #[test]
    fn a_volume_whose_xml_does_not_parse_fails_the_eviction_naming_it() {
        let err =
            listed_volume("hv", "odd.qcow2".into(), "/p/odd".into(), "<volume><name>").unwrap_err();
        let text = err.to_string();
        assert!(text.contains("odd.qcow2"), "{text}");
        assert!(text.contains("host hv"), "{text}");
        assert!(text.contains("nothing deleted"), "{text}");
        let listed = listed_volume(
            "hv",
            "o".into(),
            "/p/o".into(),
            "<volume><target><path>/p/o</path></target>\
             <backingStore><path>/p/a</path></backingStore></volume>",
        )
        .unwrap();
        assert_eq!(listed.backing_path.as_deref(), Some("/p/a"));
    }

    #[test]
    fn eviction_keeps_used_downloading_and_recent_bases_and_deletes_markers_first() {
        let base = |hex: &str| naming::base_volume(&hex.repeat(32)).unwrap();
        let (used, old, downloading, fresh, fresh_marker) =
            (base("aa"), base("bb"), base("cc"), base("dd"), base("ee"));
        let stray = marker_volume(&base("ff"));
        let hour = 3600;
        let volumes = vec![
            volume(&used, "/p/a", None, hour),
            volume(&marker_volume(&used), "/p/am", None, hour),
            volume(&old, "/p/b", None, hour),
            volume(&marker_volume(&old), "/p/bm", None, hour),
            volume(&downloading, "/p/c", None, hour),
            // Written a minute ago (another agent's upload): kept.
            volume(&fresh, "/p/d", None, 60),
            // Old file, but its marker was just written (a fresh download): kept.
            volume(&fresh_marker, "/p/e", None, hour),
            volume(&marker_volume(&fresh_marker), "/p/em", None, 5),
            volume("egressproxy-k.root.qcow2", "/p/o", Some("/p/a"), 0),
            volume(&stray, "/p/fm", None, hour),
            volume("someone-elses.qcow2", "/p/x", None, hour),
        ];
        let now = SystemTime::UNIX_EPOCH + NOW;
        let min_age = Duration::from_secs(15 * 60);
        let plan = eviction_plan(&volumes, &[downloading.clone()].into(), now, min_age);
        assert_eq!(plan.delete, [marker_volume(&old), old.clone(), stray]);
        assert_eq!(
            plan.kept[&used],
            KeptBecause::UsedBy(vec!["egressproxy-k.root.qcow2".into()])
        );
        assert_eq!(plan.kept[&downloading], KeptBecause::Downloading);
        assert_eq!(
            plan.kept[&fresh],
            KeptBecause::Recent(Duration::from_secs(60))
        );
        assert_eq!(
            plan.kept[&fresh_marker],
            KeptBecause::Recent(Duration::from_secs(5))
        );
        assert_eq!(plan.kept.len(), 4);
        // With no minimum age, only use and downloads keep a base.
        let plan = eviction_plan(&volumes, &BTreeSet::new(), now, Duration::ZERO);
        assert_eq!(plan.kept.len(), 1);
        assert_eq!(plan.delete.len(), 7);
        assert_eq!(
            KeptBecause::Recent(Duration::from_millis(61_500)).to_string(),
            "written 1m 1s ago"
        );
    }
}
