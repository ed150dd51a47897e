//! The agent's settings, with defaults sized for one training rank.

use std::path::PathBuf;
use std::time::Duration;

use rankwatch_analytics::RunId;

use crate::error::{Error, Result};

/// Whether batches go to a collector or only to the spool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Post to the collector; spool while it is unreachable.
    Online,
    /// Never connect: every batch goes to the spool, to be sent later with [`crate::sync_spool`].
    Offline,
}

/// Everything an [`crate::Agent`] needs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub run: RunId,
    pub rank: u32,
    /// Base URL of the collector, e.g. `http://127.0.0.1:7070`.
    pub collector: String,
    /// Bearer token for ingest, when the collector requires one.
    pub token: Option<String>,
    pub mode: Mode,
    /// Directory of this rank's disk spool; `None` keeps the backlog in memory only (and
    /// loses it, counted, when the process exits with the collector away).
    pub spool_dir: Option<PathBuf>,
    /// Bound on the spool's bytes on disk.
    pub spool_max_bytes: u64,
    /// Size at which a spool segment is closed and a new one started.
    pub segment_bytes: u64,
    /// Bound on batches held in memory before they go to disk (or are dropped without a spool).
    pub memory_backlog_bytes: u64,
    /// Bound on queued records (log calls) between the training thread and the sender.
    pub queue_records: usize,
    /// Bound on queued values over all queued records.
    pub queue_values: u64,
    /// Rows per samples batch.
    pub batch_rows: usize,
    /// A batch is sent at least this often while data arrives.
    pub batch_interval: Duration,
    /// Limit on one POST, connection included.
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// First retry delay; doubles per consecutive failure up to `backoff_cap`.
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
    /// The agent session in idempotency keys; a fresh random one when `None`.
    pub session: Option<String>,
}

impl AgentConfig {
    /// Defaults for `run`/`rank` posting to `collector`.
    pub fn new(run: RunId, rank: u32, collector: impl Into<String>) -> AgentConfig {
        AgentConfig {
            run,
            rank,
            collector: collector.into(),
            token: None,
            mode: Mode::Online,
            spool_dir: None,
            spool_max_bytes: 256 << 20,
            segment_bytes: 8 << 20,
            memory_backlog_bytes: 32 << 20,
            queue_records: 65_536,
            queue_values: 2_000_000,
            batch_rows: 50_000,
            batch_interval: Duration::from_secs(1),
            request_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(2),
            backoff_base: Duration::from_millis(200),
            backoff_cap: Duration::from_secs(30),
            session: None,
        }
    }

    /// Refuses settings the agent cannot work with, naming the setting.
    pub fn check(&self) -> Result<()> {
        let fail = |m: String| Err(Error::Config(m));
        if self.mode == Mode::Online
            && !(self.collector.starts_with("http://") || self.collector.starts_with("https://"))
        {
            return fail(format!(
                "collector must be an http:// URL, got {:?}",
                self.collector
            ));
        }
        if self.collector.starts_with("https://") {
            return fail("https collectors are not supported by this build; put a TLS-terminating proxy on the collector's host or use http:// on a private network".into());
        }
        if self.mode == Mode::Offline && self.spool_dir.is_none() {
            return fail("offline mode needs a spool directory".into());
        }
        if self.queue_records == 0 || self.queue_values == 0 || self.batch_rows == 0 {
            return fail("queue_records, queue_values and batch_rows must be at least 1".into());
        }
        if self.batch_interval.is_zero() || self.request_timeout.is_zero() {
            return fail("batch_interval and request_timeout must be positive".into());
        }
        if let Some(session) = &self.session
            && (session.is_empty()
                || session.len() > 64
                || !session
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'))
        {
            return fail(format!(
                "session must be 1-64 of [A-Za-z0-9_-], got {session:?}"
            ));
        }
        Ok(())
    }
}
