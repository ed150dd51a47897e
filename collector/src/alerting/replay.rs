//! `rankwatch replay`: a stored run fed through the detectors again, under any rules.
//!
//! A ROC curve needs each run judged under many thresholds, and a training run per threshold
//! would cost hours where the detectors need milliseconds. The detectors are pure state
//! machines over the stream of rows, so a run's exported rows (`rankwatch export`, samples and
//! sketches) are enough: they are put back in the order they were measured — by time, then
//! step, then rank — and fed to a fresh [`RunWatch`] exactly as the engine feeds the live
//! stream: row by row, one batch per (rank, step), a tick after each batch (the engine ticks
//! after each batch it takes in), and every open step closed at the end. The all-ranks statistics the live aligner stored
//! (`loss_cv`, `cos_weighted`, …) are skipped: the replay's aligner computes them again.
//!
//! What differs from live: "now" is each row's measurement time, where live it is the
//! collector's arrival time (later by the agent's batching, about a second), and a live batch
//! holds many steps where the replay's holds one, so steps that live closed on
//! `--align-timeout` and `stale_rank`'s silences are judged a little earlier, and a step may
//! close a batch sooner than it did live.
//! The test replays a live run under the default rules and finds the alerts it fired.

use std::collections::BTreeMap;
use std::path::Path;

use arrow_array::RecordBatch;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use rankwatch_analytics::detect::DetectorsConfig;
use rankwatch_analytics::schema::samples::SampleRow;
use rankwatch_analytics::schema::{samples, sketches};
use rankwatch_analytics::{Alert, Metric, RunId, Sample, Scope, SketchRecord};

use super::watch::RunWatch;
use crate::error::{Error, Result};

/// One stored run's rows, in the order they were measured.
#[derive(Debug)]
pub struct StoredRun {
    pub run: RunId,
    /// Ranks of the world: the largest rank seen plus one, unless given.
    pub world_size: u32,
    events: Vec<Event>,
}

#[derive(Debug)]
enum Event {
    Sample(Sample),
    Sketch(SketchRecord),
}

impl Event {
    fn order(&self) -> (i64, u64, u32, u8) {
        match self {
            // A rank's sketch of a step travels before its samples of that step.
            Event::Sketch(s) => (s.time_ms, s.step, s.rank, 0),
            Event::Sample(s) => (s.time_ms, s.step, s.rank.unwrap_or(u32::MAX), 1),
        }
    }
}

/// Every record batch of a Parquet file.
pub fn read_parquet(path: &Path) -> Result<Vec<RecordBatch>> {
    let file = std::fs::File::open(path)
        .map_err(|e| Error::BadRequest(format!("cannot open {}: {e}", path.display())))?;
    let reader = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| Error::BadRequest(format!("{} is not a Parquet file: {e}", path.display())))?
        .build()?;
    reader
        .map(|b| b.map_err(|e| Error::BadRequest(format!("{}: {e}", path.display()))))
        .collect()
}

impl StoredRun {
    /// The run in `samples` (and `sketches`), which must hold one run only; `world_size`
    /// when known.
    pub fn new(
        samples_batches: &[RecordBatch],
        sketch_batches: &[RecordBatch],
        world_size: Option<u32>,
    ) -> Result<StoredRun> {
        let mut events = Vec::new();
        let mut run: Option<RunId> = None;
        let mut top_rank = 0;
        let mut same_run = |id: &RunId| -> Result<()> {
            match &run {
                Some(r) if r != id => Err(Error::BadRequest(format!(
                    "the rows hold two runs, {r} and {id}; export one run"
                ))),
                Some(_) => Ok(()),
                None => {
                    run = Some(id.clone());
                    Ok(())
                }
            }
        };
        for batch in samples_batches {
            for sample in samples::from_batch(batch)? {
                same_run(&sample.run)?;
                // The live aligner's output: the replay computes it again.
                let derived = sample.rank.is_none()
                    && Metric::from_name(sample.metric.as_str())
                        .is_some_and(|m| m.scope() == Scope::AllRanks);
                if derived {
                    continue;
                }
                top_rank = top_rank.max(sample.rank.unwrap_or(0));
                events.push(Event::Sample(sample));
            }
        }
        for batch in sketch_batches {
            for sketch in sketches::from_batch(batch)? {
                same_run(&sketch.run)?;
                top_rank = top_rank.max(sketch.rank);
                events.push(Event::Sketch(sketch));
            }
        }
        let run = run.ok_or_else(|| Error::BadRequest("the samples hold no rows".into()))?;
        events.sort_by_key(Event::order);
        Ok(StoredRun {
            run,
            world_size: world_size.unwrap_or(top_rank + 1),
            events,
        })
    }

    /// The alerts the run raises under `config`: each alert's last state, in the order they
    /// started.
    pub fn replay(&self, config: DetectorsConfig, align_timeout_ms: i64) -> Result<Vec<Alert>> {
        let start = self.events.first().map_or(0, |e| e.order().0);
        let mut watch = RunWatch::new(self.run.clone(), config, align_timeout_ms, start)?;
        let world = Some(self.world_size);
        // Exported rows carry no run tags: a replica alert names blocks, not tensors.
        let tensors = Vec::new;
        let mut states: BTreeMap<String, Alert> = BTreeMap::new();
        let mut keep = |alerts: Vec<Alert>| {
            for alert in alerts {
                states.insert(alert.id.clone(), alert);
            }
        };
        let mut batch: Option<(u32, u64)> = None;
        let mut now = start;
        for event in &self.events {
            let (time_ms, step, rank, _) = event.order();
            now = now.max(time_ms);
            if batch.is_some_and(|b| b != (rank, step)) {
                keep(watch.end_batch());
                keep(watch.tick(world, now, false, &tensors).alerts);
            }
            batch = Some((rank, step));
            match event {
                Event::Sample(s) => keep(watch.row(row_of(s), now)),
                Event::Sketch(s) => watch.sketch(s.clone(), now),
            }
        }
        keep(watch.end_batch());
        keep(watch.tick(world, now, true, &tensors).alerts);
        let mut alerts: Vec<Alert> = states.into_values().collect();
        alerts.sort_by(|a, b| (a.first_step, &a.id).cmp(&(b.first_step, &b.id)));
        Ok(alerts)
    }
}

fn row_of(s: &Sample) -> SampleRow<'_> {
    SampleRow {
        run: s.run.as_str(),
        rank: s.rank,
        step: s.step,
        time_ms: s.time_ms,
        metric: s.metric.as_str(),
        layer: s.layer,
        site: s.site.map(|site| site.as_str()),
        value: s.value,
    }
}
