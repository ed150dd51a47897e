//! Where the collector reads the time: a [`Clock`] passed to each component that needs one.
//!
//! Arrival times, step-alignment deadlines, stale-rank and idle timeouts, retention ages and the
//! active-run window all depend on "now". Reading it through one handle instead of the system
//! clock at each call site lets a test move time by hand ([`ManualClock`]) and check those
//! rules at once, without sleeping; the daemon uses [`SystemClock`].

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

/// A source of the current time, in milliseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_ms(&self) -> i64;
}

/// The clock every component of one collector shares.
pub type SharedClock = Arc<dyn Clock>;

/// The system's wall clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as i64)
            .unwrap_or(0)
    }
}

impl SystemClock {
    /// The system clock as a shared handle.
    pub fn shared() -> SharedClock {
        Arc::new(SystemClock)
    }
}

/// A clock that moves only when told to (tests).
#[derive(Debug)]
pub struct ManualClock {
    now_ms: AtomicI64,
}

impl ManualClock {
    /// A clock standing at `now_ms`.
    pub fn at(now_ms: i64) -> Arc<ManualClock> {
        Arc::new(ManualClock {
            now_ms: AtomicI64::new(now_ms),
        })
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.now_ms
            .fetch_add(by.as_millis() as i64, Ordering::SeqCst);
    }

    /// Sets the clock.
    pub fn set(&self, now_ms: i64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let clock = ManualClock::at(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        clock.advance(Duration::from_secs(90));
        assert_eq!(clock.now_ms(), 91_000);
        clock.set(5);
        assert_eq!(clock.now_ms(), 5);
    }

    #[test]
    fn the_system_clock_is_after_2020() {
        assert!(SystemClock.now_ms() > 1_577_836_800_000);
    }
}
