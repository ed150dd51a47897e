//! The sender thread: turns queued records into batches and delivers them, in order, without
//! ever making the training thread wait.
//!
//! Every sealed batch gets the next sequence number of this agent session and so its
//! `Idempotency-Key`, then joins the **backlog**: a bounded in-memory queue while the collector
//! answers, the disk spool as soon as it does not (and for whatever outgrows memory). The
//! thread delivers the backlog head first, always, so batches reach the collector in the order
//! they were sealed. A failed attempt schedules the next one by `Backoff` (the collector's
//! `Retry-After` as a floor); the thread never sleeps, it waits on the queue with a timeout, so
//! records keep being drained and batched while the collector is away.
//!
//! Flush and shutdown are requests with deadlines: the thread seals what it has, tries the
//! backlog once regardless of backoff, and reports back; at shutdown whatever is still
//! undelivered goes to the spool (or, without one, is counted as dropped).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rankwatch_analytics::{RunInfo, SketchRecord, vocab};

use crate::backoff::Backoff;
use crate::config::{AgentConfig, Mode};
use crate::encode::{self, Row, Table};
use crate::record::{Metric, Point, Record};
use crate::spool::{Aside, Batch, Spool};
use crate::stats::Stats;
use crate::transport::{Outcome, Transport};

/// A message on the queue.
#[derive(Debug)]
pub(crate) enum Msg {
    Record(Record),
    /// Look at the control flags now.
    Wake,
}

/// Requests from the owning [`crate::Agent`], answered through the condition variable.
#[derive(Debug, Default)]
pub(crate) struct Control {
    pub(crate) flush_requested: u64,
    pub(crate) flush_done: u64,
    pub(crate) flush_deadline: Option<Instant>,
    pub(crate) shutdown_deadline: Option<Instant>,
    pub(crate) exited: bool,
}

/// State shared between the agent handle and its thread.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub(crate) stats: Stats,
    pub(crate) control: Mutex<Control>,
    pub(crate) changed: Condvar,
}

impl Shared {
    pub(crate) fn control(&self) -> std::sync::MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `done` holds for the control state, or `deadline`; returns whether it held.
    pub(crate) fn wait_until(&self, deadline: Instant, done: impl Fn(&Control) -> bool) -> bool {
        let mut c = self.control();
        while !done(&c) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            c = self
                .changed
                .wait_timeout(c, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

/// Batches waiting for delivery: memory first, disk when the collector is away or memory is full.
#[derive(Debug)]
struct Backlog {
    memory: VecDeque<Batch>,
    memory_bytes: u64,
    memory_cap: u64,
    spool: Option<Spool>,
}

impl Backlog {
    fn push(&mut self, batch: Batch, prefer_disk: bool, stats: &Stats) {
        let memory_full = self.memory_bytes + batch.body.len() as u64 > self.memory_cap;
        if let Some(spool) = &mut self.spool
            && (prefer_disk || memory_full || !spool.is_empty())
        {
            match spool.append(&batch) {
                Ok(true) => {}
                Ok(false) => {
                    stats.dropped_spool_full.fetch_add(batch.rows, Relaxed);
                }
                Err(e) => {
                    stats.dropped_spool_full.fetch_add(batch.rows, Relaxed);
                    stats.error(e.to_string());
                }
            }
        } else if memory_full {
            stats.dropped_spool_full.fetch_add(batch.rows, Relaxed);
        } else {
            self.memory_bytes += batch.body.len() as u64;
            self.memory.push_back(batch);
        }
        self.publish(stats);
    }

    fn head(&mut self) -> Option<&Batch> {
        if let Some(batch) = self.memory.front() {
            return Some(batch);
        }
        self.spool.as_mut().and_then(Spool::head)
    }

    fn pop(&mut self, stats: &Stats) {
        if let Some(batch) = self.memory.pop_front() {
            self.memory_bytes -= batch.body.len() as u64;
        } else if let Some(spool) = &mut self.spool {
            spool.pop();
        }
        self.publish(stats);
    }

    /// Moves memory to disk, so a process that dies while the collector is away keeps them.
    fn spill(&mut self, stats: &Stats) {
        if self.spool.is_none() {
            return;
        }
        while let Some(batch) = self.memory.pop_front() {
            self.memory_bytes -= batch.body.len() as u64;
            self.push(batch, true, stats);
        }
    }

    fn len(&self) -> u64 {
        self.memory.len() as u64 + self.spool.as_ref().map_or(0, Spool::records)
    }

    fn publish(&self, stats: &Stats) {
        stats.backlog_batches.store(self.len(), Relaxed);
        if let Some(spool) = &self.spool {
            stats.spooled_batches.store(spool.records(), Relaxed);
            stats.spool_bytes.store(spool.bytes(), Relaxed);
            stats.spool_corrupt.store(spool.corrupt(), Relaxed);
        }
    }
}

/// The sender thread's state.
pub(crate) struct Sender {
    config: AgentConfig,
    session: String,
    shared: Arc<Shared>,
    rx: Receiver<Msg>,
    transport: Option<Transport>,
    backlog: Backlog,
    backoff: Backoff,
    retry_at: Option<Instant>,
    /// The collector's own `Retry-After`: honoured even by flush and shutdown.
    not_before: Option<Instant>,
    seq: u64,
    rows: Vec<Row>,
    sketches: Vec<SketchRecord>,
    info: Option<RunInfo>,
    first_pending: Option<Instant>,
    last_step: u64,
    reported_dropped: u64,
    dropped_metric: Metric,
    /// Where batches the collector refused are kept (`refused/` beside the spool): nothing is
    /// lost to a limit that can be raised (`422`, the series limit) or a collector that can be
    /// upgraded; `rankwatch sync` sends them again. `None` without a spool directory.
    refused: Option<Aside>,
}

impl Sender {
    pub(crate) fn new(
        config: AgentConfig,
        session: String,
        shared: Arc<Shared>,
        rx: Receiver<Msg>,
        spool: Option<Spool>,
    ) -> Sender {
        let transport = (config.mode == Mode::Online).then(|| {
            Transport::new(
                &config.collector,
                config.token.as_deref(),
                config.connect_timeout,
            )
        });
        let backlog = Backlog {
            memory: VecDeque::new(),
            memory_bytes: 0,
            memory_cap: config.memory_backlog_bytes,
            spool,
        };
        backlog.publish(&shared.stats);
        let refused = config.spool_dir.as_ref().map(|dir| {
            Aside::new(
                dir.join(crate::REFUSED_DIR),
                config.spool_max_bytes,
                config.segment_bytes,
            )
        });
        Sender {
            backoff: Backoff::new(config.backoff_base, config.backoff_cap),
            config,
            session,
            shared,
            rx,
            transport,
            backlog,
            retry_at: None,
            not_before: None,
            seq: 0,
            rows: Vec::new(),
            sketches: Vec::new(),
            info: None,
            first_pending: None,
            last_step: 0,
            reported_dropped: 0,
            dropped_metric: vocab::Metric::Dropped.into(),
            refused,
        }
    }

    /// The thread's body; returns when shut down (or when every agent handle is gone).
    pub(crate) fn run(mut self) {
        loop {
            let wait = self.next_wake().saturating_duration_since(Instant::now());
            let disconnected = match self.rx.recv_timeout(wait) {
                Ok(msg) => {
                    self.take(msg);
                    // Drain what else is there without waiting, bounded so control stays live.
                    for _ in 0..4096 {
                        match self.rx.try_recv() {
                            Ok(msg) => self.take(msg),
                            Err(_) => break,
                        }
                    }
                    false
                }
                Err(RecvTimeoutError::Timeout) => false,
                Err(RecvTimeoutError::Disconnected) => true,
            };
            let (flush, shutdown) = {
                let c = self.shared.control();
                (
                    (c.flush_requested > c.flush_done)
                        .then_some((c.flush_requested, c.flush_deadline)),
                    c.shutdown_deadline,
                )
            };
            if let Some(deadline) =
                shutdown.or(disconnected.then(|| Instant::now() + Duration::from_secs(2)))
            {
                self.finish(deadline);
                return;
            }
            if self.rows.len() >= self.config.batch_rows
                || self
                    .first_pending
                    .is_some_and(|t| t.elapsed() >= self.config.batch_interval)
                || flush.is_some()
            {
                self.seal();
            }
            match flush {
                Some((ticket, deadline)) => {
                    self.deliver(true, deadline);
                    if let Some(spool) = &mut self.backlog.spool {
                        spool.sync();
                    }
                    let mut c = self.shared.control();
                    c.flush_done = c.flush_done.max(ticket);
                    self.shared.changed.notify_all();
                }
                None => self.deliver(false, None),
            }
        }
    }

    fn next_wake(&self) -> Instant {
        let far = Instant::now() + Duration::from_secs(3600);
        let batch = self
            .first_pending
            .map_or(far, |t| t + self.config.batch_interval);
        let retry = match (self.retry_at, self.backlog.len()) {
            (Some(t), n) if n > 0 => t,
            _ => far,
        };
        batch.min(retry)
    }

    fn take(&mut self, msg: Msg) {
        let Msg::Record(record) = msg else {
            return;
        };
        let rows = record.rows();
        self.shared.stats.queued_values.fetch_sub(rows, Relaxed);
        self.first_pending.get_or_insert_with(Instant::now);
        match record {
            Record::Points {
                step,
                time_ms,
                points,
            } => {
                self.last_step = self.last_step.max(step);
                self.rows.extend(points.into_iter().map(|point| Row {
                    step,
                    time_ms,
                    point,
                }));
            }
            Record::Sketch(sketch) => self.sketches.push(sketch),
            Record::Info(info) => self.info = Some(info),
        }
    }

    /// Turns everything pending into batches on the backlog.
    fn seal(&mut self) {
        let dropped = self.shared.stats.dropped();
        if dropped != self.reported_dropped {
            // The cumulative count rides along with the data, so the collector and the UI see
            // losses even when the batch carrying an earlier count was itself lost.
            self.reported_dropped = dropped;
            self.rows.push(Row {
                step: self.last_step,
                time_ms: now_ms(),
                point: Point {
                    metric: self.dropped_metric.clone(),
                    rank: Some(self.config.rank),
                    layer: None,
                    site: None,
                    value: dropped as f64,
                },
            });
        }
        self.first_pending = None;
        let prefer_disk = self.retry_at.is_some() || self.transport.is_none();
        if let Some(info) = self.info.take() {
            match encode::runs_body(&info) {
                Ok(body) => self.enqueue(Table::Runs, 1, body, prefer_disk),
                Err(e) => self.encode_failed(1, e),
            }
        }
        // Sketches before samples: the collector's aligner closes step s once every rank's
        // samples have passed it, so a rank's sketch of s must be there by then.
        let sketches = std::mem::take(&mut self.sketches);
        for chunk in sketches.chunks(256) {
            match encode::sketches_body(chunk) {
                Ok(body) => self.enqueue(Table::Sketches, chunk.len() as u64, body, prefer_disk),
                Err(e) => self.encode_failed(chunk.len() as u64, e),
            }
        }
        let rows = std::mem::take(&mut self.rows);
        for chunk in rows.chunks(self.config.batch_rows) {
            match encode::samples_body(&self.config.run, chunk) {
                Ok(body) => self.enqueue(Table::Samples, chunk.len() as u64, body, prefer_disk),
                Err(e) => self.encode_failed(chunk.len() as u64, e),
            }
        }
    }

    fn encode_failed(&self, rows: u64, e: crate::Error) {
        self.shared.stats.refused_rows.fetch_add(rows, Relaxed);
        self.shared.stats.error(e.to_string());
    }

    fn enqueue(&mut self, table: Table, rows: u64, body: Vec<u8>, prefer_disk: bool) {
        self.seq += 1;
        let key = crate::wire::idempotency_key(
            &self.config.run,
            self.config.rank,
            &self.session,
            self.seq,
        );
        let batch = Batch {
            table,
            key,
            rows,
            body,
        };
        self.backlog.push(batch, prefer_disk, &self.shared.stats);
    }

    /// Sends the backlog head by head until it is empty, an attempt fails, or `deadline`.
    /// `force` ignores the backoff schedule (flush and shutdown try once more regardless).
    fn deliver(&mut self, force: bool, deadline: Option<Instant>) {
        let Some(transport) = &self.transport else {
            return;
        };
        let stats = &self.shared.stats;
        loop {
            let now = Instant::now();
            if !force && self.retry_at.is_some_and(|t| now < t) {
                return;
            }
            if let Some(t) = self.not_before.filter(|&t| now < t) {
                // The collector asked for a pause. A flush or shutdown waits it out within its
                // deadline (the caller is waiting anyway); normal delivery comes back later.
                match deadline {
                    Some(d) if force && t < d => std::thread::sleep(t - now),
                    _ => return,
                }
                continue;
            }
            let mut timeout = self.config.request_timeout;
            if let Some(deadline) = deadline {
                if now >= deadline {
                    return;
                }
                timeout = timeout.min(deadline - now);
            }
            let Some(batch) = self.backlog.head() else {
                return;
            };
            let rows = batch.rows;
            match transport.post(batch, timeout) {
                Outcome::Delivered { duplicate } => {
                    stats.sent_rows.fetch_add(rows, Relaxed);
                    stats.sent_batches.fetch_add(1, Relaxed);
                    if duplicate {
                        stats.duplicates.fetch_add(1, Relaxed);
                    }
                    stats.connected.store(true, Relaxed);
                    stats.ever_connected.store(true, Relaxed);
                    self.backlog.pop(stats);
                    self.backoff.reset();
                    self.retry_at = None;
                    self.not_before = None;
                }
                Outcome::Retry { after, reason } => {
                    stats.retries.fetch_add(1, Relaxed);
                    stats.connected.store(false, Relaxed);
                    stats.error(reason);
                    let first_failure = self.retry_at.is_none();
                    self.retry_at = Some(Instant::now() + self.backoff.next(after));
                    self.not_before = after.map(|a| Instant::now() + a);
                    if first_failure {
                        self.backlog.spill(stats);
                    }
                    // A collector that answered "busy, come back in N s" is alive: a flush
                    // waits for it within its deadline. One that did not answer is not
                    // retried here, so finishing a run without a collector stays quick.
                    if !(force && after.is_some()) {
                        return;
                    }
                }
                Outcome::Refused { reason, .. } => {
                    stats.connected.store(true, Relaxed);
                    stats.ever_connected.store(true, Relaxed);
                    // Kept unless there is no spool, or its `refused/` is full or failing
                    // (then counted as refused).
                    let kept = match (self.backlog.head(), self.refused.as_mut()) {
                        (Some(batch), Some(aside)) => aside.keep(batch).unwrap_or_else(|e| {
                            stats.error(format!("cannot keep a refused batch: {e}"));
                            false
                        }),
                        _ => false,
                    };
                    if kept {
                        stats.set_aside_rows.fetch_add(rows, Relaxed);
                        let dir = self.config.spool_dir.as_deref().unwrap_or(Path::new("."));
                        stats.error(format!(
                            "{reason}; its {rows} rows are kept in {}: fix the cause (a limit \
                             of the collector, or its version), then `rankwatch sync {}`",
                            dir.join(crate::REFUSED_DIR).display(),
                            dir.display()
                        ));
                    } else {
                        stats.refused_rows.fetch_add(rows, Relaxed);
                        stats.error(reason);
                    }
                    self.backlog.pop(stats);
                }
            }
        }
    }

    fn finish(&mut self, deadline: Instant) {
        self.seal();
        self.deliver(true, Some(deadline));
        let stats = &self.shared.stats;
        if self.backlog.spool.is_some() {
            self.backlog.spill(stats);
            if let Some(spool) = &mut self.backlog.spool {
                spool.sync();
            }
        } else {
            let lost: u64 = self.backlog.memory.drain(..).map(|b| b.rows).sum();
            self.backlog.memory_bytes = 0;
            if lost > 0 {
                stats.dropped_spool_full.fetch_add(lost, Relaxed);
                stats.error(format!(
                    "{lost} rows were still undelivered at shutdown and there is no spool to keep them"
                ));
            }
        }
        self.backlog.publish(stats);
        let mut c = self.shared.control();
        c.exited = true;
        c.flush_done = c.flush_requested;
        self.shared.changed.notify_all();
    }
}

/// Wall-clock milliseconds since the Unix epoch (the `time` of records).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
