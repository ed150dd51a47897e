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

use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;

use crate::disk::{Disk, DiskFile, SharedDisk};
use crate::error::{Error, Result};

/// The log's directory inside the data directory.
pub const DIR: &str = "wal";

const HEADER: usize = 16;
/// Most bytes one group commit writes before its fsync.
const GROUP_BYTES: usize = 32 << 20;

/// How often a failed log retries its rollback.
const RECOVERY_INTERVAL: Duration = Duration::from_secs(1);

/// Runs after a record is durable, on the writer thread, in sequence order.
pub type ApplyFn = Box<dyn FnOnce(u64) + Send>;

/// Whether the log is failed, and why; shared by the writer and the handles.
#[derive(Debug, Default)]
struct Failure {
    failed: AtomicBool,
    reason: Mutex<Option<String>>,
}

impl Failure {
    fn set(&self, reason: Option<String>) {
        let failed = reason.is_some();
        *self.reason.lock().unwrap_or_else(|e| e.into_inner()) = reason;
        self.failed.store(failed, Ordering::Release);
    }

    fn reason(&self) -> Option<String> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// Where the segments stood after the last successful fsync: what a failed group is rolled
/// back to.
#[derive(Debug, Clone, Copy)]
struct Checkpoint {
    /// Segments that existed (the ones after them were started by the failed group).
    segments: usize,
    /// The durable length of the last of them.
    last_len: u64,
}

/// What the writer reports about its work, for `/metrics`.
pub trait WalObserver: Send + Sync {
    /// One fsync of `records` records and `bytes` bytes took `seconds`.
    fn fsynced(&self, records: usize, bytes: usize, seconds: f64);
    /// The log now holds `segments` files and `bytes` bytes.
    fn size(&self, segments: usize, bytes: u64);
}

/// The log's counters, fed as its observer; [`crate::telemetry`] exports them.
#[derive(Debug)]
pub struct WalMetrics {
    pub fsync_seconds: Histogram,
    pub group_records: Histogram,
    pub bytes: Gauge,
    pub segments: Gauge,
    /// Damaged ranges and undecodable entries set aside at start.
    pub set_aside: prometheus_client::metrics::counter::Counter,
}

impl Default for WalMetrics {
    fn default() -> Self {
        WalMetrics {
            fsync_seconds: crate::instrument::seconds_histogram(),
            group_records: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            bytes: Gauge::default(),
            segments: Gauge::default(),
            set_aside: Default::default(),
        }
    }
}

impl WalMetrics {
    /// Adds these metrics to a registry, with their names and help texts.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "wal_fsync_seconds",
            "Duration of one write-ahead-log group commit (write and fsync)",
            self.fsync_seconds.clone(),
        );
        r.register(
            "wal_group_records",
            "Batches per write-ahead-log group commit",
            self.group_records.clone(),
        );
        r.register(
            "wal_bytes",
            "Bytes in write-ahead-log segments",
            self.bytes.clone(),
        );
        r.register(
            "wal_segments",
            "Write-ahead-log segment files",
            self.segments.clone(),
        );
        r.register(
            "wal_set_aside",
            "Damaged write-ahead-log ranges and undecodable entries set aside in wal/damaged at start",
            self.set_aside.clone(),
        );
    }
}

impl WalObserver for WalMetrics {
    fn fsynced(&self, records: usize, _bytes: usize, seconds: f64) {
        self.fsync_seconds.observe(seconds);
        self.group_records.observe(records as f64);
    }

    fn size(&self, segments: usize, bytes: u64) {
        self.segments.set(segments as i64);
        self.bytes.set(bytes as i64);
    }
}

enum Message {
    Append {
        payload: Bytes,
        apply: ApplyFn,
        done: oneshot::Sender<Result<u64>>,
    },
    Truncate(u64),
    Sync(oneshot::Sender<()>),
}

/// A record read back by [`replay`].
#[derive(Debug)]
pub struct Replayed {
    pub seq: u64,
    pub payload: Vec<u8>,
}

/// What [`replay`] found.
#[derive(Debug, Default)]
pub struct ReplayReport {
    /// Records after `flushed_seq`, in order.
    pub records: Vec<Replayed>,
    /// The sequence number the next record gets.
    pub next_seq: u64,
    /// Bytes cut from a torn tail (kept in `damaged/` too).
    pub torn_bytes: u64,
    /// Damaged byte ranges set aside in `damaged/`, replay going on after each.
    pub damaged_ranges: usize,
    pub damaged_bytes: u64,
}

/// The folder, inside the log's, where damaged bytes and undecodable entries are set aside.
pub const DAMAGED_DIR: &str = "damaged";

/// How far past the last good sequence number a record found by resynchronising may be. Groups
/// that failed leave gaps, never this wide; the bound is what keeps a random 16 bytes that
/// happen to pass the CRC (one chance in 2^32) from being taken for a record.
const MAX_SEQ_GAP: u64 = 1 << 32;

fn segment_name(first_seq: u64) -> String {
    format!("wal-{first_seq:020}.log")
}

fn list_segments(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut segments = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if let Some(seq) = name
            .strip_prefix("wal-")
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|n| n.parse::<u64>().ok())
        {
            segments.push((seq, path));
        }
    }
    segments.sort();
    Ok(segments)
}

/// Reads every record after `flushed_seq`. Damage is set aside, never skipped past: see the
/// module docs.
pub fn replay(disk: &dyn Disk, dir: &Path, flushed_seq: u64) -> Result<ReplayReport> {
    crate::disk::create_dir_durably(disk, dir)?;
    let segments = list_segments(dir)?;
    let mut report = ReplayReport {
        next_seq: flushed_seq + 1,
        ..Default::default()
    };
    let last = segments.len().saturating_sub(1);
    let mut last_good: Option<u64> = None;
    for (index, (first_seq, path)) in segments.iter().enumerate() {
        let data = fs::read(path)?;
        let mut offset = 0usize;
        while offset < data.len() {
            // A record's sequence number follows the last good one (a segment's first record
            // is its name's); gaps are failed groups.
            let low = last_good.map_or(*first_seq, |s| s + 1);
            let plausible = |seq: u64| seq >= low && seq - low < MAX_SEQ_GAP;
            if let Some((seq, payload)) =
                parse_record(&data[offset..], &plausible, &mut crc32fast::hash)
            {
                if seq > flushed_seq {
                    report.records.push(Replayed {
                        seq,
                        payload: payload.to_vec(),
                    });
                }
                report.next_seq = report.next_seq.max(seq + 1);
                last_good = Some(seq);
                offset += HEADER + payload.len();
                continue;
            }
            // Damage: find where records start again, and keep the bytes between.
            let resume = resync(&data, offset + 1, &plausible, &mut crc32fast::hash);
            let end = resume.unwrap_or(data.len());
            let aside = set_aside(dir, path, offset, &data[offset..end])?;
            if resume.is_none() && index == last {
                tracing::warn!(
                    segment = %path.display(),
                    offset,
                    bytes = end - offset,
                    kept = %aside.display(),
                    "write-ahead log ends in a torn record (a crash mid-write); truncating it"
                );
                // Durably: the writer appends after it, and a torn tail coming back under
                // records appended later would read as damage inside the log.
                disk.truncate(path, offset as u64)?;
                report.torn_bytes += (end - offset) as u64;
            } else {
                tracing::error!(
                    segment = %path.display(),
                    offset,
                    bytes = end - offset,
                    kept = %aside.display(),
                    "damaged bytes inside the write-ahead log, set aside; replay goes on after them"
                );
                report.damaged_ranges += 1;
                report.damaged_bytes += (end - offset) as u64;
            }
            offset = end;
        }
    }
    Ok(report)
}

/// Copies damaged bytes of `segment` at `offset` to `damaged/` (durably) and returns where.
fn set_aside(dir: &Path, segment: &Path, offset: usize, bytes: &[u8]) -> Result<PathBuf> {
    let name = segment
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("segment");
    keep_damaged(dir, &format!("{name}.at-{offset}.bin"), bytes)
}

/// Keeps a log entry that replays but does not decode (`seq`), with the reason beside it.
pub fn set_aside_entry(dir: &Path, seq: u64, payload: &[u8], reason: &str) -> Result<PathBuf> {
    keep_damaged(dir, &format!("seq-{seq:020}.reason.txt"), reason.as_bytes())?;
    keep_damaged(dir, &format!("seq-{seq:020}.entry"), payload)
}

fn keep_damaged(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf> {
    let aside = dir.join(DAMAGED_DIR);
    fs::create_dir_all(&aside)?;
    let path = aside.join(name);
    crate::fsutil::write_atomic(&path, bytes)?;
    Ok(path)
}

/// The first offset from `from` at which a whole record with a plausible sequence number
/// verifies, if any.
fn resync(
    data: &[u8],
    from: usize,
    plausible: &dyn Fn(u64) -> bool,
    crc: &mut dyn FnMut(&[u8]) -> u32,
) -> Option<usize> {
    (from..data.len()).find(|&o| parse_record(&data[o..], plausible, crc).is_some())
}

/// One verified record at the start of `data` whose sequence number is `plausible`, or `None`
/// if it is cut short, implausible or fails its CRC. The length and the sequence number are
/// checked before the CRC is computed: a resync inside a torn 64 MiB record once computed a
/// CRC over megabytes at almost every offset.
fn parse_record<'a>(
    data: &'a [u8],
    plausible: &dyn Fn(u64) -> bool,
    crc: &mut dyn FnMut(&[u8]) -> u32,
) -> Option<(u64, &'a [u8])> {
    if data.len() < HEADER {
        return None;
    }
    let len = u32::from_le_bytes(data[0..4].try_into().ok()?) as usize;
    let expected = u32::from_le_bytes(data[4..8].try_into().ok()?);
    let seq = u64::from_le_bytes(data[8..16].try_into().ok()?);
    if !plausible(seq) {
        return None;
    }
    let body = data.get(8..HEADER.checked_add(len)?)?;
    if crc(body) != expected {
        return None;
    }
    Some((seq, &body[8..]))
}

fn encode_header(seq: u64, payload: &[u8]) -> [u8; HEADER] {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq.to_le_bytes());
    hasher.update(payload);
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    header[4..8].copy_from_slice(&hasher.finalize().to_le_bytes());
    header[8..16].copy_from_slice(&seq.to_le_bytes());
    header
}

/// The handle requests go through; cheap to clone.
#[derive(Clone, Debug)]
pub struct WalHandle {
    tx: mpsc::Sender<Message>,
    failure: Arc<Failure>,
}

impl WalHandle {
    /// Starts the writer thread. Records get sequence numbers from `next_seq` on.
    pub fn start(
        dir: PathBuf,
        next_seq: u64,
        segment_bytes: u64,
        observer: Arc<dyn WalObserver>,
        disk: SharedDisk,
    ) -> Result<(WalHandle, std::thread::JoinHandle<()>)> {
        crate::disk::create_dir_durably(&*disk, &dir)?;
        let segments = list_segments(&dir)?;
        let (tx, rx) = mpsc::channel();
        let failure = Arc::new(Failure::default());
        let mut writer = Writer {
            dir,
            disk,
            segment_bytes,
            next_seq,
            active: None,
            active_size: 0,
            segments: segments
                .into_iter()
                .map(|(seq, path)| {
                    let size = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
                    (seq, path, size)
                })
                .collect(),
            observer,
            failure: failure.clone(),
            rollback: None,
            last_attempt: None,
        };
        let thread = std::thread::Builder::new()
            .name("rankwatch-wal".into())
            .spawn(move || writer.run(rx))?;
        Ok((WalHandle { tx, failure }, thread))
    }

    /// Appends `payload`; resolves once it is fsynced and `apply` has run, with its sequence
    /// number.
    pub async fn append(&self, payload: Bytes, apply: ApplyFn) -> Result<u64> {
        self.accepting()?;
        let (done, wait) = oneshot::channel();
        self.tx
            .send(Message::Append {
                payload,
                apply,
                done,
            })
            .map_err(|_| Error::Unavailable("the write-ahead log is closed".into()))?;
        wait.await
            .map_err(|_| Error::Unavailable("the write-ahead log writer stopped".into()))?
    }

    /// Deletes segments whose records are all at or below `flushed_seq`.
    pub fn truncate(&self, flushed_seq: u64) {
        // A closed channel means shutdown; the next start replays and truncates instead.
        let _ = self.tx.send(Message::Truncate(flushed_seq));
    }

    /// Resolves once every message sent before it has been handled.
    pub async fn barrier(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Message::Sync(done)).is_ok() {
            let _ = wait.await;
        }
    }

    /// Whether the writer has hit an I/O error and refuses new records.
    pub fn is_failed(&self) -> bool {
        self.failure.failed.load(Ordering::Acquire)
    }

    /// Why the log is failed, while it is.
    pub fn failure(&self) -> Option<String> {
        self.failure.reason()
    }

    /// `Ok` unless the log is failed; then the error a refused batch gets.
    pub fn accepting(&self) -> Result<()> {
        match self.failure.reason() {
            None => Ok(()),
            Some(reason) => Err(Error::Unavailable(format!(
                "{reason}; retrying every {} s",
                RECOVERY_INTERVAL.as_secs()
            ))),
        }
    }
}

struct Writer {
    dir: PathBuf,
    disk: SharedDisk,
    segment_bytes: u64,
    next_seq: u64,
    active: Option<BufWriter<Box<dyn DiskFile>>>,
    active_size: u64,
    /// (first seq, path, size), oldest first; the last one is active when `active` is set.
    segments: Vec<(u64, PathBuf, u64)>,
    observer: Arc<dyn WalObserver>,
    failure: Arc<Failure>,
    /// Set while a failed group is not yet rolled back: the log refuses appends.
    rollback: Option<Checkpoint>,
    last_attempt: Option<Instant>,
}

struct Pending {
    seq: u64,
    apply: ApplyFn,
    done: oneshot::Sender<Result<u64>>,
}

impl Writer {
    fn run(&mut self, rx: mpsc::Receiver<Message>) {
        let mut deferred: Option<Message> = None;
        loop {
            if self.rollback.is_some() {
                self.try_recover();
            }
            let first = match deferred.take() {
                Some(m) => m,
                // Failed: wake up to retry the rollback even when no request comes.
                None if self.rollback.is_some() => match rx.recv_timeout(RECOVERY_INTERVAL) {
                    Ok(m) => m,
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                },
                None => match rx.recv() {
                    Ok(m) => m,
                    Err(_) => break,
                },
            };
            let mut group = Vec::new();
            let mut group_bytes = 0usize;
            let mut next = Some(first);
            while let Some(message) = next.take() {
                match message {
                    Message::Append {
                        payload,
                        apply,
                        done,
                    } => {
                        group_bytes += payload.len() + HEADER;
                        group.push((payload, apply, done));
                        if group_bytes < GROUP_BYTES {
                            next = rx.try_recv().ok();
                        }
                    }
                    // Control messages end the group so they see every earlier append applied.
                    other => deferred = Some(other),
                }
            }
            if !group.is_empty() {
                self.commit(group);
            }
            match deferred.take() {
                // While failed, segments are left as they are for the rollback; the next
                // flush asks again.
                Some(Message::Truncate(_)) if self.rollback.is_some() => {}
                Some(Message::Truncate(seq)) => self.truncate(seq),
                Some(Message::Sync(done)) => {
                    let _ = done.send(());
                }
                other => deferred = other,
            }
        }
        if self.rollback.is_some() {
            self.last_attempt = None;
            self.try_recover();
            if self.rollback.is_some() {
                tracing::error!(
                    "write-ahead log still failed at shutdown: bytes of the batches refused since \
                     may be replayed at the next start"
                );
            }
        } else if let Some(active) = self.active.as_mut() {
            let _ = active.flush().and_then(|_| active.get_mut().sync_data());
        }
    }

    fn commit(&mut self, group: Vec<(Bytes, ApplyFn, oneshot::Sender<Result<u64>>)>) {
        if let Some(reason) = self.failure.reason() {
            for (_, _, done) in group {
                let _ = done.send(Err(Error::Unavailable(reason.clone())));
            }
            return;
        }
        let started = Instant::now();
        let records = group.len();
        let checkpoint = Checkpoint {
            segments: self.segments.len(),
            last_len: if self.active.is_some() {
                self.active_size
            } else {
                self.segments.last().map_or(0, |s| s.2)
            },
        };
        let mut pending = Vec::with_capacity(records);
        let mut written = Ok(());
        let mut bytes = 0;
        for (payload, apply, done) in group {
            let seq = self.next_seq;
            if written.is_ok() {
                written = self.write(seq, &payload);
                bytes += payload.len() + HEADER;
            }
            self.next_seq += 1;
            pending.push(Pending { seq, apply, done });
        }
        let written = written.and_then(|_| self.sync());
        match written {
            Ok(()) => {
                self.observer
                    .fsynced(records, bytes, started.elapsed().as_secs_f64());
                for p in pending {
                    (p.apply)(p.seq);
                    let _ = p.done.send(Ok(p.seq));
                }
                self.report_size();
            }
            Err(e) => {
                let reason = format!("write-ahead log write failed: {e}");
                tracing::error!(error = %e, "write-ahead log write failed; refusing new batches until it is rolled back");
                self.failure.set(Some(reason.clone()));
                // The group's bytes still in the buffer are dropped, never written.
                if let Some(active) = self.active.take() {
                    let _ = active.into_parts();
                }
                self.active_size = 0;
                self.rollback = Some(checkpoint);
                self.last_attempt = Some(Instant::now());
                for p in pending {
                    let _ = p.done.send(Err(Error::Unavailable(reason.clone())));
                }
            }
        }
    }

    /// Rolls a failed group back (see the module docs), at most once per interval; clears the
    /// failure when it succeeds.
    fn try_recover(&mut self) {
        let Some(checkpoint) = self.rollback else {
            return;
        };
        if self
            .last_attempt
            .is_some_and(|t| t.elapsed() < RECOVERY_INTERVAL)
        {
            return;
        }
        self.last_attempt = Some(Instant::now());
        match self.roll_back(checkpoint) {
            Ok(()) => {
                self.rollback = None;
                self.failure.set(None);
                tracing::warn!(
                    "write-ahead log rolled back its failed batches and accepts batches again"
                );
                self.report_size();
            }
            Err(e) => {
                tracing::warn!(error = %e, "write-ahead log still failing; retrying");
            }
        }
    }

    fn roll_back(&mut self, checkpoint: Checkpoint) -> Result<()> {
        while self.segments.len() > checkpoint.segments {
            let (_, path, _) = &self.segments[self.segments.len() - 1];
            match self.disk.remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e.into()),
            }
            self.segments.pop();
        }
        if let Some(last) = self.segments.last_mut()
            && last.2 != checkpoint.last_len
        {
            self.disk.truncate(&last.1, checkpoint.last_len)?;
            last.2 = checkpoint.last_len;
        }
        self.disk.sync_dir(&self.dir)?;
        Ok(())
    }

    fn write(&mut self, seq: u64, payload: &[u8]) -> Result<()> {
        if self.active.is_none() || self.active_size >= self.segment_bytes {
            self.rotate(seq)?;
        }
        let active = self
            .active
            .as_mut()
            .ok_or_else(|| Error::Unavailable("write-ahead log has no active segment".into()))?;
        active.write_all(&encode_header(seq, payload))?;
        active.write_all(payload)?;
        let size = (HEADER + payload.len()) as u64;
        self.active_size += size;
        if let Some(last) = self.segments.last_mut() {
            last.2 += size;
        }
        Ok(())
    }

    fn sync(&mut self) -> Result<()> {
        if let Some(active) = self.active.as_mut() {
            active.flush()?;
            active.get_mut().sync_data()?;
        }
        Ok(())
    }

    fn rotate(&mut self, first_seq: u64) -> Result<()> {
        self.sync()?;
        let path = self.dir.join(segment_name(first_seq));
        let file = self.disk.open_append(&path)?;
        self.disk.sync_dir(&self.dir)?;
        self.active = Some(BufWriter::with_capacity(1 << 20, file));
        self.active_size = 0;
        self.segments.push((first_seq, path, 0));
        Ok(())
    }

    fn truncate(&mut self, flushed_seq: u64) {
        let last_written = self.next_seq.saturating_sub(1);
        // The active segment goes too when everything in it is flushed; the next append
        // starts a fresh one.
        if self.active.is_some() && last_written <= flushed_seq {
            self.active = None;
            self.active_size = 0;
        }
        let mut keep = Vec::new();
        let segments = std::mem::take(&mut self.segments);
        let count = segments.len();
        for (i, segment) in segments.iter().enumerate() {
            let last_seq = segments
                .get(i + 1)
                .map(|next| next.0.saturating_sub(1))
                .unwrap_or(last_written);
            let is_active = i + 1 == count && self.active.is_some();
            if !is_active && last_seq <= flushed_seq {
                if let Err(e) = self.disk.remove_file(&segment.1) {
                    tracing::warn!(segment = %segment.1.display(), error = %e, "could not delete flushed segment");
                    keep.push(segment.clone());
                }
            } else {
                keep.push(segment.clone());
            }
        }
        self.segments = keep;
        self.report_size();
    }

    fn report_size(&self) {
        let bytes = self.segments.iter().map(|s| s.2).sum();
        self.observer.size(self.segments.len(), bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::RealDisk;
    use crate::disk::faulty::FaultyDisk;
    use crate::disk::model::PowerCutDisk;
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Quiet;
    impl WalObserver for Quiet {
        fn fsynced(&self, _: usize, _: usize, _: f64) {}
        fn size(&self, _: usize, _: u64) {}
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    fn write(dir: &Path, next_seq: u64, segment_bytes: u64, payloads: &[&[u8]]) -> Vec<u64> {
        let (wal, thread) = WalHandle::start(
            dir.into(),
            next_seq,
            segment_bytes,
            Arc::new(Quiet),
            RealDisk::shared(),
        )
        .unwrap();
        let applied = Arc::new(Mutex::new(Vec::new()));
        let seqs = runtime().block_on(async {
            let mut seqs = Vec::new();
            for p in payloads {
                let a = applied.clone();
                let seq = wal
                    .append(
                        Bytes::copy_from_slice(p),
                        Box::new(move |s| a.lock().unwrap().push(s)),
                    )
                    .await
                    .unwrap();
                seqs.push(seq);
            }
            seqs
        });
        drop(wal);
        thread.join().unwrap();
        assert_eq!(
            *applied.lock().unwrap(),
            seqs,
            "apply runs in sequence order"
        );
        seqs
    }

    #[test]
    fn records_come_back_in_order_across_segments() {
        let dir = tempfile::tempdir().unwrap();
        let payloads: Vec<Vec<u8>> = (0..50u8).map(|i| vec![i; 100 + i as usize]).collect();
        let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_slice()).collect();
        let seqs = write(dir.path(), 1, 1000, &refs);
        assert_eq!(seqs, (1..=50).collect::<Vec<_>>());
        assert!(list_segments(dir.path()).unwrap().len() > 3);
        let report = replay(&RealDisk, dir.path(), 0).unwrap();
        assert_eq!(report.next_seq, 51);
        let got: Vec<Vec<u8>> = report.records.into_iter().map(|r| r.payload).collect();
        assert_eq!(got, payloads);
        // Records at or below the flushed sequence number are skipped.
        assert_eq!(replay(&RealDisk, dir.path(), 40).unwrap().records.len(), 10);
    }

    #[test]
    fn a_torn_tail_is_truncated_and_later_records_append_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 1, 1 << 20, &[b"alpha", b"beta", b"gamma"]);
        let (_, path) = list_segments(dir.path()).unwrap().pop().unwrap();
        let len = fs::metadata(&path).unwrap().len();
        // Cut the last record in half, as a crash mid-write would.
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 3)
            .unwrap();
        let report = replay(&RealDisk, dir.path(), 0).unwrap();
        assert_eq!(report.records.len(), 2);
        assert_eq!(report.torn_bytes, (HEADER + 5 - 3) as u64);
        assert_eq!(report.next_seq, 3);
        write(dir.path(), report.next_seq, 1 << 20, &[b"delta"]);
        let report = replay(&RealDisk, dir.path(), 0).unwrap();
        let got: Vec<&[u8]> = report
            .records
            .iter()
            .map(|r| r.payload.as_slice())
            .collect();
        assert_eq!(got, [&b"alpha"[..], b"beta", b"delta"]);
    }

    #[test]
    fn a_flipped_bit_fails_the_crc() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), 1, 1 << 20, &[b"alpha", b"beta"]);
        let (_, path) = list_segments(dir.path()).unwrap().pop().unwrap();
        let mut data = fs::read(&path).unwrap();
        let last = data.len() - 1;
        data[last] ^= 1;
        fs::write(&path, data).unwrap();
        let report = replay(&RealDisk, dir.path(), 0).unwrap();
        assert_eq!(report.records.len(), 1);
        assert!(report.torn_bytes > 0);
    }

    /// Flips one bit at `offset` of `path`.
    fn flip(path: &Path, offset: usize) {
        let mut data = fs::read(path).unwrap();
        data[offset] ^= 0x10;
        fs::write(path, data).unwrap();
    }

    fn damaged_files(dir: &Path) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = fs::read_dir(dir.join(DAMAGED_DIR))
            .map(|r| r.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default();
        files.sort();
        files
    }

    #[test]
    fn damage_inside_the_last_segment_is_set_aside_and_every_later_record_replays() {
        let dir = tempfile::tempdir().unwrap();
        let words: [&[u8]; 5] = [b"alpha", b"beta", b"gamma", b"delta", b"epsilon"];
        write(dir.path(), 1, 1 << 20, &words);
        let (_, path) = list_segments(dir.path()).unwrap().pop().unwrap();
        let size = fs::metadata(&path).unwrap().len();
        // A bit of "beta"'s payload: the second record starts after the first.
        let beta_at = HEADER + 5;
        flip(&path, beta_at + HEADER + 1);
        let report = replay(&RealDisk, dir.path(), 0).unwrap();
        let got: Vec<&[u8]> = report
            .records
            .iter()
            .map(|r| r.payload.as_slice())
            .collect();
        assert_eq!(got, [&b"alpha"[..], b"gamma", b"delta", b"epsilon"]);
        assert_eq!((report.damaged_ranges, report.torn_bytes), (1, 0));
        assert_eq!(report.damaged_bytes, (HEADER + 4) as u64);
        assert_eq!(fs::metadata(&path).unwrap().len(), size, "nothing was cut");
        let kept = damaged_files(dir.path());
        assert_eq!(kept.len(), 1, "{kept:?}");
        let damaged = fs::read(&path).unwrap()[beta_at..beta_at + HEADER + 4].to_vec();
        assert_eq!(
            fs::read(&kept[0]).unwrap(),
            damaged,
            "the damaged bytes, as they were"
        );
        assert_eq!(report.next_seq, 6);
    }

    #[test]
    fn damage_inside_an_older_segment_no_longer_skips_the_rest_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let payloads: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; 90]).collect();
        let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_slice()).collect();
        write(dir.path(), 1, 500, &refs);
        let segments = list_segments(dir.path()).unwrap();
        assert!(segments.len() >= 4);
        // The first record of the first segment: everything after it in that segment stays.
        flip(&segments[0].1, 3);
        let report = replay(&RealDisk, dir.path(), 0).unwrap();
        assert_eq!(report.records.len(), 39);
        assert_eq!(
            report.records[0].seq, 2,
            "the damaged record alone is missing"
        );
        assert_eq!(report.damaged_ranges, 1);
        assert_eq!(damaged_files(dir.path()).len(), 1);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Bit flips anywhere in a log of several segments: every record no flip touched
        /// replays, nothing is invented, and every byte is accounted for — replayed, or set
        /// aside in `damaged/`.
        #[test]
        fn bit_flips_lose_only_the_records_they_touch(
            sizes in proptest::collection::vec(1usize..200, 1..40),
            flips in proptest::collection::vec((0usize..64, 0usize..10_000), 1..4),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let payloads: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, n)| (0..*n).map(|j| (i * 31 + j * 7) as u8).collect())
                .collect();
            let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_slice()).collect();
            write(dir.path(), 1, 600, &refs);
            let segments = list_segments(dir.path()).unwrap();
            // Where each record lies: (segment, start, end).
            let mut spans = Vec::new();
            for (_, path) in &segments {
                let data = fs::read(path).unwrap();
                let mut o = 0;
                while o < data.len() {
                    let (_, payload) =
                        parse_record(&data[o..], &|_| true, &mut crc32fast::hash).unwrap();
                    spans.push((path.clone(), o, o + HEADER + payload.len()));
                    o += HEADER + payload.len();
                }
            }
            let total: u64 = segments.iter().map(|(_, p)| fs::metadata(p).unwrap().len()).sum();
            let mut touched = std::collections::BTreeSet::new();
            for (segment, at) in &flips {
                let path = &segments[segment % segments.len()].1;
                let len = fs::metadata(path).unwrap().len() as usize;
                let at = at % len;
                flip(path, at);
                for (i, (p, start, end)) in spans.iter().enumerate() {
                    if p == path && (*start..*end).contains(&at) {
                        touched.insert(i);
                    }
                }
            }
            let report = replay(&RealDisk, dir.path(), 0).unwrap();
            let got: std::collections::BTreeMap<u64, Vec<u8>> =
                report.records.iter().map(|r| (r.seq, r.payload.clone())).collect();
            for (i, payload) in payloads.iter().enumerate() {
                let seq = i as u64 + 1;
                if !touched.contains(&i) {
                    proptest::prop_assert_eq!(got.get(&seq), Some(payload), "record {} lost", seq);
                }
            }
            for (seq, payload) in &got {
                proptest::prop_assert_eq!(&payloads[(*seq - 1) as usize], payload, "record {} invented", seq);
            }
            let replayed: u64 = report.records.iter().map(|r| (HEADER + r.payload.len()) as u64).sum();
            proptest::prop_assert_eq!(replayed + report.damaged_bytes + report.torn_bytes, total);
            let kept: u64 = damaged_files(dir.path())
                .iter()
                .map(|p| fs::metadata(p).unwrap().len())
                .sum();
            proptest::prop_assert_eq!(kept, report.damaged_bytes + report.torn_bytes);
        }
    }

    /// A power cut at a random instant under concurrent appends: the disk keeps each segment
    /// only up to its last fsync, plus whatever garbage the unsynced tail left. Every record
    /// acknowledged before the cut replays, byte for byte. (Acknowledging before the fsync
    /// would fail this: the cut would take acknowledged records with it.)
    #[test]
    fn a_power_cut_keeps_every_acknowledged_record() {
        for case in 0u64..12 {
            let dir = tempfile::tempdir().unwrap();
            let disk = PowerCutDisk::new(u64::MAX);
            let (wal, thread) = WalHandle::start(
                dir.path().into(),
                1,
                2048,
                Arc::new(Quiet),
                Arc::new(disk.clone()),
            )
            .unwrap();
            // What a power cut leaves, imaged at the cut.
            let cut = tempfile::tempdir().unwrap();
            let acked: Arc<Mutex<BTreeMap<u64, Vec<u8>>>> = Arc::default();
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let seen = runtime.block_on(async {
                let mut writers = Vec::new();
                for w in 0..4u64 {
                    let (wal, acked) = (wal.clone(), acked.clone());
                    writers.push(tokio::spawn(async move {
                        for i in 0..150u64 {
                            let size = 1 + ((case * 7919 + w * 104_729 + i * 31) % 300) as usize;
                            let payload: Vec<u8> =
                                (0..size).map(|j| (w * 37 + i + j as u64) as u8).collect();
                            let copy = payload.clone();
                            let seq = wal
                                .append(Bytes::from(payload), Box::new(|_| {}))
                                .await
                                .unwrap();
                            acked.lock().unwrap().insert(seq, copy);
                        }
                    }));
                }
                // The cut: after some acknowledgements, wherever the writer then is.
                let at = 20 + (case as usize * 41) % 400;
                while acked.lock().unwrap().len() < at {
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                let seen = acked.lock().unwrap().clone();
                disk.materialise(dir.path(), cut.path()).unwrap();
                for w in writers {
                    w.await.unwrap();
                }
                seen
            });
            drop(wal);
            thread.join().unwrap();

            // Part of the unsynced tail of the newest segment reached the platter, scrambled.
            let cut_wal = cut.path();
            if let Some((_, newest)) = list_segments(cut_wal).unwrap().pop() {
                let kept = fs::read(&newest).unwrap();
                let live =
                    fs::read(dir.path().join(newest.file_name().unwrap())).unwrap_or_default();
                let tail: Vec<u8> = live
                    .iter()
                    .skip(kept.len())
                    .take(40)
                    .map(|b| b ^ 0x5a)
                    .collect();
                let mut scrambled = kept;
                scrambled.extend(tail);
                fs::write(&newest, scrambled).unwrap();
            }
            let report = replay(&RealDisk, cut.path(), 0).unwrap();
            let replayed: BTreeMap<u64, Vec<u8>> = report
                .records
                .into_iter()
                .map(|r| (r.seq, r.payload))
                .collect();
            assert!(!seen.is_empty());
            for (seq, payload) in &seen {
                assert_eq!(
                    replayed.get(seq),
                    Some(payload),
                    "case {case}: acknowledged record {seq} lost"
                );
            }
            for (seq, payload) in &replayed {
                let all = acked.lock().unwrap();
                assert_eq!(
                    all.get(seq),
                    Some(payload),
                    "case {case}: record {seq} invented"
                );
            }
        }
    }

    fn append(
        wal: &WalHandle,
        payload: &'static [u8],
        applied: &Arc<Mutex<Vec<u64>>>,
    ) -> impl std::future::Future<Output = Result<u64>> + use<> {
        let (wal, applied) = (wal.clone(), applied.clone());
        async move {
            wal.append(
                Bytes::from_static(payload),
                Box::new(move |s| applied.lock().unwrap().push(s)),
            )
            .await
        }
    }

    fn payloads(dir: &Path) -> Vec<(u64, Vec<u8>)> {
        let report = replay(&RealDisk, dir, 0).unwrap();
        report
            .records
            .into_iter()
            .map(|r| (r.seq, r.payload))
            .collect()
    }

    #[test]
    fn a_failed_group_is_refused_rolled_back_healed_and_never_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(FaultyDisk::default());
        let (wal, thread) =
            WalHandle::start(dir.path().into(), 1, 1 << 20, Arc::new(Quiet), disk.clone()).unwrap();
        let applied = Arc::new(Mutex::new(Vec::new()));
        runtime().block_on(async {
            assert_eq!(append(&wal, b"alpha", &applied).await.unwrap(), 1);
            disk.fail_syncs(u32::MAX);
            let e = append(&wal, b"refused", &applied).await.unwrap_err();
            assert!(e.to_string().contains("os error 28"), "{e}");
            assert!(wal.is_failed() && wal.failure().is_some());
            // Refused at once while failed, without a sequence number.
            let e = append(&wal, b"also refused", &applied).await.unwrap_err();
            assert!(e.to_string().contains("retrying every 1 s"), "{e}");
            disk.fail_syncs(0);
            let deadline = Instant::now() + Duration::from_secs(10);
            while wal.is_failed() {
                assert!(Instant::now() < deadline, "the log never healed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(append(&wal, b"delta", &applied).await.unwrap(), 3);
        });
        drop(wal);
        thread.join().unwrap();
        assert_eq!(
            *applied.lock().unwrap(),
            [1, 3],
            "a refused batch is never applied"
        );
        assert_eq!(
            payloads(dir.path()),
            [(1, b"alpha".to_vec()), (3, b"delta".to_vec())]
        );
    }

    #[test]
    fn a_failed_group_is_not_written_at_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(FaultyDisk::default());
        let (wal, thread) =
            WalHandle::start(dir.path().into(), 1, 1 << 20, Arc::new(Quiet), disk.clone()).unwrap();
        let applied = Arc::new(Mutex::new(Vec::new()));
        runtime().block_on(async {
            append(&wal, b"alpha", &applied).await.unwrap();
            // Written into the segment's buffer, then the fsync fails.
            disk.fail_syncs(1);
            append(&wal, b"refused", &applied).await.unwrap_err();
        });
        // Shut down while failed: the group's buffered bytes are dropped, not flushed.
        drop(wal);
        thread.join().unwrap();
        assert_eq!(payloads(dir.path()), [(1, b"alpha".to_vec())]);
    }

    #[test]
    fn a_failed_group_that_started_a_segment_takes_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let disk = Arc::new(FaultyDisk::default());
        // Segments of ~one record: the next append starts a new segment.
        let (wal, thread) =
            WalHandle::start(dir.path().into(), 1, 10, Arc::new(Quiet), disk.clone()).unwrap();
        let applied = Arc::new(Mutex::new(Vec::new()));
        runtime().block_on(async {
            append(&wal, b"alpha", &applied).await.unwrap();
            assert_eq!(list_segments(dir.path()).unwrap().len(), 1);
            // The rotation's fsync of the old segment passes, the new segment's fails.
            disk.fail_writes(1);
            append(&wal, b"refused", &applied).await.unwrap_err();
        });
        drop(wal);
        thread.join().unwrap();
        assert_eq!(
            list_segments(dir.path()).unwrap().len(),
            1,
            "the new segment is gone"
        );
        assert_eq!(payloads(dir.path()), [(1, b"alpha".to_vec())]);
    }

    /// Issue 45 item 10: resynchronising inside a torn record checks each offset's sequence
    /// number before any CRC. A torn payload whose bytes read as small lengths at every fourth
    /// offset made the first design hash ~4 KiB there, a gigabyte for one MiB of tail (and
    /// megabytes per offset for a torn 64 MiB record).
    #[test]
    fn a_resync_inside_a_torn_record_hashes_nothing_that_cannot_be_a_record() {
        let torn: Vec<u8> = [0x00u8, 0x10, 0x00, 0x00]
            .iter()
            .copied()
            .cycle()
            .take(1 << 20)
            .collect();
        let plausible = |seq: u64| (5..5 + MAX_SEQ_GAP).contains(&seq);
        let mut hashed = 0usize;
        let found = resync(&torn, 1, &plausible, &mut |bytes: &[u8]| {
            hashed += bytes.len();
            crc32fast::hash(bytes)
        });
        assert_eq!(found, None);
        assert_eq!(hashed, 0, "{hashed} bytes hashed");
        // A real record after the damage is still found, and only it is hashed.
        let mut data = torn;
        let at = data.len();
        data.extend_from_slice(&encode_header(7, b"payload"));
        data.extend_from_slice(b"payload");
        let mut hashed = 0usize;
        let found = resync(&data, 1, &plausible, &mut |bytes: &[u8]| {
            hashed += bytes.len();
            crc32fast::hash(bytes)
        });
        assert_eq!(found, Some(at));
        assert_eq!(hashed, 8 + b"payload".len());
    }

    #[test]
    fn truncate_deletes_only_fully_flushed_segments() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, thread) = WalHandle::start(
            dir.path().into(),
            1,
            300,
            Arc::new(Quiet),
            RealDisk::shared(),
        )
        .unwrap();
        runtime().block_on(async {
            for _ in 0..10 {
                wal.append(Bytes::from(vec![7u8; 200]), Box::new(|_| {}))
                    .await
                    .unwrap();
            }
            wal.truncate(5);
            wal.barrier().await;
        });
        let report = replay(&RealDisk, dir.path(), 0).unwrap();
        let seqs: Vec<u64> = report.records.iter().map(|r| r.seq).collect();
        assert!(seqs.iter().all(|&s| s >= 6 - 1), "{seqs:?}");
        assert!(seqs.contains(&6) && seqs.contains(&10), "{seqs:?}");
        runtime().block_on(async {
            wal.truncate(10);
            wal.barrier().await;
        });
        assert!(list_segments(dir.path()).unwrap().is_empty());
        drop(wal);
        thread.join().unwrap();
    }
}
