//! What the operator last wrote of each Proxy's own objects (its Service and
//! EndpointSlices), so that a reconcile wanting the same again neither reads nor writes
//! them.
//!
//! Every reconcile of a Ready Proxy (one per health-check period) would otherwise read
//! its Service and list its EndpointSlices to find that nothing differs: two apiserver
//! requests per Proxy per period, which with thousands of Proxies is the apiserver's
//! main load. Instead:
//!
//! 1. A sync [`begin`](Published::begin)s with a digest of what it wants. When the last
//!    sync of that Proxy wrote exactly that, and nothing said since that the objects
//!    drifted, there is nothing to do.
//! 2. Otherwise it reads, writes what differs and records the digest
//!    ([`done`](Published::done)), unless the objects were reported drifted while it
//!    ran: then the next sync looks again.
//! 3. The watch of those objects reports every change that is not what the Proxy wants
//!    ([`drifted`](Published::drifted)), a hand edit or a deletion, before it asks for a
//!    reconcile, so the reconcile it starts reads and repairs them. Each (re)list of
//!    that watch, which names no object deleted while it was down, and each of its
//!    errors (no permission in a namespace; it retries with backoff) make every Proxy's
//!    next sync read again ([`all_drifted`](Published::all_drifted)): what changed
//!    unseen is repaired at the Proxy's first poll after that.
//!
//! The memory is a digest per Proxy, dropped with the Proxy's other entries. An
//! operator that starts has none, so its first sync of each Proxy reads as before.

use std::collections::HashMap;
use std::sync::Mutex;

/// The digest and drift epoch of each Proxy's last sync, by UID.
#[derive(Debug, Default)]
pub struct Published {
    entries: Mutex<HashMap<String, Entry>>,
}

#[derive(Debug, Default)]
struct Entry {
    /// What the last completed sync wrote (or found) everything to be.
    digest: Option<u64>,
    /// Bumped by every drift report.
    epoch: u64,
}

/// A sync under way, as [`Published::begin`] started it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    epoch: u64,
}

impl Published {
    /// Starts a sync of the Proxy `uid` that wants `digest`: `None` when the objects are
    /// known to be just that (nothing to read or write).
    pub fn begin(&self, uid: &str, digest: u64) -> Option<Ticket> {
        let mut entries = lock(&self.entries);
        let entry = entries.entry(uid.to_owned()).or_default();
        if entry.digest == Some(digest) {
            return None;
        }
        Some(Ticket { epoch: entry.epoch })
    }

    /// Records that the sync `ticket` made the objects `digest`, unless a drift was
    /// reported since it began (or the Proxy was forgotten).
    pub fn done(&self, uid: &str, ticket: Ticket, digest: u64) {
        if let Some(entry) = lock(&self.entries).get_mut(uid)
            && entry.epoch == ticket.epoch
        {
            entry.digest = Some(digest);
        }
    }

    /// The Proxy's objects changed into something it does not want: its next sync
    /// reads them again, and one under way records nothing.
    pub fn drifted(&self, uid: &str) {
        if let Some(entry) = lock(&self.entries).get_mut(uid) {
            entry.digest = None;
            entry.epoch += 1;
        }
    }

    /// Any Proxy's objects may have changed unseen (their watch failed): every next
    /// sync reads them again.
    pub fn all_drifted(&self) {
        for entry in lock(&self.entries).values_mut() {
            entry.digest = None;
            entry.epoch += 1;
        }
    }

    /// Drops the Proxy's entry.
    pub fn forget(&self, uid: &str) {
        lock(&self.entries).remove(uid);
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

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_objects_again_need_no_sync() {
        let published = Published::default();
        let ticket = published.begin("a", 1).expect("nothing known yet");
        published.done("a", ticket, 1);
        assert_eq!(published.begin("a", 1), None);
        assert!(
            published.begin("a", 2).is_some(),
            "other objects are wanted"
        );
        assert!(published.begin("b", 1).is_some(), "another Proxy");
    }

    #[test]
    fn a_drift_makes_the_next_sync_look_again() {
        let published = Published::default();
        let ticket = published.begin("a", 1).unwrap();
        published.done("a", ticket, 1);
        published.drifted("a");
        assert!(published.begin("a", 1).is_some());
    }

    #[test]
    fn a_drift_during_a_sync_is_not_overwritten_by_it() {
        let published = Published::default();
        let ticket = published.begin("a", 1).unwrap();
        // The objects changed while the sync ran: what it wrote may be gone already.
        published.drifted("a");
        published.done("a", ticket, 1);
        assert!(published.begin("a", 1).is_some());
    }

    #[test]
    fn a_failing_watch_makes_every_sync_look_again() {
        let published = Published::default();
        for uid in ["a", "b"] {
            let ticket = published.begin(uid, 1).unwrap();
            published.done(uid, ticket, 1);
        }
        published.all_drifted();
        assert!(published.begin("a", 1).is_some());
        assert!(published.begin("b", 1).is_some());
    }

    #[test]
    fn a_forgotten_proxy_records_nothing() {
        let published = Published::default();
        let ticket = published.begin("a", 1).unwrap();
        published.forget("a");
        published.done("a", ticket, 1);
        published.drifted("a");
        assert!(published.is_empty());
    }
}
