//! The writer thread and its handle: group commit, rotation, truncation after flushes, and
//! the rollback of a failed group (see the module docs of [`super`]).

use std::fs;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::oneshot;

use super::WalObserver;
use super::format::{HEADER, encode_header, list_segments, segment_name};
use crate::disk::{DiskFile, SharedDisk};
use crate::error::{Error, Result};

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

enum Message {
    Append {
        payload: Bytes,
        apply: ApplyFn,
        done: oneshot::Sender<Result<u64>>,
    },
    Truncate(u64),
    Sync(oneshot::Sender<()>),
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
