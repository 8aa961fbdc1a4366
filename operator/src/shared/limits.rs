//! Bounds on every duration the operator accepts, from its flags and its provider
//! config. A value outside them is refused at start-up (or at reload) with an error
//! that names the setting, so an absurd value never reaches `Instant + Duration`
//! (which panics on overflow) or a timer that would never fire.

use std::time::Duration;

/// The range one duration setting must lie in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Smallest accepted value.
    pub min: Duration,
    /// Largest accepted value.
    pub max: Duration,
}

/// `callTimeout` of a provider: one call's deadline.
pub const CALL_TIMEOUT: Bounds = Bounds::new(Duration::from_millis(100), Duration::from_secs(600));
/// `--lease-duration`: the leader renews every third of it, so at least 3 s.
pub const LEASE_DURATION: Bounds = Bounds::new(Duration::from_secs(3), Duration::from_secs(600));
/// `--gc-interval`: between garbage-collection sweeps.
pub const GC_INTERVAL: Bounds = Bounds::new(Duration::from_secs(1), Duration::from_secs(86_400));
/// `--gc-grace`: the age an orphan must reach before it is deleted. At least a minute:
/// an instance's age is counted from the provider's clock, so a provider whose clock
/// runs behind the operator's makes a brand-new instance look older than it is, and a
/// smaller grace would let a modest skew (or a slow sweep) delete the instance of a
/// Proxy created a moment ago.
pub const GC_GRACE: Bounds = Bounds::new(Duration::from_secs(60), Duration::from_secs(30 * 86_400));
/// `--providers-reload-interval`: how often the provider config file is re-read.
pub const RELOAD_INTERVAL: Bounds =
    Bounds::new(Duration::from_millis(100), Duration::from_secs(3600));

impl Bounds {
    /// Bounds from `min` to `max`; a pair given the wrong way round is put in order,
    /// so `check` can never be asked for an empty range.
    pub const fn new(min: Duration, max: Duration) -> Self {
        if min.as_nanos() <= max.as_nanos() {
            Bounds { min, max }
        } else {
            Bounds { min: max, max: min }
        }
    }

    /// `value` when it lies within the bounds, else what is wrong with it.
    pub fn check(&self, value: Duration) -> Result<Duration, String> {
        if value < self.min {
            return Err(format!(
                "{} is too short: must be at least {}",
                humantime::format_duration(value),
                humantime::format_duration(self.min)
            ));
        }
        if value > self.max {
            return Err(format!(
                "{} is too long: must be at most {}",
                humantime::format_duration(value),
                humantime::format_duration(self.max)
            ));
        }
        Ok(value)
    }

    /// Parses a human duration (`30s`, `5m`) and checks it: a clap value parser.
    pub fn parse(&self, text: &str) -> Result<Duration, String> {
        let value = humantime::parse_duration(text).map_err(|error| error.to_string())?;
        self.check(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_outside_the_bounds_say_which_bound() {
        assert_eq!(LEASE_DURATION.parse("15s"), Ok(Duration::from_secs(15)));
        let long = LEASE_DURATION.parse("100years").unwrap_err();
        assert!(long.contains("at most 10m"), "{long}");
        let short = LEASE_DURATION.parse("1s").unwrap_err();
        assert!(short.contains("at least 3s"), "{short}");
        assert!(GC_GRACE.parse("soon").is_err());
    }

    #[test]
    fn crossed_bounds_are_put_in_order() {
        let bounds = Bounds::new(Duration::from_secs(9), Duration::from_secs(1));
        assert_eq!(
            bounds.check(Duration::from_secs(5)),
            Ok(Duration::from_secs(5))
        );
    }
}
