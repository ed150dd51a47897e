//! Counters the agent keeps so that nothing it loses is lost silently.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// Live counters, shared by the training thread and the sender.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) queued_values: AtomicU64,
    pub(crate) accepted_rows: AtomicU64,
    pub(crate) dropped_queue_full: AtomicU64,
    pub(crate) dropped_spool_full: AtomicU64,
    pub(crate) refused_rows: AtomicU64,
    pub(crate) set_aside_rows: AtomicU64,
    pub(crate) sent_rows: AtomicU64,
    pub(crate) sent_batches: AtomicU64,
    pub(crate) duplicates: AtomicU64,
    pub(crate) retries: AtomicU64,
    pub(crate) spooled_batches: AtomicU64,
    pub(crate) spool_bytes: AtomicU64,
    pub(crate) spool_corrupt: AtomicU64,
    pub(crate) backlog_batches: AtomicU64,
    pub(crate) connected: AtomicBool,
    pub(crate) ever_connected: AtomicBool,
    pub(crate) last_error: Mutex<Option<String>>,
}

impl Stats {
    pub(crate) fn dropped(&self) -> u64 {
        self.dropped_queue_full.load(Relaxed)
            + self.dropped_spool_full.load(Relaxed)
            + self.refused_rows.load(Relaxed)
    }

    pub(crate) fn error(&self, message: String) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(message);
    }

    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            accepted_rows: self.accepted_rows.load(Relaxed),
            queued_values: self.queued_values.load(Relaxed),
            sent_rows: self.sent_rows.load(Relaxed),
            sent_batches: self.sent_batches.load(Relaxed),
            duplicates: self.duplicates.load(Relaxed),
            retries: self.retries.load(Relaxed),
            dropped_rows: self.dropped(),
            dropped_queue_full: self.dropped_queue_full.load(Relaxed),
            dropped_spool_full: self.dropped_spool_full.load(Relaxed),
            refused_rows: self.refused_rows.load(Relaxed),
            set_aside_rows: self.set_aside_rows.load(Relaxed),
            backlog_batches: self.backlog_batches.load(Relaxed),
            spooled_batches: self.spooled_batches.load(Relaxed),
            spool_bytes: self.spool_bytes.load(Relaxed),
            spool_corrupt: self.spool_corrupt.load(Relaxed),
            connected: self.connected.load(Relaxed),
            ever_connected: self.ever_connected.load(Relaxed),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatsSnapshot {
    /// Rows the training thread handed over and the queue took.
    pub accepted_rows: u64,
    /// Values in the queue, not yet batched.
    pub queued_values: u64,
    /// Rows the collector acknowledged (duplicates included).
    pub sent_rows: u64,
    pub sent_batches: u64,
    /// Acknowledgements that said "already stored" (an earlier attempt had landed).
    pub duplicates: u64,
    /// Failed attempts that will be retried.
    pub retries: u64,
    /// Rows lost for any reason: `dropped_queue_full + dropped_spool_full + refused_rows`.
    pub dropped_rows: u64,
    /// Rows dropped because the queue was full (the training thread never waits).
    pub dropped_queue_full: u64,
    /// Rows dropped because the backlog (memory and spool) was full.
    pub dropped_spool_full: u64,
    /// Rows in batches the collector refused (4xx) and that could not be kept (no spool
    /// directory, or its `refused/` folder full); see `last_error`.
    pub refused_rows: u64,
    /// Rows in batches the collector refused, kept in the spool's `refused/` folder for
    /// `rankwatch sync` once the cause is fixed (not lost, so not in `dropped_rows`).
    pub set_aside_rows: u64,
    /// Batches waiting for delivery, in memory or on disk.
    pub backlog_batches: u64,
    /// Batches waiting in the disk spool.
    pub spooled_batches: u64,
    pub spool_bytes: u64,
    /// Spool records skipped as torn or corrupt.
    pub spool_corrupt: u64,
    /// Whether the last attempt reached the collector.
    pub connected: bool,
    pub ever_connected: bool,
    pub last_error: Option<String>,
}
