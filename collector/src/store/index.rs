//! The in-memory index of runs: what `/api/v1/runs`, the catalog, cardinality limits and the
//! per-run gauges of `/metrics` read, without scanning Parquet.
//!
//! It holds, per run, the metadata the agent announced, counts, the step range, every distinct
//! series (metric, layer, site, rank) and the latest values of the few metrics `/metrics`
//! exports. It is rebuilt on start from the Parquet files (one aggregate query per run) and
//! from write-ahead-log replay, so it is never a second source of truth.

use std::sync::Arc;

use foldhash::{HashMap, HashSet};

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, TimestampMillisecondType, UInt32Type, UInt64Type};
use arrow_array::{Array, RecordBatch};
use rankwatch_analytics::{Metric, RunInfo, Site};
use serde::Serialize;

/// One series of a run.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct SeriesKey {
    pub metric: Arc<str>,
    pub layer: Option<u32>,
    pub site: Option<Site>,
    pub rank: Option<u32>,
}

/// A value with the step it was measured at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Latest {
    pub step: u64,
    pub value: f64,
}

impl Latest {
    /// `row` replaces this value unless it is of an earlier step (a later row of the same step
    /// wins).
    fn keep(&mut self, row: Latest) {
        if self.step <= row.step {
            *self = row;
        }
    }
}

fn keep_latest(slot: &mut Option<Latest>, row: Latest) {
    slot.get_or_insert(row).keep(row);
}

/// What the index knows about one run.
#[derive(Debug, Default)]
pub struct RunSummary {
    pub info: Option<RunInfo>,
    pub samples: u64,
    pub nonfinite: u64,
    pub sketches: u64,
    pub first_step: Option<u64>,
    pub last_step: Option<u64>,
    /// Latest measurement time seen, ms since the epoch.
    pub last_time_ms: Option<i64>,
    /// Wall-clock time the collector last received data for the run (0 after a restart until
    /// new data arrives).
    pub last_seen_ms: i64,
    pub series: HashSet<SeriesKey>,
    /// Interned metric names, so series keys share one allocation per name.
    metrics: HashSet<Arc<str>>,
    pub loss_by_rank: HashMap<u32, Option<Latest>>,
    pub ratio_by_layer: HashMap<u32, Option<Latest>>,
    pub perplexity: Option<Latest>,
    pub loss_cv: Option<Latest>,
    pub grad_norm_cv: Option<Latest>,
    /// Latest step with a per-rank sample, per rank.
    pub rank_steps: HashMap<u32, u64>,
    /// The last log record applied to the run since this process started (0: none yet): a
    /// deletion keeps the run if a record came after the records it deletes.
    pub last_seq: u64,
}

impl RunSummary {
    fn intern(&mut self, metric: &str) -> Arc<str> {
        if let Some(m) = self.metrics.get(metric) {
            return m.clone();
        }
        let m: Arc<str> = Arc::from(metric);
        self.metrics.insert(m.clone());
        m
    }

    /// Series of a batch (its [`BatchDigest`]) that the run does not have yet.
    pub fn new_series(&self, digest: &BatchDigest) -> usize {
        digest
            .series()
            .filter(|&((metric, layer, site, rank), ..)| {
                // A metric never interned has no series yet.
                self.metrics.get(metric).is_none_or(|metric| {
                    !self.series.contains(&SeriesKey {
                        metric: metric.clone(),
                        layer,
                        site,
                        rank,
                    })
                })
            })
            .count()
    }

    /// Takes a batch of samples (file schema) into account.
    pub fn add_samples(&mut self, batch: &RecordBatch, seen_ms: i64) {
        self.add_digest(&BatchDigest::of(batch), seen_ms);
    }

    /// Takes a batch into account from its digest: the work is per series of the batch, not
    /// per row (the rows were read once, outside the store's lock, by [`BatchDigest::of`]).
    pub fn add_digest(&mut self, digest: &BatchDigest, seen_ms: i64) {
        if digest.rows == 0 {
            return;
        }
        self.samples += digest.rows;
        self.last_seen_ms = self.last_seen_ms.max(seen_ms);
        self.nonfinite += digest.nonfinite;
        if let Some((lo, hi)) = digest.steps {
            self.first_step = Some(self.first_step.map_or(lo, |f| f.min(lo)));
            self.last_step = Some(self.last_step.map_or(hi, |l| l.max(hi)));
        }
        if let Some(t) = digest.last_time_ms {
            self.last_time_ms = Some(self.last_time_ms.map_or(t, |l| l.max(t)));
        }
        for ((metric, layer, site, rank), known, latest) in digest.series() {
            if let Some(r) = rank {
                let e = self.rank_steps.entry(r).or_insert(latest.step);
                *e = (*e).max(latest.step);
            }
            match (known, rank, layer) {
                (Some(Metric::Loss), Some(r), _) => {
                    keep_latest(self.loss_by_rank.entry(r).or_default(), latest)
                }
                (Some(Metric::SpectralRatio), _, Some(l)) => {
                    keep_latest(self.ratio_by_layer.entry(l).or_default(), latest)
                }
                (Some(Metric::Perplexity), ..) => keep_latest(&mut self.perplexity, latest),
                (Some(Metric::LossCv), ..) => keep_latest(&mut self.loss_cv, latest),
                (Some(Metric::GradNormCv), ..) => keep_latest(&mut self.grad_norm_cv, latest),
                _ => {}
            }
            let metric = self.intern(metric);
            self.series.insert(SeriesKey {
                metric,
                layer,
                site,
                rank,
            });
        }
    }

    /// Merges an aggregate row from the Parquet rebuild.
    pub fn add_rebuilt(
        &mut self,
        key: SeriesKey,
        count: u64,
        nonfinite: u64,
        steps: (u64, u64),
        time_ms: i64,
    ) {
        self.samples += count;
        self.nonfinite += nonfinite;
        self.first_step = Some(self.first_step.map_or(steps.0, |f| f.min(steps.0)));
        self.last_step = Some(self.last_step.map_or(steps.1, |l| l.max(steps.1)));
        self.last_time_ms = Some(self.last_time_ms.map_or(time_ms, |l| l.max(time_ms)));
        if let Some(r) = key.rank {
            let e = self.rank_steps.entry(r).or_insert(steps.1);
            *e = (*e).max(steps.1);
        }
        let metric = self.intern(&key.metric);
        self.series.insert(SeriesKey { metric, ..key });
    }
}

/// A series key borrowed from a batch: metric, layer, site, rank.
pub type BorrowedKey<'a> = (&'a str, Option<u32>, Option<Site>, Option<u32>);

/// A series key with its metric named by position in a batch's vocabulary.
type NumberedKey = (u32, Option<u32>, Option<Site>, Option<u32>);

/// What a samples batch (file schema) brings to its run's summary, read in one pass over its
/// rows: its distinct series, each with its latest value, and its counts and ranges. Ingest
/// takes it once, before the store's lock, for both admission (the new series) and apply (all
/// of it), so the work under the lock is per series, not per row.
#[derive(Debug, Default)]
pub struct BatchDigest {
    pub rows: u64,
    pub nonfinite: u64,
    /// Lowest and highest step.
    pub steps: Option<(u64, u64)>,
    pub last_time_ms: Option<i64>,
    /// The batch's distinct metric names, each with its metric in the vocabulary (looked up
    /// once per name, not under the store's lock).
    names: Vec<(Box<str>, Option<Metric>)>,
    /// Each series, its metric named by position in `names`, with its value at its highest
    /// step (the last row of that step).
    series: HashMap<NumberedKey, Latest>,
}

impl BatchDigest {
    /// Reads `batch` (file schema). Rows are hashed as integers: a metric name or site equal to
    /// the row before's is not looked up again, another name is numbered in a small vocabulary
    /// (the agent's report changes metric from one row to the next), and a row of the series
    /// before only moves its latest value.
    pub fn of(batch: &RecordBatch) -> Self {
        let rows = batch.num_rows();
        if rows == 0 {
            return BatchDigest::default();
        }
        let rank = batch.column(0).as_primitive::<UInt32Type>();
        let step = batch.column(1).as_primitive::<UInt64Type>();
        let time = batch.column(2).as_primitive::<TimestampMillisecondType>();
        let metric = batch.column(3).as_string::<i32>();
        let layer = batch.column(4).as_primitive::<UInt32Type>();
        let site = batch.column(5).as_string::<i32>();
        let value = batch.column(6).as_primitive::<Float64Type>();
        let steps = step.values();
        let mut names: Vec<&str> = Vec::new();
        let mut ids: HashMap<&str, u32> = HashMap::default();
        let mut current_name: Option<(&str, u32)> = None;
        let mut current_site: Option<(&str, Option<Site>)> = None;
        let mut keys: HashMap<NumberedKey, Latest> = HashMap::default();
        let mut previous: Option<(NumberedKey, Latest)> = None;
        for i in 0..rows {
            let name = metric.value(i);
            let name_id = match current_name {
                Some((last, id)) if last == name => id,
                _ => {
                    let id = *ids.entry(name).or_insert_with(|| {
                        names.push(name);
                        names.len() as u32 - 1
                    });
                    current_name = Some((name, id));
                    id
                }
            };
            let site = if site.is_valid(i) {
                let text = site.value(i);
                match current_site {
                    Some((last, parsed)) if last == text => parsed,
                    _ => {
                        let parsed = text.parse::<Site>().ok();
                        current_site = Some((text, parsed));
                        parsed
                    }
                }
            } else {
                None
            };
            let key = (
                name_id,
                layer.is_valid(i).then(|| layer.value(i)),
                site,
                rank.is_valid(i).then(|| rank.value(i)),
            );
            let row = Latest {
                step: steps[i],
                value: value.value(i),
            };
            match &mut previous {
                Some((k, latest)) if *k == key => latest.keep(row),
                _ => {
                    if let Some((k, latest)) = previous.take() {
                        keys.entry(k).or_insert(latest).keep(latest);
                    }
                    previous = Some((key, row));
                }
            }
        }
        if let Some((k, latest)) = previous {
            keys.entry(k).or_insert(latest).keep(latest);
        }
        BatchDigest {
            rows: rows as u64,
            nonfinite: value.values().iter().filter(|v| !v.is_finite()).count() as u64,
            steps: steps
                .iter()
                .min()
                .zip(steps.iter().max())
                .map(|(&lo, &hi)| (lo, hi)),
            last_time_ms: time.values().iter().max().copied(),
            names: names
                .into_iter()
                .map(|n| (Box::from(n), Metric::from_name(n)))
                .collect(),
            series: keys,
        }
    }

    /// Each series of the batch, with its metric in the vocabulary and its latest value.
    pub fn series(&self) -> impl Iterator<Item = (BorrowedKey<'_>, Option<Metric>, Latest)> {
        self.series
            .iter()
            .map(|(&(name, layer, site, rank), &latest)| {
                let (name, known) = &self.names[name as usize];
                ((&**name, layer, site, rank), *known, latest)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rankwatch_analytics::schema::samples;
    use rankwatch_analytics::{MetricName, RunId, Sample};

    proptest! {
        /// A batch's digest is what its rows say taken one by one, whatever the order of the
        /// rows and however names, sites and steps repeat: its distinct series, each series'
        /// value at its highest step (the last such row), and the counts and ranges.
        #[test]
        fn a_digest_is_every_rows_key_and_latest_value(
            rows in prop::collection::vec(
                (0usize..4, prop::option::of(0u32..3), prop::option::of(0usize..3), prop::option::of(0u32..3), 0u64..4),
                0..120,
            ),
        ) {
            let names = ["loss", "spectral.ratio", "user/a", "act_max"];
            let sites = [Site::Up, Site::Down, Site::Q];
            let samples: Vec<Sample> = rows
                .iter()
                .enumerate()
                .map(|(i, &(m, layer, site, rank, step))| Sample {
                    run: RunId::new("r").unwrap(),
                    rank,
                    step,
                    time_ms: 1_000 + i as i64 % 7,
                    metric: MetricName::new(names[m]).unwrap(),
                    layer,
                    site: site.map(|s| sites[s]),
                    value: if i % 11 == 5 { f64::NAN } else { i as f64 },
                })
                .collect();
            let batch = crate::store::files::without_run(&samples::to_batch(&samples).unwrap()).unwrap();
            let mut want: HashMap<BorrowedKey<'_>, (u64, usize)> = HashMap::default();
            for (i, &(m, layer, site, rank, step)) in rows.iter().enumerate() {
                let slot = want.entry((names[m], layer, site.map(|s| sites[s]), rank)).or_insert((step, i));
                if slot.0 <= step {
                    *slot = (step, i);
                }
            }
            let digest = BatchDigest::of(&batch);
            let series: HashMap<BorrowedKey<'_>, Latest> = digest.series().map(|(key, _, latest)| (key, latest)).collect();
            prop_assert_eq!(series.len(), want.len());
            for (key, (step, row)) in want {
                let got = series.get(&key).copied();
                prop_assert_eq!(got.map(|l| l.step), Some(step), "{:?}", key);
                prop_assert_eq!(got.map(|l| l.value.to_bits()), Some(samples[row].value.to_bits()), "{:?}", key);
            }
            prop_assert_eq!(digest.rows, rows.len() as u64);
            prop_assert_eq!(digest.nonfinite, samples.iter().filter(|s| !s.value.is_finite()).count() as u64);
            prop_assert_eq!(digest.steps, rows.iter().map(|r| r.4).min().zip(rows.iter().map(|r| r.4).max()));
            prop_assert_eq!(digest.last_time_ms, samples.iter().map(|s| s.time_ms).max());
        }
    }
}
