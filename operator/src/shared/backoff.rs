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
    /// Delays start near `base` and double up to `max` (at least `base`: bounds given
    /// the wrong way round cannot make a delay exceed its own cap).
    pub fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max: max.max(base),
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

    /// The first delay, for a key whose attempts are not recorded.
    pub fn first_delay(&self) -> Duration {
        self.base
    }

    /// Keys with recorded attempts.
    pub fn keys(&self) -> Vec<String> {
        self.attempts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect()
    }

    /// The delay before the next attempt for `key` when the other side asked to wait
    /// `hint`: the hint, but no shorter than this key's backoff delay and no longer than
    /// `ceiling`. Never panics, whatever the bounds: when the backoff delay exceeds the
    /// ceiling, the ceiling wins (`Duration::clamp` would panic on such crossed bounds).
    pub fn next_after_hint(&self, key: &str, hint: Duration, ceiling: Duration) -> Duration {
        let floor = self.next(key).min(ceiling);
        hint.clamp(floor, ceiling)
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
        let mut attempts = self.attempts.lock().unwrap_or_else(|p| p.into_inner());
        attempts.remove(key);
        super::tables::shrink_when_sparse(&mut attempts);
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
    fn a_hint_is_kept_between_the_backoff_and_the_ceiling_without_panicking() {
        let backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(600));
        let hinted = backoff.next_after_hint("a", Duration::from_secs(7), Duration::from_secs(300));
        assert_eq!(hinted, Duration::from_secs(7));
        // The backoff's own delays grow past the ceiling: the ceiling still wins.
        for _ in 0..20 {
            backoff.next("b");
        }
        let capped = backoff.next_after_hint("b", Duration::ZERO, Duration::from_secs(300));
        assert_eq!(capped, Duration::from_secs(300));
        let huge = backoff.next_after_hint("c", Duration::MAX, Duration::from_secs(300));
        assert_eq!(huge, Duration::from_secs(300));
    }

    #[test]
    fn crossed_bounds_never_exceed_the_base() {
        let backoff = Backoff::new(Duration::from_secs(10), Duration::from_secs(1));
        for _ in 0..5 {
            assert!(backoff.next("a") <= Duration::from_secs(10));
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
