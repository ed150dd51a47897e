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

fn keep_latest(slot: &mut Option<Latest>, step: u64, value: f64) {
    if slot.is_none_or(|l| l.step <= step) {
        *slot = Some(Latest { step, value });
    }
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

    /// Series of `batch` (file schema) that the run does not have yet.
    pub fn new_series(&self, batch: &RecordBatch) -> usize {
        distinct_keys(batch)
            .into_iter()
            .filter(|&(metric, layer, site, rank)| {
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
        let rows = batch.num_rows();
        if rows == 0 {
            return;
        }
        let rank = batch.column(0).as_primitive::<UInt32Type>();
        let step = batch.column(1).as_primitive::<UInt64Type>();
        let time = batch.column(2).as_primitive::<TimestampMillisecondType>();
        let metric = batch.column(3).as_string::<i32>();
        let layer = batch.column(4).as_primitive::<UInt32Type>();
        let value = batch.column(6).as_primitive::<Float64Type>();
        self.samples += rows as u64;
        self.last_seen_ms = self.last_seen_ms.max(seen_ms);
        self.nonfinite += value.values().iter().filter(|v| !v.is_finite()).count() as u64;
        let steps = step.values();
        let (lo, hi) = (steps.iter().min(), steps.iter().max());
        self.first_step = lo.map(|&s| self.first_step.map_or(s, |f| f.min(s)));
        self.last_step = hi.map(|&s| self.last_step.map_or(s, |l| l.max(s)));
        if let Some(&t) = time.values().iter().max() {
            self.last_time_ms = Some(self.last_time_ms.map_or(t, |l| l.max(t)));
        }
        // Rows arrive grouped by metric: the vocabulary is searched once per run of equal
        // names, not on every row.
        let mut last_metric: Option<(&str, Option<Metric>)> = None;
        for i in 0..rows {
            let (s, v) = (steps[i], value.value(i));
            let r = rank.is_valid(i).then(|| rank.value(i));
            if let Some(r) = r {
                let e = self.rank_steps.entry(r).or_insert(s);
                *e = (*e).max(s);
            }
            let m = metric.value(i);
            let known = match last_metric {
                Some((name, known)) if name == m => known,
                _ => {
                    let known = Metric::from_name(m);
                    last_metric = Some((m, known));
                    known
                }
            };
            let l = layer.is_valid(i).then(|| layer.value(i));
            match (known, r, l) {
                (Some(Metric::Loss), Some(r), _) => {
                    keep_latest(self.loss_by_rank.entry(r).or_default(), s, v)
                }
                (Some(Metric::SpectralRatio), _, Some(l)) => {
                    keep_latest(self.ratio_by_layer.entry(l).or_default(), s, v)
                }
                (Some(Metric::Perplexity), ..) => keep_latest(&mut self.perplexity, s, v),
                (Some(Metric::LossCv), ..) => keep_latest(&mut self.loss_cv, s, v),
                (Some(Metric::GradNormCv), ..) => keep_latest(&mut self.grad_norm_cv, s, v),
                _ => {}
            }
        }
        for (metric, layer, site, rank) in distinct_keys(batch) {
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
type BorrowedKey<'a> = (&'a str, Option<u32>, Option<Site>, Option<u32>);

/// A series key with its metric named by position in a batch's vocabulary.
type NumberedKey = (u32, Option<u32>, Option<Site>, Option<u32>);

/// The distinct series of a batch (file schema), borrowed from it. Ingest asks this twice of
/// every batch (admission, then apply), so rows are hashed as integers: metric names and sites
/// come in runs of equal values, so each is compared with the row before and named by its
/// position in a small vocabulary (a site parsed once per run, not per row); a row repeating
/// the one before is not hashed at all.
fn distinct_keys(batch: &RecordBatch) -> HashSet<BorrowedKey<'_>> {
    let rank = batch.column(0).as_primitive::<UInt32Type>();
    let metric = batch.column(3).as_string::<i32>();
    let layer = batch.column(4).as_primitive::<UInt32Type>();
    let site = batch.column(5).as_string::<i32>();
    let mut names: Vec<&str> = Vec::new();
    let mut ids: HashMap<&str, u32> = HashMap::default();
    let mut current_name: Option<(&str, u32)> = None;
    let mut current_site: Option<(&str, Option<Site>)> = None;
    let mut keys: HashSet<NumberedKey> = HashSet::default();
    let mut previous = None;
    for i in 0..batch.num_rows() {
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
        if previous != Some(key) {
            keys.insert(key);
            previous = Some(key);
        }
    }
    keys.into_iter()
        .map(|(name, layer, site, rank)| (names[name as usize], layer, site, rank))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rankwatch_analytics::schema::samples;
    use rankwatch_analytics::{MetricName, RunId, Sample};

    proptest! {
        /// The distinct keys are those of every row taken one by one, whatever the order of
        /// the rows and however names and sites repeat.
        #[test]
        fn distinct_keys_are_every_rows_key(
            rows in prop::collection::vec(
                (0usize..4, prop::option::of(0u32..3), prop::option::of(0usize..3), prop::option::of(0u32..3)),
                0..120,
            ),
        ) {
            let names = ["loss", "spectral.ratio", "user/a", "act_max"];
            let sites = [Site::Up, Site::Down, Site::Q];
            let samples: Vec<Sample> = rows
                .iter()
                .map(|&(m, layer, site, rank)| Sample {
                    run: RunId::new("r").unwrap(),
                    rank,
                    step: 1,
                    time_ms: 0,
                    metric: MetricName::new(names[m]).unwrap(),
                    layer,
                    site: site.map(|s| sites[s]),
                    value: 0.0,
                })
                .collect();
            let batch = crate::store::files::without_run(&samples::to_batch(&samples).unwrap()).unwrap();
            let want: HashSet<BorrowedKey<'_>> = rows
                .iter()
                .map(|&(m, layer, site, rank)| (names[m], layer, site.map(|s| sites[s]), rank))
                .collect();
            prop_assert_eq!(distinct_keys(&batch), want);
        }
    }
}
