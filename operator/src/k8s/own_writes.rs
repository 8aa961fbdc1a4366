//! The operator's own status writes that its watch has not delivered yet, so that a
//! reconcile never works from a copy older than what the operator itself wrote.
//!
//! A reconcile reads the Proxy from the watch's store, which lags behind the
//! apiserver. One queued while another ran (a provider's watch reporting the instance
//! just created, for example) starts as soon as the first ends, often before the watch
//! has delivered the status that first one wrote: it then sees no instance in the
//! status, asks the provider to create it again, writes the status again and repeats
//! the Event. Under a burst that was most Proxies, and a fifth of the apiserver's
//! writes. So:
//!
//! 1. Each status write [`record`](OwnWrites::record)s the resourceVersion the
//!    apiserver answered with.
//! 2. A reconcile whose copy of the Proxy is older than that
//!    ([`waits_for`](OwnWrites::waits_for)) is requeued after [`RECHECK`] instead of
//!    acting, for at most [`MAX_WAIT`]: a watch that is down must not stop reconciles,
//!    and what they then do twice is safe (creates are idempotent by key).
//!    Resource versions of one resource compare as integers (Kubernetes guarantees it
//!    since 1.35); one that is not such an integer is only known to be as new when it
//!    is equal.
//!
//! The entry goes once a copy at least as new is reconciled, or with the Proxy.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::shared::tables::shrink_when_sparse;

/// How soon a reconcile that waits for its own write looks again.
pub const RECHECK: Duration = Duration::from_millis(100);
/// How long a write may stay unseen before reconciles go ahead without it.
pub const MAX_WAIT: Duration = Duration::from_secs(5);

/// The last status write of each Proxy UID not yet seen by the watch.
#[derive(Debug, Default)]
pub struct OwnWrites {
    unseen: Mutex<HashMap<String, (String, Instant)>>,
}

impl OwnWrites {
    /// The operator wrote the Proxy `uid`, which now has `resource_version`.
    pub fn record(&self, uid: &str, resource_version: String) {
        lock(&self.unseen).insert(uid.to_owned(), (resource_version, Instant::now()));
    }

    /// Whether a reconcile of the Proxy `uid` working from a copy at `version` should
    /// wait for the watch: the copy predates the last write, which is not older than
    /// [`MAX_WAIT`]. An entry that no longer holds a reconcile back is dropped.
    pub fn waits_for(&self, uid: &str, version: Option<&str>) -> bool {
        let mut unseen = lock(&self.unseen);
        let Some((written, at)) = unseen.get(uid) else {
            return false;
        };
        if version.is_some_and(|version| at_least(version, written)) {
            unseen.remove(uid);
            shrink_when_sparse(&mut unseen);
            return false;
        }
        if at.elapsed() >= MAX_WAIT {
            tracing::debug!(%uid, "the watch has not delivered the operator's last status write; reconciling anyway");
            unseen.remove(uid);
            shrink_when_sparse(&mut unseen);
            return false;
        }
        true
    }

    /// Drops the entry of the Proxy `uid`.
    pub fn forget(&self, uid: &str) {
        let mut unseen = lock(&self.unseen);
        unseen.remove(uid);
        shrink_when_sparse(&mut unseen);
    }

    /// The UIDs with an entry.
    pub fn uids(&self) -> Vec<String> {
        lock(&self.unseen).keys().cloned().collect()
    }

    /// How many entries there are.
    pub fn len(&self) -> usize {
        lock(&self.unseen).len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether resource version `version` is at least `written`: compared as integers when
/// both are well-formed ones (no sign, no leading zero), else only when equal.
fn at_least(version: &str, written: &str) -> bool {
    let integer =
        |v: &str| !v.is_empty() && !v.starts_with('0') && v.bytes().all(|b| b.is_ascii_digit());
    if integer(version) && integer(written) {
        (version.len(), version) >= (written.len(), written)
    } else {
        version == written
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_older_than_the_last_write_waits() {
        let writes = OwnWrites::default();
        assert!(!writes.waits_for("a", Some("5")), "nothing written");
        writes.record("a", "10".into());
        assert!(writes.waits_for("a", Some("9")));
        assert!(writes.waits_for("a", None), "a copy without a version");
        assert!(!writes.waits_for("b", Some("9")), "another Proxy");
        assert!(!writes.waits_for("a", Some("10")));
        assert!(writes.is_empty(), "a copy as new leaves nothing behind");
    }

    #[test]
    fn versions_compare_as_integers_of_any_length() {
        assert!(at_least("10", "9"));
        assert!(at_least("100", "99"));
        assert!(!at_least("99", "100"));
        assert!(at_least(
            "123456789012345678901234",
            "123456789012345678901233"
        ));
        // Not integers as Kubernetes makes them: only equality says anything.
        assert!(!at_least("010", "9"));
        assert!(!at_least("a", "9"));
        assert!(at_least("a", "a"));
    }

    #[test]
    fn a_write_unseen_for_too_long_is_waited_for_no_more() {
        let writes = OwnWrites::default();
        writes.record("a", "10".into());
        lock(&writes.unseen).get_mut("a").unwrap().1 = Instant::now() - MAX_WAIT;
        assert!(!writes.waits_for("a", Some("9")));
        assert!(writes.is_empty());
    }

    #[test]
    fn a_forgotten_proxy_has_no_entry() {
        let writes = OwnWrites::default();
        writes.record("a", "10".into());
        writes.forget("a");
        assert_eq!(writes.uids(), Vec::<String>::new());
    }
}
