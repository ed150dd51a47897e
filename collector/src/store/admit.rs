//! Admission and apply: what a batch must pass before it is logged (the hot-buffer budget,
//! the run and series caps, idempotency), and how a durable batch joins the hot buffer. The
//! caps count what admitted batches will add ([`Reservation`]) until they are applied or
//! fail, so batches in flight together cannot pass a cap one by one.

use arrow_array::RecordBatch;
use rankwatch_analytics::RunId;

use super::index::{BatchDigest, RunSummary};
use super::{Admission, Event, Reservation, State, Store, files};
use crate::entry::{Entry, Table};
use crate::error::{Error, Result};
use crate::idempotency::{Check, Key};

/// An entry as the store takes it: its parts in the file schema and its samples' digest, read
/// once, outside the store's lock (every other batch waits on it), for both [`Store::begin`]
/// and [`Store::apply`].
#[derive(Debug)]
pub struct Prepared {
    samples: Option<RecordBatch>,
    sketches: Option<RecordBatch>,
    digest: Option<BatchDigest>,
}

impl Prepared {
    pub fn of(entry: &Entry) -> Result<Prepared> {
        let samples = entry.samples.as_ref().map(files::without_run).transpose()?;
        let sketches = entry
            .sketches
            .as_ref()
            .map(files::without_run)
            .transpose()?;
        let digest = samples.as_ref().map(BatchDigest::of);
        Ok(Prepared {
            samples,
            sketches,
            digest,
        })
    }
}

impl Store {
    /// Refuses with 429 (and starts a flush) while the hot buffer is at twice its budget.
    fn check_budget(&self) -> Result<()> {
        let hot = self.lock().hot_bytes;
        self.budget_left(hot)
    }

    /// Waits until `deadline` at the latest for room in the hot buffer (below twice its
    /// budget), then refuses with 429 if there is still none. Ingest asks before it reads a
    /// body and again, against the same deadline, before it commits; the alert engine before
    /// it retries a refused derived batch.
    ///
    /// A flush takes the whole buffer the moment it starts, so the buffer is full only while
    /// one flush runs and the next waits for it, a fraction of a second. Refused at once, a
    /// client came back after its whole `Retry-After` second, and an alert behind its batch
    /// waited that second too (docs/performance.md, issue 47). Waiting here, the request
    /// holds a handler slot and, before its body is read, no memory: the body stays in the
    /// socket, the backpressure TCP gives.
    pub async fn room_until(&self, deadline: tokio::time::Instant) -> Result<()> {
        let started = tokio::time::Instant::now();
        let mut waited = false;
        let answer = loop {
            let freed = self.room_freed.notified();
            let mut freed = std::pin::pin!(freed);
            // Registered before the check: a flush between the check and the wait still wakes it.
            freed.as_mut().enable();
            match self.check_budget() {
                Err(Error::Backpressure { .. }) if tokio::time::Instant::now() < deadline => {}
                other => break other,
            }
            waited = true;
            if tokio::time::timeout_at(deadline, freed).await.is_err() {
                break self.check_budget();
            }
        };
        if waited {
            self.metrics.room_waits.inc();
            self.metrics
                .room_wait_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        answer
    }

    fn budget_left(&self, hot_bytes: usize) -> Result<()> {
        if hot_bytes >= self.limits.hot_budget_bytes.saturating_mul(2) {
            self.flush_wanted.notify_one();
            return Err(Error::Backpressure {
                bytes: hot_bytes,
                retry_after_s: 1,
            });
        }
        Ok(())
    }

    /// Admission control before a batch is logged: memory budget, cardinality, idempotency.
    pub fn begin(
        &self,
        key: Option<&Key>,
        entry: &Entry,
        prepared: &Prepared,
    ) -> Result<Admission> {
        let mut state = self.lock();
        if let Some(key) = key {
            match state.keys.begin(key) {
                Check::Applied => return Ok(Admission::Duplicate),
                Check::InFlight => return Err(Error::InFlight(key.to_string())),
                Check::New => {}
            }
        }
        let refuse = |state: &mut State, error: Error| -> Result<Admission> {
            if let Some(key) = key {
                state.keys.abort(key);
            }
            Err(error)
        };
        if let Err(e) = self.budget_left(state.hot_bytes) {
            return refuse(&mut state, e);
        }
        if !state.runs.contains_key(&entry.run)
            && let Some(twin) = state
                .runs
                .keys()
                .find(|r| r.as_str().eq_ignore_ascii_case(entry.run.as_str()))
        {
            // On a case-insensitive file system (macOS, Windows) or a data set copied to one,
            // `run=Run1/` and `run=run1/` are one folder: the two runs' parts would mix.
            let error = Error::bad(format!(
                "run id {:?} differs from the existing run {:?} only in letter case; run ids \
                 must differ in more than case (their folders collide on case-insensitive \
                 file systems)",
                entry.run.as_str(),
                twin.as_str()
            ));
            return refuse(&mut state, error);
        }
        let new_run = !state.runs.contains_key(&entry.run);
        if new_run && !state.reserved_runs.contains_key(&entry.run) {
            let runs = state.runs.len() + state.reserved_runs.len();
            if runs >= self.limits.max_runs {
                let error = Error::Cardinality(format!(
                    "the collector keeps {runs} runs, its limit (--max-runs {}): run {} is \
                     not taken; delete runs (rankwatch runs delete) or let retention remove \
                     them",
                    self.limits.max_runs, entry.run
                ));
                return refuse(&mut state, error);
            }
        }
        let mut reservation = Reservation { series: 0, new_run };
        if let Some(digest) = &prepared.digest {
            let summary = state.runs.get(&entry.run);
            let have = summary.map_or(0, |s| s.series.len());
            let fresh = match summary {
                Some(s) => s.new_series(digest),
                None => RunSummary::default().new_series(digest),
            };
            // Batches in flight count with their new series (conservatively: two in flight
            // with the same new series count it twice until one is applied).
            let pending = state.reserved_series.get(&entry.run).copied().unwrap_or(0);
            // Over all runs (summed only when this batch adds series: most add none).
            let everywhere = match fresh {
                0 => 0,
                _ => state.total_series + state.reserved_series.values().sum::<usize>() + fresh,
            };
            if everywhere > self.limits.max_series {
                let limit = self.limits.max_series;
                return refuse(
                    &mut state,
                    Error::Cardinality(format!(
                        "the collector would keep {everywhere} series over all runs, over its \
                         limit of {limit} (--max-series); this batch of run {} adds {fresh} new \
                         ones; delete runs (rankwatch runs delete) or let retention remove them",
                        entry.run
                    )),
                );
            }
            if have + pending + fresh > self.limits.max_series_per_run {
                let limit = self.limits.max_series_per_run;
                return refuse(
                    &mut state,
                    Error::Cardinality(format!(
                        "run {} would have {} series (metric, layer, site, rank), over the limit of {limit}; \
                         this batch adds {fresh} new ones{}",
                        entry.run,
                        have + pending + fresh,
                        if pending > 0 {
                            format!(" and batches being written add up to {pending}")
                        } else {
                            String::new()
                        }
                    )),
                );
            }
            if fresh > 0 {
                *state.reserved_series.entry(entry.run.clone()).or_default() += fresh;
            }
            reservation.series = fresh;
        }
        if new_run {
            *state.reserved_runs.entry(entry.run.clone()).or_default() += 1;
        }
        Ok(Admission::Write(reservation))
    }

    /// Ends an admitted batch's reservation (it was applied, or failed).
    pub fn release(&self, run: &RunId, reservation: Reservation) {
        if reservation == Reservation::default() {
            return;
        }
        let mut state = self.lock();
        let state = &mut *state;
        for (map, n) in [
            (&mut state.reserved_series, reservation.series),
            (&mut state.reserved_runs, usize::from(reservation.new_run)),
        ] {
            if n == 0 {
                continue;
            }
            if let Some(left) = map.get_mut(run) {
                *left = left.saturating_sub(n);
                if *left == 0 {
                    map.remove(run);
                }
            }
        }
    }

    /// Forgets an in-flight key whose write failed.
    pub fn abort(&self, key: &Key) {
        self.lock().keys.abort(key);
    }

    /// Applies a durable entry (called by the log writer in sequence order, and by replay).
    pub fn apply(
        &self,
        seq: u64,
        key: Option<&Key>,
        entry: &Entry,
        prepared: Prepared,
        seen_ms: i64,
    ) -> Result<()> {
        let Prepared {
            samples,
            sketches,
            digest,
        } = prepared;
        let mut events = Vec::new();
        {
            let mut state = self.lock();
            let state = &mut *state;
            state.applied_seq = state.applied_seq.max(seq);
            if let Some(key) = key {
                state.keys.commit(key, self.clock.now_ms());
            }
            // A record of a run deleted after it was logged (only seen in replay: the log
            // applies records in order, so a live one is always after any tombstone).
            if state
                .manifest
                .deleted_runs
                .get(&entry.run)
                .is_some_and(|&through| seq <= through)
            {
                return Ok(());
            }
            let summary = state.runs.entry(entry.run.clone()).or_default();
            summary.last_seen_ms = summary.last_seen_ms.max(seen_ms);
            summary.last_seq = summary.last_seq.max(seq);
            if let Some(info) = &entry.info {
                if summary.info.as_ref() != Some(info) {
                    summary.info = Some(info.clone());
                    state.runs_dirty.push(entry.run.clone());
                }
                events.push(Event::Run {
                    run: entry.run.to_string(),
                    world_size: info.world_size,
                });
            }
            if let (Some(batch), Some(digest)) = (&samples, &digest) {
                let before = summary.series.len();
                summary.add_digest(digest, seen_ms);
                let added = summary.series.len().saturating_sub(before);
                state.total_series += added;
                let (first, last) = digest.steps.unzip();
                events.push(Event::Samples {
                    run: entry.run.to_string(),
                    rows: batch.num_rows() as u64,
                    first_step: first.unwrap_or(0),
                    last_step: last.unwrap_or(0),
                });
            }
            if let Some(batch) = &sketches {
                summary.sketches += batch.num_rows() as u64;
            }
            for (table, batch) in [(Table::Samples, samples), (Table::Sketches, sketches)] {
                if let Some(batch) = batch {
                    let bytes = batch.get_array_memory_size();
                    let part = state.hot.entry((table, entry.run.clone())).or_default();
                    part.bytes += bytes;
                    part.batches.push(batch);
                    state.hot_bytes += bytes;
                }
            }
            self.metrics.hot_bytes.set(state.hot_bytes as i64);
            if state.hot_bytes >= self.limits.hot_budget_bytes {
                self.flush_wanted.notify_one();
            }
        }
        for event in events {
            self.publish(event);
        }
        Ok(())
    }
}
