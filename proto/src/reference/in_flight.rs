//! How many calls of each method the reference provider is running at once, and the
//! most it ever ran at once: the figure a caller's concurrency bound (the operator's
//! `--max-concurrent-reconciles`) is checked against.
//!
//! A call counts from the moment it arrives, through any injected latency, until its
//! handler returns (for WatchInstances: until the stream is handed over, not for the
//! stream's life).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// The calls running now and the peak, per method. Clones share the counts.
#[derive(Debug, Clone, Default)]
pub(crate) struct CallsInFlight(Arc<Mutex<Counts>>);

#[derive(Debug, Default)]
struct Counts {
    running: BTreeMap<String, u64>,
    peak: BTreeMap<String, u64>,
}

impl CallsInFlight {
    /// Counts a call of `method` as running until the returned guard is dropped.
    pub(crate) fn enter(&self, method: &str) -> InFlight {
        let mut counts = self.lock();
        let running = counts.running.entry(method.to_owned()).or_default();
        *running += 1;
        let now = *running;
        let peak = counts.peak.entry(method.to_owned()).or_default();
        *peak = (*peak).max(now);
        InFlight {
            calls: self.clone(),
            method: method.to_owned(),
        }
    }

    /// The most calls of each method that ran at once.
    pub(crate) fn peak(&self) -> BTreeMap<String, u64> {
        self.lock().peak.clone()
    }

    /// Starts the peaks again from the calls running now, so that a later [`Self::peak`]
    /// tells about what happened since.
    pub(crate) fn restart_peaks(&self) {
        let mut counts = self.lock();
        counts.peak = counts.running.clone();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// One running call; it ends when this is dropped.
#[derive(Debug)]
pub(crate) struct InFlight {
    calls: CallsInFlight,
    method: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(running) = self.calls.lock().running.get_mut(&self.method) {
            *running -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarted_peaks_count_from_the_calls_running_then() {
        let calls = CallsInFlight::default();
        let first = calls.enter("GetInstance");
        drop((calls.enter("GetInstance"), calls.enter("GetInstance")));
        calls.restart_peaks();
        assert_eq!(
            calls.peak(),
            BTreeMap::from([("GetInstance".to_owned(), 1)])
        );
        let second = calls.enter("GetInstance");
        assert_eq!(
            calls.peak(),
            BTreeMap::from([("GetInstance".to_owned(), 2)])
        );
        drop((first, second));
    }

    #[test]
    fn the_peak_is_the_most_calls_of_a_method_running_together() {
        let calls = CallsInFlight::default();
        let first = calls.enter("GetInstance");
        let second = calls.enter("GetInstance");
        let other = calls.enter("CreateInstance");
        drop((first, second));
        // One after the other: never more than one at once.
        drop(calls.enter("GetInstance"));
        drop(calls.enter("GetInstance"));
        drop(other);
        assert_eq!(
            calls.peak(),
            BTreeMap::from([("CreateInstance".into(), 1), ("GetInstance".into(), 2)])
        );
        assert!(calls.lock().running.values().all(|n| *n == 0));
    }
}
