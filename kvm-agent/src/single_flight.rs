//! One detached task per key; callers wait on it up to their own deadline.
//!
//! Work that is expensive and must not run twice at once for the same key (a base image
//! download per host and image, the KVM probe per host) runs in a task of its own, under
//! its own deadline. Every caller, the first included, joins the key's flight and waits
//! for its result up to the caller's deadline; a caller whose deadline passes first
//! leaves, and the work goes on for the next one. The flight leaves the map before it
//! publishes its result, so a caller that arrives afterwards starts afresh instead of
//! receiving an old (possibly failed) result; it also leaves when its task panics.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio::time::Instant;

/// The flights in progress, by key. `M` is what the flight shows while it runs (e.g. its
/// progress), `T` its result.
#[derive(Debug)]
pub(crate) struct SingleFlight<K, M, T> {
    flights: Arc<Mutex<HashMap<K, Flight<M, T>>>>,
}

impl<K, M, T> Default for SingleFlight<K, M, T> {
    fn default() -> Self {
        Self {
            flights: Arc::default(),
        }
    }
}

/// One flight, as a caller holds it.
#[derive(Debug, Clone)]
pub(crate) struct Flight<M, T> {
    /// What the flight shows while it runs.
    pub(crate) meta: M,
    done: watch::Receiver<Option<T>>,
}

/// How a caller's wait ended.
#[derive(Debug)]
pub(crate) enum Waited<T> {
    /// The flight's result.
    Done(T),
    /// The caller's deadline passed first; the flight goes on.
    DeadlinePassed,
    /// The flight's task ended without a result (it panicked or the runtime stopped).
    Lost,
}

impl<K, M, T> SingleFlight<K, M, T>
where
    K: Eq + Hash + Clone + Send + 'static,
    M: Clone + Send + Sync + 'static,
    T: Clone + Send + Sync + 'static,
{
    /// The flight of `key`: the one in progress, or a new one, whose meta and work
    /// `start` makes; the work is spawned detached.
    pub(crate) fn join_or_start<F>(&self, key: K, start: impl FnOnce() -> (M, F)) -> Flight<M, T>
    where
        F: Future<Output = T> + Send + 'static,
    {
        let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(flight) = flights.get(&key) {
            return flight.clone();
        }
        let (meta, work) = start();
        let (done_tx, done_rx) = watch::channel(None);
        let flight = Flight {
            meta,
            done: done_rx,
        };
        flights.insert(key.clone(), flight.clone());
        drop(flights);
        let landing = Landing {
            flights: self.flights.clone(),
            key,
        };
        tokio::spawn(async move {
            let result = work.await;
            drop(landing);
            done_tx.send_replace(Some(result));
        });
        flight
    }

    /// The keys of the flights in progress.
    pub(crate) fn keys(&self) -> Vec<K> {
        self.flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect()
    }
}

impl<M, T: Clone> Flight<M, T> {
    /// Waits for the flight's result until `deadline`.
    pub(crate) async fn wait(&self, deadline: Instant) -> Waited<T> {
        let mut done = self.done.clone();
        match tokio::time::timeout_at(deadline, done.wait_for(Option::is_some)).await {
            Err(_) => Waited::DeadlinePassed,
            Ok(Err(_)) => Waited::Lost,
            Ok(Ok(result)) => match &*result {
                Some(result) => Waited::Done(result.clone()),
                None => Waited::Lost,
            },
        }
    }
}

/// Removes a flight from the map when its task ends, normally or by panic.
struct Landing<K: Eq + Hash, M, T> {
    flights: Arc<Mutex<HashMap<K, Flight<M, T>>>>,
    key: K,
}

impl<K: Eq + Hash, M, T> Drop for Landing<K, M, T> {
    fn drop(&mut self) {
        self.flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn callers_share_one_run_and_a_later_caller_starts_afresh() {
        let flights: SingleFlight<&str, (), usize> = SingleFlight::default();
        let runs = Arc::new(AtomicUsize::new(0));
        let (release, released) = watch::channel(false);
        let start = || {
            let runs = runs.clone();
            let mut released = released.clone();
            move || {
                let work = async move {
                    released.wait_for(|r| *r).await.unwrap();
                    runs.fetch_add(1, Ordering::SeqCst) + 1
                };
                ((), work)
            }
        };
        let first = flights.join_or_start("k", start());
        let second = flights.join_or_start("k", start());
        assert_eq!(flights.keys(), ["k"]);
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(matches!(first.wait(soon).await, Waited::DeadlinePassed));
        release.send_replace(true);
        let later = Instant::now() + Duration::from_secs(10);
        assert!(matches!(first.wait(later).await, Waited::Done(1)));
        assert!(matches!(second.wait(later).await, Waited::Done(1)));
        assert!(flights.keys().is_empty());
        let third = flights.join_or_start("k", start());
        assert!(matches!(third.wait(later).await, Waited::Done(2)));
    }

    #[tokio::test]
    async fn a_panicking_flight_is_lost_and_leaves_the_map() {
        let flights: SingleFlight<&str, (), ()> = SingleFlight::default();
        let flight = flights.join_or_start("k", || ((), async { panic!("boom") }));
        let later = Instant::now() + Duration::from_secs(10);
        assert!(matches!(flight.wait(later).await, Waited::Lost));
        assert!(flights.keys().is_empty());
    }
}
