//! The write-ahead log: what makes an acknowledged batch survive `kill -9`.
//!
//! # Design
//!
//! The log is a directory of *segment* files, `wal-<first seq>.log`, each a sequence of records:
//!
//! ```text
//! | payload len: u32 LE | crc32: u32 LE | seq: u64 LE | payload ... |
//! ```
//!
//! The CRC covers the sequence number and the payload, so a record is either whole and
//! verified or it is the torn tail of a write that was cut short. Sequence numbers increase by
//! one per record across segments; the storage manifest remembers the highest sequence number
//! whose rows are in Parquet (`flushed_seq`), so replay skips everything at or below it.
//!
//! One writer thread owns the active segment. Requests queue on a channel; the writer takes
//! every request waiting (up to a byte cap), writes them, calls `fdatasync` once, then — in
//! sequence order — runs each request's `apply` step (which puts the rows into the queryable
//! hot buffer) and acknowledges it. This is *group commit*: under load, one fsync covers many
//! batches, and an acknowledgement always means "on disk and visible to queries".
//!
//! A segment is deleted once every record in it is at or below a flushed sequence number
//! ([`WalHandle::truncate`]). On start, [`replay`] reads the segments in order. Where a record
//! is cut short or fails its CRC, replay *resynchronises*: it looks for the next offset at
//! which a whole record with a plausible sequence number verifies, copies the bytes in between
//! to `wal/damaged/` (never deletes them), and goes on from there. Damage followed by no record
//! at the end of the last segment is a torn tail from a crash: kept the same way, then cut from
//! the segment with a warning. Damage anywhere else cannot come from a crash (a bit flip, a bad
//! sector); it is logged as an error and counted, and every record after it still replays —
//! the first design truncated the last segment at its first bad record and skipped the rest of
//! an older one, losing acknowledged batches behind one flipped bit. A record that verifies
//! but does not decode is set aside there too (with the reason) rather than skipped.
//!
//! # When a write or an fsync fails
//!
//! A failed group (a full disk, an I/O error) is answered with an error, never applied, and
//! then *rolled back*: its bytes still buffered are discarded (not written at shutdown, as they
//! once were), and the segments are cut back to where they stood after the last successful
//! fsync — segments the group started are deleted, the one it appended to is truncated and
//! fsynced. After an fsync error the page cache can no longer be trusted to hold what was
//! written (PostgreSQL's "fsyncgate"), so the log never retries an fsync over the same bytes:
//! after the rollback the next batch starts a fresh segment. While the rollback has not
//! succeeded the log is *failed*: appends get `503` with `Retry-After`, `/healthz` and
//! `/readyz` say so, and the writer retries the rollback every second, so the collector heals
//! by itself when space returns. Sequence numbers of a failed group are not reused (replay
//! accepts gaps). If the process ends while the disk still refuses the rollback, bytes of the
//! failed group that did reach the disk may replay at the next start; that is the one case in
//! which a batch answered `503` can be stored, and the log says so when it happens.
//! Every write, fsync, truncation and delete goes through the data directory's
//! [`crate::disk::Disk`], so tests fail them on purpose ([`crate::disk::faulty`]) or model a
//! power cut ([`crate::disk::model`]) without a counter in this path.

mod format;
mod metrics;
mod replay;
#[cfg(test)]
mod tests;
mod writer;

pub use metrics::{WalMetrics, WalObserver};
pub use replay::{DAMAGED_DIR, ReplayReport, Replayed, replay, set_aside_entry};
pub use writer::{ApplyFn, WalHandle};

/// The log's directory inside the data directory.
pub const DIR: &str = "wal";
