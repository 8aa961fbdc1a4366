//! What the operator last wrote of each Proxy's own objects (its Service and
//! EndpointSlices), so that a sync wanting the same again neither reads nor writes
//! them.
//!
//! Every sync of a Ready Proxy (one per change of the Proxy, and one after each of its
//! reconciles, so one per health-check period) would otherwise read
//! its Service and list its EndpointSlices to find that nothing differs: two apiserver
//! requests per Proxy per period, which with thousands of Proxies is the apiserver's
//! main load. Instead:
//!
//! 1. A sync [`begin`](Published::begin)s with digests of what it wants. When the last
//!    sync of that Proxy wrote exactly that, and nothing said since that the objects
//!    drifted, there is nothing to do.
//! 2. When the last sync wrote the same Service and slices of the same names, and only
//!    some slices' contents differ (a Proxy turning Ready, its address changing), it
//!    writes those slices and reads nothing: nothing said the objects drifted, so they
//!    are what it wrote ([`Begin::SlicesOnly`]).
//! 3. Otherwise it reads, writes what differs and records the digests
//!    ([`done`](Published::done)), unless the objects were reported drifted while it
//!    ran: then the next sync looks again. A sync that fails records nothing, so the
//!    next one reads.
//! 4. The watch of those objects reports every change that is not what the Proxy wants
//!    ([`drifted`](Published::drifted)), a hand edit or a deletion, before it asks for a
//!    sync, so the sync it starts reads and repairs them; a changed slice that the last
//!    sync wrote is just written again whole ([`rewrite_slice`](Published::rewrite_slice)). Each (re)list of
//!    that watch, which names no object deleted while it was down, and each of its
//!    errors (no permission in a namespace; it retries with backoff) make every Proxy's
//!    next sync read again ([`all_drifted`](Published::all_drifted)): what changed
//!    unseen is repaired at the Proxy's first poll after that.
//!
//! The memory is a few digests per Proxy, dropped with the Proxy's other entries. An
//! operator that starts has none, so its first sync of each Proxy reads as before.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::shared::tables::shrink_when_sparse;

/// Digests of a Proxy's objects as a sync wants them (or found them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Objects {
    /// The Service's digest; `None` when no Service is wanted.
    pub service: Option<u64>,
    /// Each EndpointSlice's name and digest.
    pub slices: Vec<(String, u64)>,
}

/// What a sync has to do, as [`Published::begin`] decides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begin {
    /// The objects are known to be just what is wanted: nothing to read or write.
    Unchanged,
    /// The Service and the slices' names are as last written; the slices named here
    /// differ and are all there is to write. Nothing needs reading.
    SlicesOnly {
        /// Hand it back to [`Published::done`].
        ticket: Ticket,
        /// The slices to write.
        slices: Vec<String>,
    },
    /// Read the objects and write what differs.
    Full {
        /// Hand it back to [`Published::done`].
        ticket: Ticket,
    },
}

/// The digests and drift epoch of each Proxy's last sync, by UID.
#[derive(Debug, Default)]
pub struct Published {
    entries: Mutex<HashMap<String, Entry>>,
    /// One writer at a time for each Proxy's objects (striped by UID: no per-Proxy
    /// entry to forget).
    writers: [tokio::sync::Mutex<()>; WRITER_STRIPES],
}

/// How many locks the Proxies' UIDs are spread over. Syncs run a few at a time, so
/// two Proxies rarely share one when it matters.
const WRITER_STRIPES: usize = 16;

#[derive(Debug, Default)]
struct Entry {
    /// What the last completed sync wrote (or found) everything to be.
    written: Option<Objects>,
    /// Slices reported changed since then, which the next sync writes whole even if
    /// it wants them as last written.
    rewrite: Vec<String>,
    /// Bumped by every drift report.
    epoch: u64,
}

/// A sync under way, as [`Published::begin`] started it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    epoch: u64,
}

impl Published {
    /// Waits until no one else writes the objects of the Proxy `uid`, and holds that
    /// until the guard is dropped: a sync started before the Proxy's deletion must not
    /// write its Service again after its cleanup withdrew it.
    pub async fn one_writer(&self, uid: &str) -> tokio::sync::MutexGuard<'_, ()> {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        uid.hash(&mut hasher);
        let stripe = usize::try_from(hasher.finish() % WRITER_STRIPES as u64).unwrap_or(0);
        self.writers[stripe].lock().await
    }

    /// Starts a sync of the Proxy `uid` that wants `wanted`.
    pub fn begin(&self, uid: &str, wanted: &Objects) -> Begin {
        let mut entries = lock(&self.entries);
        let entry = entries.entry(uid.to_owned()).or_default();
        if entry.written.as_ref() == Some(wanted) && entry.rewrite.is_empty() {
            return Begin::Unchanged;
        }
        let ticket = Ticket { epoch: entry.epoch };
        let rewrite = std::mem::take(&mut entry.rewrite);
        // Taken out: should this sync fail half-way, the next one reads.
        match entry.written.take() {
            Some(last)
                if last.service.is_some()
                    && last.service == wanted.service
                    && same_names(&last.slices, &wanted.slices) =>
            {
                let slices = wanted
                    .slices
                    .iter()
                    .filter(|slice| !last.slices.contains(slice) || rewrite.contains(&slice.0))
                    .map(|(name, _)| name.clone())
                    .collect();
                Begin::SlicesOnly { ticket, slices }
            }
            _ => Begin::Full { ticket },
        }
    }

    /// Records that the sync `ticket` made the objects `written`, unless a drift was
    /// reported since it began (or the Proxy was forgotten).
    pub fn done(&self, uid: &str, ticket: Ticket, written: Objects) {
        if let Some(entry) = lock(&self.entries).get_mut(uid)
            && entry.epoch == ticket.epoch
        {
            entry.written = Some(written);
        }
    }

    /// The Proxy `uid`'s slice `name` changed into something it does not want, and the
    /// last sync wrote that slice: the next sync writes it whole (whether that sync
    /// wants it as last written or not) without reading anything. Returns false when no
    /// completed sync wrote it (none yet, or one under way): report a drift instead.
    ///
    /// A slice is all the operator's, so writing it whole is a repair; in a burst, the
    /// operator's own late writes (an empty slice seen after the Proxy turned Ready)
    /// then cost one write each instead of a read of everything.
    pub fn rewrite_slice(&self, uid: &str, name: &str) -> bool {
        let mut entries = lock(&self.entries);
        let Some(entry) = entries.get_mut(uid) else {
            return false;
        };
        let written = entry
            .written
            .as_ref()
            .is_some_and(|last| last.slices.iter().any(|(n, _)| n == name));
        if written && !entry.rewrite.iter().any(|n| n == name) {
            entry.rewrite.push(name.to_owned());
        }
        written
    }

    /// The Proxy's objects changed into something it does not want: its next sync
    /// reads them again, and one under way records nothing.
    pub fn drifted(&self, uid: &str) {
        if let Some(entry) = lock(&self.entries).get_mut(uid) {
            entry.written = None;
            entry.rewrite.clear();
            entry.epoch += 1;
        }
    }

    /// Any Proxy's objects may have changed unseen (their watch failed): every next
    /// sync reads them again.
    pub fn all_drifted(&self) {
        for entry in lock(&self.entries).values_mut() {
            entry.written = None;
            entry.epoch += 1;
        }
    }

    /// Drops the Proxy's entry.
    pub fn forget(&self, uid: &str) {
        let mut entries = lock(&self.entries);
        entries.remove(uid);
        shrink_when_sparse(&mut entries);
    }

    /// How many Proxies have an entry.
    pub fn len(&self) -> usize {
        lock(&self.entries).len()
    }

    /// Whether no Proxy has an entry.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The UIDs with an entry.
    pub fn uids(&self) -> Vec<String> {
        lock(&self.entries).keys().cloned().collect()
    }
}

fn same_names(a: &[(String, u64)], b: &[(String, u64)]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|((a, _), (b, _))| a == b)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn objects(service: u64, slices: &[(&str, u64)]) -> Objects {
        Objects {
            service: Some(service),
            slices: slices.iter().map(|(n, d)| ((*n).to_owned(), *d)).collect(),
        }
    }

    fn ticket(begin: Begin) -> Ticket {
        match begin {
            Begin::Unchanged => panic!("expected a sync"),
            Begin::SlicesOnly { ticket, .. } | Begin::Full { ticket } => ticket,
        }
    }

    fn publish(published: &Published, uid: &str, wanted: &Objects) {
        let ticket = ticket(published.begin(uid, wanted));
        published.done(uid, ticket, wanted.clone());
    }

    #[test]
    fn the_same_objects_again_need_no_sync() {
        let published = Published::default();
        let a = objects(1, &[("p-ipv4", 1)]);
        assert!(matches!(published.begin("a", &a), Begin::Full { .. }));
        publish(&published, "a", &a);
        assert_eq!(published.begin("a", &a), Begin::Unchanged);
        assert!(
            matches!(published.begin("b", &a), Begin::Full { .. }),
            "another Proxy"
        );
    }

    #[test]
    fn only_changed_slices_of_the_same_names_are_written_without_reading() {
        let published = Published::default();
        publish(&published, "a", &objects(1, &[("p-ipv4", 1)]));
        let ready = objects(1, &[("p-ipv4", 2)]);
        let Begin::SlicesOnly { ticket, slices } = published.begin("a", &ready) else {
            panic!("only a slice differs");
        };
        assert_eq!(slices, ["p-ipv4"]);
        published.done("a", ticket, ready.clone());
        assert_eq!(published.begin("a", &ready), Begin::Unchanged);
    }

    #[test]
    fn a_slice_changed_after_it_was_written_is_written_again_without_reading() {
        let published = Published::default();
        assert!(
            !published.rewrite_slice("a", "p-ipv4"),
            "nothing written yet: a drift, to be read"
        );
        let ready = objects(1, &[("p-ipv4", 1)]);
        publish(&published, "a", &ready);
        assert!(!published.rewrite_slice("a", "p-ipv6"), "never written");
        assert!(published.rewrite_slice("a", "p-ipv4"));
        // Even wanted as last written, the changed slice is written again, alone.
        let Begin::SlicesOnly { ticket, slices } = published.begin("a", &ready) else {
            panic!("only the changed slice is written");
        };
        assert_eq!(slices, ["p-ipv4"]);
        published.done("a", ticket, ready.clone());
        assert_eq!(published.begin("a", &ready), Begin::Unchanged);
    }

    #[test]
    fn a_slice_changed_while_a_sync_is_under_way_is_a_drift() {
        let published = Published::default();
        let ready = objects(1, &[("p-ipv4", 1)]);
        publish(&published, "a", &ready);
        let ticket = ticket(published.begin("a", &objects(1, &[("p-ipv4", 2)])));
        assert!(
            !published.rewrite_slice("a", "p-ipv4"),
            "what the sync under way writes is not known yet"
        );
        published.drifted("a");
        published.done("a", ticket, objects(1, &[("p-ipv4", 2)]));
        assert!(matches!(published.begin("a", &ready), Begin::Full { .. }));
    }

    #[test]
    fn another_service_another_slice_name_or_none_wanted_reads_first() {
        let published = Published::default();
        let wanted = [
            objects(2, &[("p-ipv4", 1)]),
            objects(1, &[("p-ipv6", 1)]),
            objects(1, &[("p-ipv4", 1), ("p-ipv6", 1)]),
            Objects::default(),
        ];
        for (i, other) in wanted.iter().enumerate() {
            let uid = format!("u{i}");
            publish(&published, &uid, &objects(1, &[("p-ipv4", 1)]));
            assert!(
                matches!(published.begin(&uid, other), Begin::Full { .. }),
                "{other:?}"
            );
        }
    }

    #[test]
    fn a_sync_that_did_not_finish_makes_the_next_one_read() {
        let published = Published::default();
        publish(&published, "a", &objects(1, &[("p-ipv4", 1)]));
        let ready = objects(1, &[("p-ipv4", 2)]);
        assert!(matches!(
            published.begin("a", &ready),
            Begin::SlicesOnly { .. }
        ));
        // It failed: no done.
        assert!(matches!(published.begin("a", &ready), Begin::Full { .. }));
    }

    #[test]
    fn a_drift_makes_the_next_sync_look_again() {
        let published = Published::default();
        let a = objects(1, &[("p-ipv4", 1)]);
        publish(&published, "a", &a);
        published.drifted("a");
        assert!(matches!(published.begin("a", &a), Begin::Full { .. }));
        publish(&published, "a", &a);
        published.drifted("a");
        assert!(matches!(
            published.begin("a", &objects(1, &[("p-ipv4", 2)])),
            Begin::Full { .. }
        ));
    }

    #[test]
    fn a_drift_during_a_sync_is_not_overwritten_by_it() {
        let published = Published::default();
        let a = objects(1, &[("p-ipv4", 1)]);
        let ticket = ticket(published.begin("a", &a));
        // The objects changed while the sync ran: what it wrote may be gone already.
        published.drifted("a");
        published.done("a", ticket, a.clone());
        assert!(matches!(published.begin("a", &a), Begin::Full { .. }));
    }

    #[test]
    fn a_failing_watch_makes_every_sync_look_again() {
        let published = Published::default();
        let a = objects(1, &[("p-ipv4", 1)]);
        for uid in ["a", "b"] {
            publish(&published, uid, &a);
        }
        published.all_drifted();
        assert!(matches!(published.begin("a", &a), Begin::Full { .. }));
        assert!(matches!(published.begin("b", &a), Begin::Full { .. }));
    }

    #[test]
    fn a_forgotten_proxy_records_nothing() {
        let published = Published::default();
        let a = objects(1, &[("p-ipv4", 1)]);
        let ticket = ticket(published.begin("a", &a));
        published.forget("a");
        published.done("a", ticket, a);
        published.drifted("a");
        assert!(published.is_empty());
    }
}
