//! Exponential backoff with "equal jitter": the n-th consecutive failure waits between half and
//! all of `min(cap, base · 2ⁿ)`, so a fleet of ranks that lost the collector together does not
//! come back in lockstep, yet no rank retries sooner than half its due time. A `Retry-After`
//! from the collector is a floor, never shortened by jitter.

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// Delay schedule for consecutive failed attempts.
#[derive(Debug)]
pub(crate) struct Backoff {
    base: Duration,
    cap: Duration,
    failures: u32,
    rng: u64,
}

impl Backoff {
    pub(crate) fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base,
            cap: cap.max(base),
            failures: 0,
            rng: std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
                | 1,
        }
    }

    /// The wait before the next attempt after one more failure.
    pub(crate) fn next(&mut self, retry_after: Option<Duration>) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32 << self.failures.min(20))
            .min(self.cap);
        self.failures = self.failures.saturating_add(1);
        let half = exp / 2;
        let jitter = half.mul_f64(self.unit());
        (half + jitter).max(retry_after.unwrap_or(Duration::ZERO))
    }

    /// Consecutive failures so far.
    #[cfg(test)]
    pub(crate) fn failures(&self) -> u32 {
        self.failures
    }

    /// A success resets the schedule.
    pub(crate) fn reset(&mut self) {
        self.failures = 0;
    }

    /// xorshift64*: uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let x = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_within_half_and_full_of_the_capped_exponential() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(5);
        let mut b = Backoff::new(base, cap);
        for n in 0..12u32 {
            let full = base.saturating_mul(1 << n).min(cap);
            let d = b.next(None);
            assert!(
                d >= full / 2 && d <= full,
                "attempt {n}: {d:?} not in [{:?}, {full:?}]",
                full / 2
            );
        }
        b.reset();
        assert!(b.next(None) <= base);
    }

    #[test]
    fn retry_after_is_a_floor() {
        let mut b = Backoff::new(Duration::from_millis(10), Duration::from_millis(50));
        assert_eq!(b.next(Some(Duration::from_secs(3))), Duration::from_secs(3));
        assert_eq!(b.failures(), 1);
    }
}
