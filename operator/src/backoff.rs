//! Per-object exponential backoff with jitter, so one failing Proxy backs off without
//! slowing the others, and many Proxies failing together do not retry in lockstep.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use rand::Rng;

/// Backoff delays per key (a Proxy's UID, or UID plus purpose).
#[derive(Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    attempts: Mutex<HashMap<String, u32>>,
}

impl Backoff {
    /// Delays start near `base` and double up to `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max,
            attempts: Mutex::default(),
        }
    }

    /// The delay before the next attempt for `key`: `base * 2^n` capped at `max`, then
    /// jittered into its upper half (so it never drops below half the nominal delay).
    pub fn next(&self, key: &str) -> Duration {
        let mut attempts = self.attempts.lock().unwrap_or_else(|p| p.into_inner());
        let attempt = attempts.entry(key.to_owned()).or_default();
        let nominal = self
            .base
            .saturating_mul(1u32 << (*attempt).min(20))
            .min(self.max);
        *attempt = attempt.saturating_add(1);
        let jitter = rand::rng().random_range(0.5..=1.0);
        nominal.mul_f64(jitter)
    }

    /// Keys with recorded attempts.
    pub fn len(&self) -> usize {
        self.attempts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// Whether no key has recorded attempts.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets `key`'s failures after a success.
    pub fn reset(&self, key: &str) {
        self.attempts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_exponentially_with_jitter_and_cap() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(10));
        let delays: Vec<Duration> = (0..6).map(|_| backoff.next("a")).collect();
        let nominal = [1, 2, 4, 8, 10, 10];
        for (delay, nominal) in delays.iter().zip(nominal) {
            let nominal = Duration::from_secs(nominal);
            assert!(
                *delay >= nominal / 2 && *delay <= nominal,
                "{delay:?} vs {nominal:?}"
            );
        }
    }

    #[test]
    fn keys_are_independent_and_reset_starts_over() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        for _ in 0..5 {
            backoff.next("a");
        }
        assert!(backoff.next("b") <= Duration::from_secs(1));
        backoff.reset("a");
        assert!(backoff.next("a") <= Duration::from_secs(1));
    }
}
