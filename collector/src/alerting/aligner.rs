//! The step aligner: gathers one run's per-rank values step by step and closes each step once.
//!
//! Ranks report independently, in batches about a second apart, so the rows of step s reach
//! the collector spread over time and interleaved with other steps. A step is closed when every
//! rank of the world has moved past it (reported a later step: whatever it had for s has been
//! sent, because an agent sends in step order) or when `timeout` has passed since its first
//! row; in the second case the ranks with no row at all for s are reported missing. Steps close
//! in order, so the detectors downstream see a monotone stream. Rows for a step that is already
//! closed are late: they stay stored, but are counted instead of reopening the step.
//!
//! Replica fingerprints (`param_fingerprint` and `param_locator` per rank, `layer_fingerprint`
//! per rank and block, the optimizer's digest and locator) join their step too, and close with
//! it: the replicas' digests are compared once every rank has sent them.
//!
//! Sketches travel the same way and give the step's cos_pair_mean when two ranks or more sent
//! one with the same seed and kind. They travel in their own requests, though, so only samples
//! move a rank past a step: the agent sends a batch's sketches before its samples, and a
//! rank's sample of step s+1 then means its sketch of s has arrived. (When a sketch moved the
//! rank on, the samples of the steps before it, still in flight, arrived late; when samples
//! went first, a step closed before its sketches and the run lost its cos_pair_mean there,
//! under load most sketched steps.)

use std::collections::BTreeMap;

use rankwatch_analytics::detect::RankFingerprint;
use rankwatch_analytics::math::{self, RankValues};
use rankwatch_analytics::{Metric, SketchRecord};

/// A step as the aligner closes it.
#[derive(Debug, Clone, PartialEq)]
pub struct ClosedStep {
    pub step: u64,
    /// Latest sample time of the step (the agents' clocks).
    pub time_ms: i64,
    pub ranks: Vec<RankValues>,
    /// NaN/Inf counts per rank, as reported.
    pub nonfinite: Vec<(u32, f64)>,
    /// Ranks of the world with no row for this step (only when it closed on the timeout).
    pub missing: Vec<u32>,
    pub cos_pair_mean: Option<f64>,
    /// The replica fingerprints of the ranks that sent a whole-model one, by rank.
    pub fingerprints: Vec<RankFingerprint>,
    /// Whether it closed because every rank had moved on (else: the timeout).
    pub complete: bool,
}

/// One rank's replica digests for a step, as they arrive.
#[derive(Debug, Default)]
struct Digests {
    model: Option<f64>,
    locator: Option<f64>,
    /// By block: a batch delivered twice must not count a rank's digest twice.
    layers: BTreeMap<u32, f64>,
    optimizer: Option<f64>,
    optimizer_locator: Option<f64>,
    replica_set: Option<f64>,
}

/// Which replica digest a row carries.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Digest {
    Model,
    ModelLocator,
    Layer(u32),
    Optimizer,
    OptimizerLocator,
    ReplicaSet,
}

#[derive(Debug, Default)]
struct OpenStep {
    first_seen_ms: i64,
    time_ms: i64,
    /// One entry per (rank, step) group as the groups arrive: a rank's rows of a step come
    /// together, so this is one entry a rank, appended rather than looked up in a map. The
    /// rare rank that sent a step in two batches is merged when the step closes.
    ranks: Vec<RankValues>,
    /// NaN/Inf counts, gathered the same way (summed per rank when the step closes).
    nonfinite: Vec<(u32, f64)>,
    sketches: BTreeMap<u32, SketchRecord>,
    /// Per rank: the whole-model digest, each block's, the optimizer state's.
    fingerprints: BTreeMap<u32, Digests>,
}

/// One run's aligner.
#[derive(Debug)]
pub struct StepAligner {
    timeout_ms: i64,
    open: BTreeMap<u64, OpenStep>,
    /// Latest step each rank reported anything for, and when (the collector's clock). Hashed:
    /// every (rank, step) group looks its rank up; the few readers that need rank order sort.
    latest: foldhash::HashMap<u32, (u64, i64)>,
    /// How many ranks of the world (`world`) have each latest step, and how many were heard:
    /// the step every rank has moved past is the first key once all were, kept as ranks move
    /// instead of taken as a minimum over the world at every batch (that was O(world) per
    /// batch, O(world²) a step when every rank posts its own).
    world: Option<u32>,
    at_step: BTreeMap<u64, u32>,
    heard: u32,
    /// Every step at or below this is closed.
    closed_through: Option<u64>,
    late_rows: u64,
    /// The rows of the batch being read, applied when it ends (see [`StepAligner::stage`]).
    staged: Vec<StagedRow>,
}

/// The per-rank scalar a row carries, when it is one the aligner gathers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RankScalar {
    Loss,
    Tokens,
    GradNorm,
    GradNormMean,
    CosToMean,
    Nonfinite,
}

impl RankScalar {
    /// The scalar `metric` is, if the aligner gathers it.
    pub fn of(metric: Metric) -> Option<RankScalar> {
        Some(match metric {
            Metric::Loss => RankScalar::Loss,
            Metric::Tokens => RankScalar::Tokens,
            Metric::GradNorm => RankScalar::GradNorm,
            Metric::GradNormMean => RankScalar::GradNormMean,
            Metric::CosToMean => RankScalar::CosToMean,
            Metric::Nonfinite => RankScalar::Nonfinite,
            _ => return None,
        })
    }

    /// The scalars kept in a rank's [`RankValues`] (the NaN count is kept apart).
    const VALUES: [RankScalar; 5] = [
        RankScalar::Loss,
        RankScalar::Tokens,
        RankScalar::GradNorm,
        RankScalar::GradNormMean,
        RankScalar::CosToMean,
    ];

    /// Where this scalar is kept in a rank's values; `None` for the NaN count.
    fn slot(self, values: &mut RankValues) -> Option<&mut Option<f64>> {
        Some(match self {
            RankScalar::Loss => &mut values.loss,
            RankScalar::Tokens => &mut values.tokens,
            RankScalar::GradNorm => &mut values.grad_norm,
            RankScalar::GradNormMean => &mut values.grad_norm_mean,
            RankScalar::CosToMean => &mut values.cos_to_mean,
            RankScalar::Nonfinite => return None,
        })
    }
}

/// What a staged row brings to its step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Staged {
    /// Only that its rank is alive at its step (a row the aligner does not gather).
    Seen,
    Scalar(RankScalar),
    Digest(Digest),
}

#[derive(Debug, Clone, Copy)]
struct StagedRow {
    rank: u32,
    step: u64,
    time_ms: i64,
    what: Staged,
    value: f64,
}

impl StepAligner {
    /// An aligner that closes a step `timeout_ms` after its first row at the latest.
    pub fn new(timeout_ms: i64) -> Self {
        StepAligner {
            timeout_ms,
            open: BTreeMap::new(),
            latest: Default::default(),
            world: None,
            at_step: BTreeMap::new(),
            heard: 0,
            closed_through: None,
            late_rows: 0,
            staged: Vec::new(),
        }
    }

    /// Rows that arrived for steps already closed, since the last call.
    pub fn take_late_rows(&mut self) -> u64 {
        std::mem::take(&mut self.late_rows)
    }

    /// `rank`'s latest step and when the collector saw it, if it reported at all.
    pub fn last_seen(&self, rank: u32) -> Option<(u64, i64)> {
        self.latest.get(&rank).copied()
    }

    /// Steps waiting to close.
    pub fn open_steps(&self) -> usize {
        self.open.len()
    }

    fn is_closed(&self, step: u64) -> bool {
        self.closed_through.is_some_and(|c| step <= c)
    }

    fn step_mut(&mut self, step: u64, now_ms: i64) -> &mut OpenStep {
        // Room for every rank heard from (up to a bound), so the step's entries are not moved
        // as it fills.
        let ranks = self.latest.len().min(1 << 16);
        self.open.entry(step).or_insert_with(|| OpenStep {
            first_seen_ms: now_ms,
            ranks: Vec::with_capacity(ranks),
            ..OpenStep::default()
        })
    }

    /// Keeps a row of the batch being read: appending is all a row costs. The batch's rows are
    /// applied together by [`StepAligner::apply_staged`], each run of rows of one (rank, step)
    /// (an agent sends a step's rows together) with one look-up of its rank and step.
    pub fn stage(&mut self, rank: u32, step: u64, time_ms: i64, what: Staged, value: f64) {
        self.staged.push(StagedRow {
            rank,
            step,
            time_ms,
            what,
            value,
        });
    }

    /// Applies the staged rows, as seen at `now_ms`.
    pub fn apply_staged(&mut self, now_ms: i64) {
        let staged = std::mem::take(&mut self.staged);
        for group in staged.chunk_by(|a, b| (a.rank, a.step) == (b.rank, b.step)) {
            self.apply(group, now_ms);
        }
        // Keep the allocation for the next batch.
        self.staged = staged;
        self.staged.clear();
    }

    /// One (rank, step)'s rows.
    fn apply(&mut self, group: &[StagedRow], now_ms: i64) {
        let (rank, step) = (group[0].rank, group[0].step);
        self.note(rank, step, now_ms);
        if self.is_closed(step) {
            self.late_rows += group.len() as u64;
            return;
        }
        // Rows that only show the rank alive do not open their step.
        let Some(time_ms) = group
            .iter()
            .filter(|r| r.what != Staged::Seen)
            .map(|r| r.time_ms)
            .max()
        else {
            return;
        };
        let gathers = group
            .iter()
            .any(|r| matches!(r.what, Staged::Scalar(w) if w != RankScalar::Nonfinite));
        let open = self.step_mut(step, now_ms);
        open.time_ms = open.time_ms.max(time_ms);
        let OpenStep {
            ranks,
            nonfinite,
            fingerprints,
            ..
        } = open;
        let mut values = gathers.then(|| {
            if ranks.last().is_none_or(|v| v.rank != rank) {
                ranks.push(RankValues {
                    rank,
                    ..RankValues::default()
                });
            }
            ranks.last_mut().expect("pushed above")
        });
        for row in group {
            match row.what {
                Staged::Seen => {}
                Staged::Scalar(RankScalar::Nonfinite) => match nonfinite.last_mut() {
                    Some((r, count)) if *r == rank => *count += row.value,
                    // Counted up from 0.0, as a sum is (so -0.0 arrives as 0.0).
                    _ => nonfinite.push((rank, 0.0 + row.value)),
                },
                Staged::Scalar(what) => {
                    // `gathers` saw this row, so the rank's values exist.
                    if let Some(slot) = values.as_deref_mut().and_then(|v| what.slot(v)) {
                        *slot = Some(row.value);
                    }
                }
                Staged::Digest(what) => {
                    let entry = fingerprints.entry(rank).or_default();
                    match what {
                        Digest::Model => entry.model = Some(row.value),
                        Digest::ModelLocator => entry.locator = Some(row.value),
                        Digest::Layer(layer) => {
                            entry.layers.insert(layer, row.value);
                        }
                        Digest::Optimizer => entry.optimizer = Some(row.value),
                        Digest::OptimizerLocator => entry.optimizer_locator = Some(row.value),
                        Digest::ReplicaSet => entry.replica_set = Some(row.value),
                    }
                }
            }
        }
    }

    /// `rank` reported `step` at `now_ms`: its latest step moves on, and the count of ranks
    /// at each step with it.
    fn note(&mut self, rank: u32, step: u64, now_ms: i64) {
        let from = match self.latest.entry(rank) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert((step, now_ms));
                None
            }
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let (old, _) = *o.get();
                *o.get_mut() = (old.max(step), now_ms);
                if step <= old {
                    return;
                }
                Some(old)
            }
        };
        if self.world.is_some_and(|w| rank < w) {
            match from {
                Some(old) => leave(&mut self.at_step, old),
                None => self.heard += 1,
            }
            *self.at_step.entry(step).or_insert(0) += 1;
        }
    }

    /// Counts the ranks of a world of `world` afresh (its size became known or changed).
    fn recount(&mut self, world: Option<u32>) {
        self.world = world;
        self.at_step.clear();
        self.heard = 0;
        let Some(world) = world else {
            return;
        };
        for (_, &(step, _)) in self.latest.iter().filter(|(rank, _)| **rank < world) {
            self.heard += 1;
            *self.at_step.entry(step).or_insert(0) += 1;
        }
    }

    /// Adds one rank's gradient sketch.
    pub fn add_sketch(&mut self, sketch: SketchRecord, now_ms: i64) {
        // The rank is alive, but not past any step on a sketch's word (see the module header).
        if let Some(latest) = self.latest.get_mut(&sketch.rank) {
            latest.1 = now_ms;
        }
        if self.is_closed(sketch.step) {
            self.late_rows += 1;
            return;
        }
        let open = self.step_mut(sketch.step, now_ms);
        open.time_ms = open.time_ms.max(sketch.time_ms);
        open.sketches.insert(sketch.rank, sketch);
    }

    /// Closes every step that is ready at `now_ms`, in step order. `world_size` is the run's
    /// (when known; else the ranks seen so far stand for the world). With `all`, every open
    /// step closes (the run is being evicted). Staged rows are applied first.
    pub fn close_ready(
        &mut self,
        world_size: Option<u32>,
        now_ms: i64,
        all: bool,
    ) -> Vec<ClosedStep> {
        self.apply_staged(now_ms);
        if world_size != self.world {
            self.recount(world_size);
        }
        // The last step that every rank of the world has moved past. Without a known world
        // size a rank not yet heard from could still be on its way: only the timeout closes.
        let moved_past = world_size
            .filter(|&w| self.heard == w)
            .and_then(|_| self.at_step.first_key_value().map(|(&step, _)| step));
        // The newest step that timed out; every step before it closes with it.
        let timed_out = self
            .open
            .iter()
            .filter(|(_, s)| all || now_ms - s.first_seen_ms >= self.timeout_ms)
            .map(|(step, _)| *step)
            .max();
        let mut closed = Vec::new();
        // The world's ranks, listed only when a step closes on the timeout and its missing
        // ranks are named.
        let mut listed: Option<Vec<u32>> = None;
        while let Some((&step, _)) = self.open.first_key_value() {
            let complete = moved_past.is_some_and(|m| m > step);
            if !complete && timed_out.is_none_or(|t| step > t) {
                break;
            }
            let mut open = self.open.remove(&step).unwrap_or_default();
            merge_ranks(&mut open);
            self.closed_through = Some(step);
            let missing = if complete {
                Vec::new()
            } else {
                let listed = listed.get_or_insert_with(|| match world_size {
                    Some(n) => (0..n).collect(),
                    None => {
                        let mut heard: Vec<u32> = self.latest.keys().copied().collect();
                        heard.sort_unstable();
                        heard
                    }
                });
                missing(&open, listed)
            };
            closed.push(close(step, open, missing, complete));
        }
        closed
    }
}

/// One rank fewer at `step`.
fn leave(at_step: &mut BTreeMap<u64, u32>, step: u64) {
    if let std::collections::btree_map::Entry::Occupied(mut o) = at_step.entry(step) {
        *o.get_mut() -= 1;
        if *o.get() == 0 {
            o.remove();
        }
    }
}

/// The ranks of `world` with no row at all for a step (its ranks and counts merged: sorted by
/// rank).
fn missing(open: &OpenStep, world: &[u32]) -> Vec<u32> {
    world
        .iter()
        .copied()
        .filter(|r| {
            open.ranks.binary_search_by_key(r, |v| v.rank).is_err()
                && open
                    .nonfinite
                    .binary_search_by_key(r, |&(rank, _)| rank)
                    .is_err()
                && !open.sketches.contains_key(r)
                && !open.fingerprints.contains_key(r)
        })
        .collect()
}

/// Puts a step's per-rank entries in rank order, one a rank: a rank's later group fills in what
/// it sent (its values replace the earlier ones, as rows of one group do), and NaN counts add
/// up, in arrival order. Ranks mostly arrive in order, which a stable sort takes in one pass.
fn merge_ranks(open: &mut OpenStep) {
    open.ranks.sort_by_key(|v| v.rank);
    open.ranks.dedup_by(|later, kept| {
        if later.rank != kept.rank {
            return false;
        }
        for what in RankScalar::VALUES {
            if let (Some(&mut value), Some(slot)) = (what.slot(later), what.slot(kept)) {
                *slot = value.or(*slot);
            }
        }
        true
    });
    open.nonfinite.sort_by_key(|&(rank, _)| rank);
    open.nonfinite.dedup_by(|later, kept| {
        let same = later.0 == kept.0;
        if same {
            kept.1 += later.1;
        }
        same
    });
}

fn close(step: u64, open: OpenStep, missing: Vec<u32>, complete: bool) -> ClosedStep {
    ClosedStep {
        step,
        time_ms: open.time_ms,
        ranks: open.ranks,
        nonfinite: open.nonfinite,
        missing,
        cos_pair_mean: sketch_pair_mean(&open.sketches),
        fingerprints: open
            .fingerprints
            .into_iter()
            .filter_map(|(rank, d)| {
                Some(RankFingerprint {
                    rank,
                    model: d.model?,
                    locator: d.locator,
                    layers: d.layers.into_iter().collect(),
                    optimizer: d.optimizer,
                    optimizer_locator: d.optimizer_locator,
                    // An index below the world size, exact in the f64 it travels as.
                    replica_set: d.replica_set.map(|s| s as u32),
                })
            })
            .collect(),
        complete,
    }
}

/// Mean pairwise cosine of the sketches that share the most common (seed, kind, length), in
/// O(ranks × length) (`math::sketch_pair_mean`; the matrix it replaces was O(ranks²)).
fn sketch_pair_mean(sketches: &BTreeMap<u32, SketchRecord>) -> Option<f64> {
    let first = sketches.values().next()?;
    let same: Vec<&SketchRecord> = sketches
        .values()
        .filter(|s| {
            s.seed == first.seed && s.kind == first.kind && s.vector.len() == first.vector.len()
        })
        .collect();
    if same.len() < 2 {
        return None;
    }
    let vectors: Vec<&[f32]> = same.iter().map(|s| s.vector.as_slice()).collect();
    let norms: Vec<f64> = same.iter().map(|s| s.norm).collect();
    math::sketch_pair_mean(&vectors, &norms).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One row at a time, as a batch of one.
    impl StepAligner {
        fn add(
            &mut self,
            rank: u32,
            step: u64,
            time_ms: i64,
            now_ms: i64,
            what: RankScalar,
            value: f64,
        ) {
            self.stage(rank, step, time_ms, Staged::Scalar(what), value);
            self.apply_staged(now_ms);
        }

        fn add_fingerprint(
            &mut self,
            rank: u32,
            step: u64,
            time_ms: i64,
            now_ms: i64,
            what: Digest,
            value: f64,
        ) {
            self.stage(rank, step, time_ms, Staged::Digest(what), value);
            self.apply_staged(now_ms);
        }
    }

    fn loss(a: &mut StepAligner, rank: u32, step: u64, now: i64) {
        a.add(
            rank,
            step,
            step as i64,
            now,
            RankScalar::Loss,
            1.0 + f64::from(rank),
        );
    }

    #[test]
    fn a_step_closes_once_every_rank_moved_past_it() {
        let mut a = StepAligner::new(10_000);
        loss(&mut a, 0, 1, 0);
        loss(&mut a, 1, 1, 0);
        assert!(a.close_ready(Some(2), 5, false).is_empty());
        loss(&mut a, 0, 2, 5);
        assert!(
            a.close_ready(Some(2), 6, false).is_empty(),
            "rank 1 may still send step 1"
        );
        loss(&mut a, 1, 2, 7);
        let closed = a.close_ready(Some(2), 8, false);
        assert_eq!(closed.len(), 1);
        assert!(closed[0].complete && closed[0].missing.is_empty());
        assert_eq!(closed[0].ranks.len(), 2);
        // A late row for step 1 is counted, not reopened.
        loss(&mut a, 1, 1, 9);
        assert_eq!(a.take_late_rows(), 1);
        assert_eq!(a.open_steps(), 1);
    }

    fn sketch(a: &mut StepAligner, rank: u32, step: u64, now: i64) {
        let vector = vec![1.0, f32::from(rank as u8)];
        let norm = vector
            .iter()
            .map(|v| f64::from(*v).powi(2))
            .sum::<f64>()
            .sqrt();
        let run = rankwatch_analytics::RunId::new("r").unwrap();
        a.add_sketch(
            SketchRecord {
                run,
                rank,
                step,
                time_ms: step as i64,
                kind: rankwatch_analytics::math::SketchKind::Rademacher,
                seed: 7,
                norm,
                vector,
            },
            now,
        );
    }

    #[test]
    fn a_sketch_does_not_move_its_rank_past_the_steps_still_in_flight() {
        let mut a = StepAligner::new(10_000);
        for step in 1..=4 {
            loss(&mut a, 1, step, 0);
        }
        loss(&mut a, 0, 1, 0);
        // Rank 0's next batch: its sketch of step 3 comes first, its samples of 2..=4 after.
        sketch(&mut a, 0, 3, 1);
        sketch(&mut a, 1, 3, 1);
        assert!(
            a.close_ready(Some(2), 2, false).is_empty(),
            "rank 0 has not sent step 2's samples yet"
        );
        for step in 2..=4 {
            loss(&mut a, 0, step, 3);
        }
        let closed = a.close_ready(Some(2), 4, false);
        assert_eq!(closed.iter().map(|c| c.step).collect::<Vec<_>>(), [1, 2, 3]);
        assert!(closed.iter().all(|c| c.complete && c.ranks.len() == 2));
        assert!(
            closed[2].cos_pair_mean.is_some(),
            "step 3 closes with its sketches"
        );
        assert_eq!(a.take_late_rows(), 0);
    }

    #[test]
    fn the_world_size_can_come_late_change_and_ignore_ranks_outside_it() {
        let steps = |closed: Vec<ClosedStep>| closed.iter().map(|c| c.step).collect::<Vec<_>>();
        let mut a = StepAligner::new(10_000);
        for rank in 0..3 {
            loss(&mut a, rank, 1, 0);
            loss(&mut a, rank, 2, 0);
        }
        // A rank outside the world (a world that shrank) does not hold steps back.
        loss(&mut a, 7, 1, 0);
        // Without a world size only the timeout closes.
        assert!(a.close_ready(None, 1, false).is_empty());
        // Announced as 3: every rank of it moved past step 1.
        assert_eq!(steps(a.close_ready(Some(3), 2, false)), [1]);
        for rank in 0..3 {
            loss(&mut a, rank, 3, 3);
        }
        // Grown to 4: rank 3 has not reported, so step 2 waits for it.
        assert!(a.close_ready(Some(4), 4, false).is_empty());
        loss(&mut a, 3, 3, 5);
        assert_eq!(steps(a.close_ready(Some(4), 6, false)), [2]);
        // Back to 3: rank 3 no longer counts; steps move on with the three.
        for rank in 0..3 {
            loss(&mut a, rank, 4, 7);
        }
        assert_eq!(steps(a.close_ready(Some(3), 8, false)), [3]);
    }

    #[test]
    fn the_timeout_closes_in_order_and_names_the_missing_ranks() {
        let mut a = StepAligner::new(1_000);
        for step in 1..=3 {
            loss(&mut a, 0, step, 100 * step as i64);
            loss(&mut a, 2, step, 100 * step as i64);
        }
        assert!(a.close_ready(Some(3), 1_099, false).is_empty());
        let closed = a.close_ready(Some(3), 1_200, false);
        assert_eq!(
            closed.iter().map(|c| c.step).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!(closed.iter().all(|c| c.missing == vec![1] && !c.complete));
        let closed = a.close_ready(Some(3), 0, true);
        assert_eq!(closed.len(), 1);
        assert_eq!(closed[0].step, 3);
    }

    #[test]
    fn a_rank_that_sends_a_step_in_two_batches_is_one_rank_of_it() {
        let mut a = StepAligner::new(10_000);
        // Rank 1 first, out of order; rank 0's step 5 in two batches with rank 1's between.
        a.add(1, 5, 5, 0, RankScalar::Loss, 9.0);
        a.add(0, 5, 5, 0, RankScalar::Loss, 1.0);
        a.add(0, 5, 5, 0, RankScalar::Nonfinite, 2.0);
        a.add(1, 5, 5, 0, RankScalar::GradNorm, 3.0);
        a.add(0, 5, 5, 0, RankScalar::GradNorm, 4.0);
        a.add(0, 5, 5, 0, RankScalar::Loss, 1.5);
        a.add(0, 5, 5, 0, RankScalar::Nonfinite, 1.0);
        for rank in 0..2 {
            loss(&mut a, rank, 6, 1);
        }
        let closed = a.close_ready(Some(2), 2, false);
        assert_eq!(closed.len(), 1);
        let ranks: Vec<_> = closed[0]
            .ranks
            .iter()
            .map(|v| (v.rank, v.loss, v.grad_norm))
            .collect();
        assert_eq!(
            ranks,
            [(0, Some(1.5), Some(4.0)), (1, Some(9.0), Some(3.0))],
            "the later batch's loss replaces the earlier; what it did not send is kept"
        );
        assert_eq!(closed[0].nonfinite, [(0, 3.0)]);
    }

    #[test]
    fn fingerprints_close_with_their_step_and_only_whole_model_ones_count() {
        let mut a = StepAligner::new(10_000);
        for rank in 0..3 {
            a.add_fingerprint(rank, 10, 10, 0, Digest::Model, 7.0 + f64::from(rank / 2));
            a.add_fingerprint(rank, 10, 10, 0, Digest::Layer(0), 1.0);
            a.add_fingerprint(rank, 10, 10, 0, Digest::Layer(1), 2.0);
            loss(&mut a, rank, 10, 0);
        }
        // Rank 3 sent block digests without the whole model's (a truncated report).
        a.add_fingerprint(3, 10, 10, 0, Digest::Layer(0), 1.0);
        loss(&mut a, 3, 10, 0);
        for rank in 0..4 {
            loss(&mut a, rank, 11, 1);
        }
        let closed = a.close_ready(Some(4), 2, false);
        assert_eq!(closed.len(), 1);
        let got: Vec<(u32, f64, usize)> = closed[0]
            .fingerprints
            .iter()
            .map(|f| (f.rank, f.model, f.layers.len()))
            .collect();
        assert_eq!(got, vec![(0, 7.0, 2), (1, 7.0, 2), (2, 8.0, 2)]);
    }
}
