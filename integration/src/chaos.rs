//! Repeatable randomness for fault injection: an xorshift64 generator seeded from an
//! environment variable, or from the clock (printed by the caller, so a failing run can be
//! repeated with the same seed).

/// xorshift64: enough to spread faults over a run, and the same sequence for a seed.
#[derive(Debug, Clone)]
pub struct Xorshift(u64);

impl Xorshift {
    /// The generator seeded from `variable` when it holds a number, else from the clock.
    pub fn from_env(variable: &str) -> Self {
        let seed = std::env::var(variable)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        Self::new(seed)
    }

    /// The generator for `seed` (0 is replaced by 1: xorshift never leaves 0).
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// The seed this generator started from (before any draw).
    pub fn seed(&self) -> u64 {
        self.0
    }

    /// A number below `below` (0 when `below` is 0).
    pub fn below(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_sequence_within_bounds() {
        let draws = |seed| {
            let mut random = Xorshift::new(seed);
            (0..100).map(|_| random.below(7)).collect::<Vec<_>>()
        };
        assert_eq!(draws(42), draws(42));
        assert_ne!(draws(42), draws(43));
        assert!(draws(42).iter().all(|n| *n < 7));
        assert!(draws(42).iter().any(|n| *n != draws(42)[0]));
    }
}
