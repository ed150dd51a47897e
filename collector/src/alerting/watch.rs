//! One run under watch: its aligner and its seven detectors, fed row by row from the live stream.
//!
//! Rows are routed by metric. Per-rank step scalars (loss, tokens, gradient norms, cosine,
//! nonfinite) and sketches go to the [`StepAligner`]; when a step closes, its all-ranks
//! statistics become samples (rank = all) and the step feeds `silent_inconsistency`,
//! `loss_spike` (the averaged loss), `nonfinite` (per rank) and, where the ranks sent replica
//! fingerprints, `replica_divergence`. Per-layer probes go straight to
//! their detectors as they arrive: `spectral.ratio`, `token_cosine` and `effective_rank` to
//! `rank_collapse` (and each rank's `learning_rate`, whose warm-up holds its early phase),
//! `act_max` to `activation_outlier`. `stale_rank` is driven by [`RunWatch::tick`] with each
//! rank's last report as the collector saw it (its own clock, not the agents').

use std::collections::BTreeSet;

use arrow_array::{Array, RecordBatch, StringArray};
use rankwatch_analytics::Result as AnalyticsResult;
use rankwatch_analytics::detect::{
    ActivationObservation, ActivationOutlier, CollapseObservation, Detector, DetectorsConfig,
    LossObservation, LossSpike, Nonfinite, NonfiniteObservation, RankActivity, RankCollapse,
    ReplicaDivergence, ReplicaObservation, SilentInconsistency, StaleRank, StepObservation,
};
use rankwatch_analytics::math::StepStats;
use rankwatch_analytics::schema::samples::{SampleColumns, SampleRow};
use rankwatch_analytics::{Alert, Metric, MetricName, RunId, Sample, Site, SketchRecord};

use super::aligner::{ClosedStep, Digest, RankScalar, Staged, StepAligner};
use crate::error::Result;

/// What a tick produced.
#[derive(Debug, Default)]
pub struct Output {
    /// All-ranks samples of the steps that closed.
    pub derived: Vec<Sample>,
    pub alerts: Vec<Alert>,
    pub steps_complete: u64,
    pub steps_timed_out: u64,
}

/// How often stale ranks are looked for, in the collector's milliseconds.
const STALE_EVERY_MS: i64 = 1_000;

/// Distinct metric names a watch remembers.
const NAMES_KEPT: usize = 1024;

/// One run's aligner and detectors.
#[derive(Debug)]
pub struct RunWatch {
    run: RunId,
    aligner: StepAligner,
    rank_collapse: RankCollapse,
    silent: SilentInconsistency,
    nonfinite: Nonfinite,
    loss_spike: LossSpike,
    activations: ActivationOutlier,
    stale: StaleRank,
    replicas: ReplicaDivergence,
    started_ms: i64,
    pub(crate) last_activity_ms: i64,
    /// Collapse probes of the batch being fed, merged per (step, layer) so a ratio and a token
    /// cosine measured at the same step count as one observation.
    /// Hashed, not ordered, while a batch is read (a lookup per row; a batch carries a few
    /// thousand); sorted once when it ends.
    collapse: foldhash::HashMap<(u64, u32), CollapseObservation>,
    /// Metric names seen and their metric (see `metric_of`).
    names: foldhash::HashMap<Box<str>, Option<Metric>>,
    /// When stale ranks were last looked for.
    stale_checked_ms: Option<i64>,
    /// The ranks with an open stale alert then, with their last report as it was.
    stale_ranks: Vec<(u32, Option<(u64, i64)>)>,
    /// Ranks whose latest row was `finished` (their `finish()` was called).
    finished: BTreeSet<u32>,
    /// The metrics of the last samples batch's rows.
    layout: MetricLayout,
}

/// The metric of each row of a batch, kept for the next batch: the ranks of a run send the same
/// report at a step, so the next batch's `metric` column is most often the same bytes, and one
/// comparison of them replaces a look-up per row.
#[derive(Debug, Default)]
struct MetricLayout {
    /// The column's bytes and its offsets relative to the first, as last resolved.
    names: Vec<u8>,
    offsets: Vec<i32>,
    metrics: Vec<Option<Metric>>,
}

impl MetricLayout {
    /// Makes `metrics` the metrics of `column`'s rows, looking names up with `metric_of` only
    /// when the column differs from the last one.
    fn resolve(&mut self, column: &StringArray, mut metric_of: impl FnMut(&str) -> Option<Metric>) {
        let offsets = column.value_offsets();
        let (first, last) = (offsets[0], offsets[offsets.len() - 1]);
        let names = &column.value_data()[first as usize..last as usize];
        let same = names == self.names.as_slice()
            && offsets.len() == self.offsets.len()
            && offsets
                .iter()
                .zip(&self.offsets)
                .all(|(&at, &kept)| at - first == kept);
        if same {
            return;
        }
        self.names.clear();
        self.names.extend_from_slice(names);
        self.offsets.clear();
        self.offsets.extend(offsets.iter().map(|&at| at - first));
        self.metrics.clear();
        self.metrics
            .extend((0..column.len()).map(|i| metric_of(column.value(i))));
    }
}

impl RunWatch {
    /// A fresh watch over `run` with `config` (already validated).
    pub fn new(
        run: RunId,
        config: DetectorsConfig,
        align_timeout_ms: i64,
        now_ms: i64,
    ) -> Result<Self> {
        Ok(RunWatch {
            rank_collapse: RankCollapse::new(run.clone(), config.rank_collapse)?,
            silent: SilentInconsistency::new(run.clone(), config.silent_inconsistency)?,
            nonfinite: Nonfinite::new(run.clone(), config.nonfinite)?,
            loss_spike: LossSpike::new(run.clone(), config.loss_spike)?,
            activations: ActivationOutlier::new(run.clone(), config.activation_outlier)?,
            stale: StaleRank::new(run.clone(), config.stale_rank)?,
            replicas: ReplicaDivergence::new(run.clone(), config.replica_divergence)?,
            run,
            aligner: StepAligner::new(align_timeout_ms),
            started_ms: now_ms,
            last_activity_ms: now_ms,
            collapse: Default::default(),
            names: Default::default(),
            stale_checked_ms: None,
            stale_ranks: Vec::new(),
            finished: BTreeSet::new(),
            layout: MetricLayout::default(),
        })
    }

    /// Whether every rank of a world of `world` ranks has finished.
    pub fn all_finished(&self, world: u32) -> bool {
        (0..world).all(|r| self.finished.contains(&r))
    }

    /// Rows that came after their step had closed, since the last call.
    pub fn take_late_rows(&mut self) -> u64 {
        self.aligner.take_late_rows()
    }

    /// The open alerts of every detector.
    pub fn open_alerts(&self) -> Vec<Alert> {
        let mut open = self.rank_collapse.open_alerts();
        open.extend(self.silent.open_alerts());
        open.extend(self.nonfinite.open_alerts());
        open.extend(self.loss_spike.open_alerts());
        open.extend(self.activations.open_alerts());
        open.extend(self.stale.open_alerts());
        open.extend(self.replicas.open_alerts());
        open
    }

    /// Feeds a samples batch, row by row; returns the alerts it changed. Its metric names are
    /// resolved once for the batch as a whole, and reused when its metric column is the last
    /// batch's bytes.
    pub fn samples(&mut self, batch: &RecordBatch, now_ms: i64) -> AnalyticsResult<Vec<Alert>> {
        let columns = SampleColumns::new(batch)?;
        let mut layout = std::mem::take(&mut self.layout);
        layout.resolve(columns.metric, |name| self.metric_of(name));
        let mut alerts = Vec::new();
        for (i, &metric) in layout.metrics.iter().enumerate() {
            alerts.extend(self.route(columns.row(i), metric, now_ms));
        }
        self.layout = layout;
        Ok(alerts)
    }

    /// Feeds one sample row; returns the alerts it changed.
    pub fn row(&mut self, row: SampleRow<'_>, now_ms: i64) -> Vec<Alert> {
        let metric = self.metric_of(row.metric);
        self.route(row, metric, now_ms)
    }

    /// A row whose metric is known. A rank's row is appended to the aligner's batch (see
    /// [`StepAligner::stage`]); [`RunWatch::end_batch`] applies them, as seen at the time of
    /// the batch's rows (`last_activity_ms`).
    fn route(&mut self, row: SampleRow<'_>, metric: Option<Metric>, now_ms: i64) -> Vec<Alert> {
        self.last_activity_ms = now_ms;
        if let Some(rank) = row.rank {
            // A rank is finished from its `finished` row until it reports anything else (a
            // resume under the same run name, or a crashed rank's replacement).
            if metric == Some(Metric::Finished) {
                self.finished.insert(rank);
            } else if !self.finished.is_empty() {
                self.finished.remove(&rank);
            }
            // Every row of a rank shows it alive at its step (user metrics too); its step
            // scalars and replica digests also join the step.
            let digest = match (metric, row.layer) {
                (Some(Metric::ParamFingerprint), _) => Some(Digest::Model),
                (Some(Metric::ParamLocator), _) => Some(Digest::ModelLocator),
                (Some(Metric::LayerFingerprint), Some(layer)) => Some(Digest::Layer(layer)),
                (Some(Metric::OptimFingerprint), _) => Some(Digest::Optimizer),
                (Some(Metric::OptimLocator), _) => Some(Digest::OptimizerLocator),
                (Some(Metric::ReplicaSet), _) => Some(Digest::ReplicaSet),
                _ => None,
            };
            let joins = digest
                .map(Staged::Digest)
                .or_else(|| metric.and_then(RankScalar::of).map(Staged::Scalar));
            self.aligner.stage(
                rank,
                row.step,
                row.time_ms,
                joins.unwrap_or(Staged::Seen),
                row.value,
            );
            if joins.is_some() {
                return Vec::new();
            }
        }
        match (metric, row.layer) {
            (Some(Metric::SpectralRatio), Some(layer)) => {
                self.collapse_probe(row, layer).ratio = Some(row.value);
                Vec::new()
            }
            // Token cosine is measured on every rank; one rank (the lowest that reports it)
            // stands for the layer, since the weights are the same everywhere.
            (Some(Metric::TokenCosine), Some(layer)) if row.rank.is_none_or(|r| r == 0) => {
                self.collapse_probe(row, layer).token_cosine = Some(row.value);
                Vec::new()
            }
            // Every rank reports it; the schedule is one, so any of them moves the warm-up.
            (Some(Metric::LearningRate), _) => {
                self.rank_collapse
                    .observe_learning_rate(row.step, row.value);
                Vec::new()
            }
            (Some(Metric::EffectiveRank), Some(layer)) => {
                self.collapse_probe(row, layer).effective_rank = Some(row.value);
                Vec::new()
            }
            (Some(Metric::ActMax), layer) => match row.site.and_then(|s| s.parse::<Site>().ok()) {
                Some(site) => self.activations.observe(&ActivationObservation {
                    step: row.step,
                    time_ms: row.time_ms,
                    layer,
                    site,
                    rank: row.rank,
                    value: row.value,
                }),
                None => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    /// `name`'s metric, from the names this run has used (a hash of a short string per row:
    /// the agent's report changes metric from one row to the next, and the vocabulary's own
    /// look-up compares the name with each of its forty).
    fn metric_of(&mut self, name: &str) -> Option<Metric> {
        if let Some(metric) = self.names.get(name) {
            return *metric;
        }
        let metric = Metric::from_name(name);
        // User metrics are open-ended: past the cap they are looked up, not remembered.
        if self.names.len() < NAMES_KEPT {
            self.names.insert(name.into(), metric);
        }
        metric
    }

    fn collapse_probe(&mut self, row: SampleRow<'_>, layer: u32) -> &mut CollapseObservation {
        let probe = self
            .collapse
            .entry((row.step, layer))
            .or_insert(CollapseObservation {
                step: row.step,
                time_ms: row.time_ms,
                layer,
                ratio: None,
                token_cosine: None,
                effective_rank: None,
            });
        probe.time_ms = probe.time_ms.max(row.time_ms);
        probe
    }

    /// Feeds one gradient sketch.
    pub fn sketch(&mut self, sketch: SketchRecord, now_ms: i64) {
        // Rows staged before it were seen at their own batch's time.
        self.aligner.apply_staged(self.last_activity_ms);
        self.last_activity_ms = now_ms;
        self.aligner.add_sketch(sketch, now_ms);
    }

    /// Ends a batch: its ranks' rows join their steps, and the collapse probes it carried are
    /// fed in step order.
    pub fn end_batch(&mut self) -> Vec<Alert> {
        self.aligner.apply_staged(self.last_activity_ms);
        let mut probes: Vec<_> = std::mem::take(&mut self.collapse).into_iter().collect();
        probes.sort_unstable_by_key(|(key, _)| *key);
        probes
            .into_iter()
            .flat_map(|(_, probe)| self.rank_collapse.observe(&probe))
            .collect()
    }

    /// Closes the steps that are ready and checks for stale ranks. `world_size` comes from the
    /// run's metadata when it announced it. With `all`, every open step closes. `tensors` gives
    /// the names of the fingerprinted tensors (the run's `replica_fingerprint_tensors` tag); it
    /// is asked only at a step whose replicas disagree.
    pub fn tick(
        &mut self,
        world_size: Option<u32>,
        now_ms: i64,
        all: bool,
        tensors: &dyn Fn() -> Vec<String>,
    ) -> Output {
        let mut out = Output::default();
        for closed in self.aligner.close_ready(world_size, now_ms, all) {
            self.closed_step(closed, world_size, tensors, &mut out);
        }
        // Stale ranks on a timer, as the rule is written: every rank's silence is looked at,
        // so at every batch that was O(world) a batch, O(world²) a step when each rank posts
        // its own. A rank with an open stale alert that reported again is looked at at once:
        // its alert resolves when it is back, not up to a second later.
        let back = self
            .stale_ranks
            .iter()
            .any(|&(rank, seen)| self.aligner.last_seen(rank) != seen);
        let due = all
            || back
            || self
                .stale_checked_ms
                .is_none_or(|t| now_ms - t >= STALE_EVERY_MS || now_ms < t);
        if let Some(world) = world_size.filter(|&w| w >= 2 && due) {
            self.stale_checked_ms = Some(now_ms);
            let mut last_seen: Vec<_> = (0..world).map(|r| self.aligner.last_seen(r)).collect();
            // A rank that finished is done, not stale: it counts as up to date with the lead.
            let lead = last_seen.iter().flatten().map(|&(s, _)| s).max();
            for (rank, seen) in last_seen.iter_mut().enumerate() {
                if self.finished.contains(&(rank as u32)) {
                    *seen = lead.map(|step| (step, now_ms));
                }
            }
            out.alerts.extend(self.stale.observe(&RankActivity {
                now_ms,
                run_started_ms: self.started_ms,
                last_seen,
            }));
            self.stale_ranks = self
                .stale
                .open_alerts()
                .iter()
                .filter_map(|a| a.rank)
                .map(|rank| (rank, self.aligner.last_seen(rank)))
                .collect();
        }
        out
    }

    fn closed_step(
        &mut self,
        closed: ClosedStep,
        world_size: Option<u32>,
        tensors: &dyn Fn() -> Vec<String>,
        out: &mut Output,
    ) {
        let world = world_size.unwrap_or(closed.ranks.len() as u32);
        let stats = StepStats::compute(&closed.ranks, world);
        let derived = &mut out.derived;
        derived.extend(stats.samples(&self.run, closed.step, closed.time_ms));
        let extra = [
            (Metric::CosPairMean, closed.cos_pair_mean),
            (
                Metric::RanksMissing,
                (!closed.complete).then_some(closed.missing.len() as f64),
            ),
        ];
        derived.extend(extra.into_iter().filter_map(|(metric, value)| {
            Some(Sample {
                run: self.run.clone(),
                rank: None,
                step: closed.step,
                time_ms: closed.time_ms,
                metric: MetricName::from(metric),
                layer: None,
                site: None,
                value: value?,
            })
        }));
        let alerts = &mut out.alerts;
        // Nonfinite first: a NaN step is critical on its own, whatever the other rules say.
        // Each rank that reported a count or a loss, in rank order: both lists come sorted by
        // rank, one entry a rank, so they are merged rather than gathered in a map.
        let mut counts = closed.nonfinite.iter().peekable();
        let mut losses = closed.ranks.iter().peekable();
        while let Some(rank) = match (counts.peek(), losses.peek()) {
            (Some(&&(a, _)), Some(b)) => Some(a.min(b.rank)),
            (Some(&&(a, _)), None) => Some(a),
            (None, Some(b)) => Some(b.rank),
            (None, None) => None,
        } {
            let count = counts
                .next_if(|&&(r, _)| r == rank)
                .map_or(0, |&(_, count)| count.max(0.0) as u64);
            let loss = losses.next_if(|v| v.rank == rank).and_then(|v| v.loss);
            alerts.extend(self.nonfinite.observe(&NonfiniteObservation {
                step: closed.step,
                time_ms: closed.time_ms,
                rank: Some(rank),
                count,
                loss,
            }));
        }
        if let Some(loss) = stats.loss_mean.filter(|l| l.is_finite()) {
            alerts.extend(self.loss_spike.observe(&LossObservation {
                step: closed.step,
                time_ms: closed.time_ms,
                rank: None,
                loss,
            }));
        }
        alerts.extend(self.silent.observe(&StepObservation {
            step: closed.step,
            time_ms: closed.time_ms,
            world_size: world,
            ranks: closed.ranks,
        }));
        if !closed.fingerprints.is_empty() {
            let mut obs = ReplicaObservation {
                step: closed.step,
                time_ms: closed.time_ms,
                world_size: world,
                ranks: closed.fingerprints,
                tensors: Vec::new(),
            };
            if obs.disagree() {
                obs.tensors = tensors();
            }
            alerts.extend(self.replicas.observe(&obs));
        }
        out.steps_complete += u64::from(closed.complete);
        out.steps_timed_out += u64::from(!closed.complete);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each column's metrics are the names' own, whether the layout is reused or not: the same
    /// bytes split differently, a sliced column, an empty one, and back again.
    #[test]
    fn a_layout_is_reused_only_for_the_same_names() {
        let columns: Vec<StringArray> = vec![
            StringArray::from(vec!["loss", "grad_norm", "act_max"]),
            StringArray::from(vec!["loss", "grad_norm", "act_max"]),
            StringArray::from(vec!["x", "loss", "grad_norm", "act_max"]).slice(1, 3),
            StringArray::from(vec!["lossgrad", "_norm", "act_max"]),
            StringArray::from(Vec::<&str>::new()),
            StringArray::from(vec!["loss", "grad_norm", "act_ma"]),
            StringArray::from(vec!["loss", "grad_norm", "act_max", "loss"]),
        ];
        let mut layout = MetricLayout::default();
        let mut looked_up = 0;
        for column in &columns {
            layout.resolve(column, |name| {
                looked_up += 1;
                Metric::from_name(name)
            });
            let want: Vec<Option<Metric>> = (0..column.len())
                .map(|i| Metric::from_name(column.value(i)))
                .collect();
            assert_eq!(layout.metrics, want, "{column:?}");
        }
        // Looked up afresh for all but the repeat, the slice of the same names after it and
        // the empty column: 3 + 3 + 3 + 4 names.
        assert_eq!(looked_up, 13);
    }
}
