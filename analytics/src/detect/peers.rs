//! What the other ranks of the same step say about one rank, with no baseline at all: the
//! part of `silent_inconsistency` that sees an inconsistency present from step 0.
//!
//! Healthy data-parallel workers are exchangeable: each draws its batch from the same
//! distribution, so which rank has the highest loss, the largest gradient norm or the lowest
//! cosine to the mean changes from step to step, each rank about 1/K of the time. Two things
//! break that, whatever the run's history:
//!
//! * **A rank that stands out step after step.** At each step, every rank whose distance from
//!   the median of the *other* ranks (loss or gradient norm relative to theirs, either way, or
//!   cosine to the mean below theirs) reaches `peer_min_effect` is noted; a rank noted at
//!   `peer_share` of the steps logged in the last `peer_window` steps (bounded in steps, judged
//!   once `peer_min_observations` are in it, so sparse logging neither stretches the window
//!   nor judges on a handful of steps) breaches, and the verdict holds (neither
//!   breach nor clear) while the most-noted rank's share stays above half of that, so an alert
//!   does not flap on the steps where the rank happens to sit close to its peers. By chance,
//!   with K = 4, one rank is the furthest at 40 of 50 steps with probability ~5×10⁻¹⁶. A
//!   share of the window needs 40 noted steps after a fault begins, so a rank noted at each of
//!   the last `peer_run` logged steps of the window breaches too (and holds from half of
//!   that; logged every 10th step, the window never holds that many): a rank whose
//!   gradient is ×4 from step 60 is named about 14 steps later, not 40. Noted at a step by
//!   chance with probability p, a rank is noted 12 times in a row with p¹² (6×10⁻¹¹ at
//!   p = 0.14, the most a healthy tuning run's rank was noted at); what keeps that bound
//!   honest is that chance notes do not come in runs, which those runs check (their longest
//!   run was 6: docs/detection.md § Held-out protocol, the second set). The
//!   effect floor is what keeps healthy differences out: ranks reading contiguous shards of a
//!   corpus see persistently different content, which is how many pipelines shard, not a fault
//!   (the detection benchmark's shard runs raised nothing). A rank whose data is corrupted or
//!   off-task, or whose gradient is scaled, is far past it.
//! * **Ranks fed identical data.** Ranks that compute the same loss and the same gradient norm,
//!   to the bit, for `identical_steps` steps are training on the same batches: a data seed or
//!   sampler shared where it must differ (the first setting of arXiv 2602.14462's seed
//!   experiment; seeding by local rank gives one group per local rank), which silently shrinks
//!   the effective batch. The partition into groups must hold for those steps. With different data the chance
//!   of two bit-identical float losses is nil; the gradient norm (measured by the agent, never
//!   rounded by the user) must match too.
//!
//! Both need no baseline, so they judge from step 0 and cannot latch; both need the per-rank
//! values of every rank at the step, and the stand-out test needs three ranks or more. The
//! cost is a sort per quantity and step (each rank's others-median is read off the sorted
//! column), so 1,024 ranks cost what a sort of 1,024 numbers does.

use std::collections::{BTreeMap, VecDeque};

use super::lifecycle::Breach;
use super::same_batches::{SameBatchConfig, SameBatches};
use super::{SAME_BATCHES, short};
use crate::alert::Severity;
use crate::math::dispersion::median;
use crate::math::step::RankValues;

/// One rank noted at one step.
#[derive(Debug, Clone, Copy)]
struct Standout {
    rank: u32,
    /// How far: the effect that was compared with the floor.
    effect: f64,
    /// What to say: loss or gradient norm relative to the others' median (e.g. 2.9 for 2.9×),
    /// or the cosine gap, as `what` says.
    value: f64,
    what: Quantity,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quantity {
    Loss,
    GradNorm,
    Cosine,
}

/// The peers' verdict on one step.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum PeerVerdict {
    /// A warning; its value is the share of the window (stand-out) or the steps identical
    /// (identical data).
    Breach(Breach),
    /// Inside the hysteresis band: neither breach nor clear.
    Hold,
    Clear,
}

/// Thresholds, from `SilentInconsistencyConfig`.
#[derive(Debug, Clone, Copy)]
pub(super) struct PeerConfig {
    /// Steps (not observations) the stand-out window spans.
    pub(super) window: usize,
    /// Observations in the window needed to judge.
    pub(super) min_observations: usize,
    pub(super) share: f64,
    /// Logged steps in a row noted that breach (0: off).
    pub(super) run: usize,
    pub(super) min_effect: f64,
    pub(super) identical_steps: u32,
    pub(super) same_batch: SameBatchConfig,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Peers {
    /// The steps of the last `window` steps that had values, with the ranks noted at each.
    recent: VecDeque<(u64, Vec<Standout>)>,
    /// Steps each rank is noted at within `recent`.
    noted: BTreeMap<u32, usize>,
    /// Logged steps in a row, up to the last and within the window, each rank was noted at.
    streaks: BTreeMap<u32, usize>,
    /// The groups of ranks with bit-identical values, and for how many steps in a row.
    identical: Option<(Vec<Vec<u32>>, u32)>,
    /// Ranks fed the same batches that do not agree to the bit.
    same_batches: SameBatches,
}

impl PeerVerdict {
    /// Both tests' verdicts as one: a breach of either (both joined), else a hold of either,
    /// else clear.
    pub(super) fn either(self, other: PeerVerdict) -> PeerVerdict {
        match (self, other) {
            (PeerVerdict::Breach(a), PeerVerdict::Breach(b)) => PeerVerdict::Breach(a.join(b)),
            (PeerVerdict::Breach(b), _) | (_, PeerVerdict::Breach(b)) => PeerVerdict::Breach(b),
            (PeerVerdict::Hold, _) | (_, PeerVerdict::Hold) => PeerVerdict::Hold,
            (PeerVerdict::Clear, PeerVerdict::Clear) => PeerVerdict::Clear,
        }
    }
}

type Getter = fn(&RankValues) -> Option<f64>;

/// One step as the tests that compare ranks read it: each rank's values, and each rank's loss
/// against the others' median ([`against_others`], computed once a step for both the
/// stand-out and the shift test).
#[derive(Debug, Clone, Copy)]
pub(super) struct PeerStep<'a> {
    pub(super) step: u64,
    pub(super) ranks: &'a [RankValues],
    pub(super) loss: &'a [Option<(f64, f64)>],
}

/// For each rank (by index), its own value of `get` and the median of the other ranks' values,
/// where it has a value and at least one other does (the stand-out test asks for three ranks
/// before it calls this; the shift test takes two). Nothing when some rank's value is not
/// finite: that rank is `nonfinite`'s to report, and the others measured without it are a
/// different set of ranks, moved by what the fault does to training (one rank's overflowing
/// gradient stalls every update; with 4 ranks, the 3 left make each a stand-out against the
/// other two). One sort: removing one value from a sorted column shifts the median by at most
/// one place.
pub(super) fn against_others(ranks: &[RankValues], get: Getter) -> Vec<Option<(f64, f64)>> {
    if ranks.iter().filter_map(get).any(|v| !v.is_finite()) {
        return vec![None; ranks.len()];
    }
    let mut sorted = Vec::with_capacity(ranks.len());
    sorted.extend(
        ranks
            .iter()
            .enumerate()
            .filter_map(|(i, r)| get(r).filter(|v| v.is_finite()).map(|v| (v, i))),
    );
    let mut out = vec![None; ranks.len()];
    let m = sorted.len().saturating_sub(1);
    if m < 1 {
        return out;
    }
    // Unstable: equal values in either order give the same column of values.
    sorted.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
    for (p, &(own, i)) in sorted.iter().enumerate() {
        let at = |j: usize| sorted[if j < p { j } else { j + 1 }].0;
        let others = if m % 2 == 1 {
            at(m / 2)
        } else {
            (at(m / 2 - 1) + at(m / 2)) / 2.0
        };
        out[i] = Some((own, others));
    }
    out
}

/// Up to eight ranks by number, then how many in all.
fn list(ranks: &[u32]) -> String {
    let shown: Vec<String> = ranks.iter().take(8).map(u32::to_string).collect();
    if ranks.len() > 8 {
        format!("{}, … ({} ranks)", shown.join(", "), ranks.len())
    } else {
        shown.join(", ")
    }
}

impl Peers {
    /// Folds in one step.
    pub(super) fn observe(&mut self, at: PeerStep<'_>, c: PeerConfig) -> PeerVerdict {
        let identical = if c.identical_steps > 0 {
            self.identical(at.ranks, c.identical_steps)
        } else {
            None
        };
        let same = self.same_batches.observe(at.step, at.ranks, c.same_batch);
        let standout = if c.window > 0 {
            self.standout(at, c)
        } else {
            PeerVerdict::Clear
        };
        let verdict = match identical {
            Some(a) => PeerVerdict::Breach(a).either(standout),
            None => standout,
        };
        match verdict.either(same) {
            PeerVerdict::Breach(mut found) => {
                found.outlier_ranks.sort_unstable();
                PeerVerdict::Breach(found)
            }
            verdict => verdict,
        }
    }

    fn standout(&mut self, at: PeerStep<'_>, c: PeerConfig) -> PeerVerdict {
        let PeerStep { step, ranks, loss } = at;
        let noted = if ranks.len() >= 3 {
            Self::distant(ranks, loss, c.min_effect)
        } else {
            vec![]
        };
        // A step that goes back (a resume) starts the window over.
        if self.recent.back().is_some_and(|(last, _)| *last >= step) {
            self.recent.clear();
            self.noted.clear();
            self.streaks.clear();
        }
        for s in &noted {
            *self.noted.entry(s.rank).or_default() += 1;
        }
        self.streaks = noted
            .iter()
            .map(|s| (s.rank, self.streaks.get(&s.rank).map_or(1, |n| n + 1)))
            .collect();
        self.recent.push_back((step, noted));
        // Bounded in steps: logging every 10th step does not stretch it over 500 steps.
        let oldest = step.saturating_sub(c.window as u64);
        while self
            .recent
            .front()
            .is_some_and(|(s, _)| *s <= oldest && *s != step)
        {
            for s in self.recent.pop_front().map(|(_, n)| n).unwrap_or_default() {
                if let Some(n) = self.noted.get_mut(&s.rank) {
                    *n -= 1;
                    if *n == 0 {
                        self.noted.remove(&s.rank);
                    }
                }
            }
        }
        // A run is bounded by the window too: logged every 10th step, 12 in a row would span
        // 120 steps.
        let in_window = self.recent.len();
        for n in self.streaks.values_mut() {
            *n = (*n).min(in_window);
        }
        let judged = in_window >= c.min_observations;
        let window = self.recent.len() as f64;
        let share_of = |n: usize| n as f64 / window;
        let by_share = |n: usize| judged && share_of(n) >= c.share;
        let by_run = |rank: &u32| c.run > 0 && self.streaks.get(rank).is_some_and(|&n| n >= c.run);
        let named: Vec<(u32, usize)> = self
            .noted
            .iter()
            .filter(|&(rank, &n)| by_share(n) || by_run(rank))
            .map(|(&r, &n)| (r, n))
            .collect();
        if named.is_empty() {
            let top = self.noted.values().copied().max().unwrap_or(0);
            let longest = self.streaks.values().copied().max().unwrap_or(0);
            let held =
                (judged && share_of(top) >= c.share / 2.0) || (c.run > 0 && 2 * longest >= c.run);
            return if held {
                PeerVerdict::Hold
            } else {
                PeerVerdict::Clear
            };
        }
        let others = ranks.len() - 1;
        let parts: Vec<String> = named
            .iter()
            .map(|&(rank, n)| {
                if by_share(n) {
                    format!("rank {rank} stood out from the other {others} ranks at {n} of the last {} steps ({})", self.recent.len(), self.how(rank))
                } else {
                    format!("rank {rank} stood out from the other {others} ranks at each of the last {} steps ({})", self.streaks[&rank], self.how(rank))
                }
            })
            .collect();
        // What the alert shows beside its threshold: the share of the window where one rank
        // reached it, else the run that did.
        let (value, threshold) = if named.iter().any(|&(_, n)| by_share(n)) {
            let top = named.iter().map(|&(_, n)| share_of(n)).fold(0.0, f64::max);
            (top, c.share)
        } else {
            let longest = named
                .iter()
                .map(|(r, _)| self.streaks[r])
                .max()
                .unwrap_or(0);
            (longest as f64, c.run as f64)
        };
        PeerVerdict::Breach(Breach {
            severity: Severity::Warning,
            value,
            threshold,
            explanation: parts.join("; "),
            outlier_ranks: named.iter().map(|&(r, _)| r).collect(),
        })
    }

    /// How `rank` stood out over the window: its most frequent quantity and typical value.
    fn how(&self, rank: u32) -> String {
        let mine: Vec<&Standout> = self
            .recent
            .iter()
            .flat_map(|(_, noted)| noted)
            .filter(|s| s.rank == rank)
            .collect();
        let count = |q: Quantity| mine.iter().filter(|s| s.what == q).count();
        let what = [Quantity::Loss, Quantity::GradNorm, Quantity::Cosine]
            .into_iter()
            .max_by_key(|&q| count(q))
            .unwrap_or(Quantity::Loss);
        let mut values: Vec<f64> = mine
            .iter()
            .filter(|s| s.what == what)
            .map(|s| s.value)
            .collect();
        // Two decimals are enough to say how far ("1.4× theirs").
        let typical = (median(&mut values) * 100.0).round() / 100.0;
        match what {
            Quantity::Loss => format!("loss {}× theirs", short(typical)),
            Quantity::GradNorm => format!("gradient norm {}× theirs", short(typical)),
            Quantity::Cosine => format!(
                "cosine to the mean gradient {} below theirs",
                short(typical)
            ),
        }
    }

    /// Every rank at least `min_effect` from the others' median this step, by its largest effect.
    fn distant(
        ranks: &[RankValues],
        loss: &[Option<(f64, f64)>],
        min_effect: f64,
    ) -> Vec<Standout> {
        let mut best: Vec<Option<Standout>> = vec![None; ranks.len()];
        let mut consider = |i: usize, effect: f64, value: f64, what: Quantity| {
            if effect >= min_effect && best[i].is_none_or(|b| effect > b.effect) {
                best[i] = Some(Standout {
                    rank: ranks[i].rank,
                    effect,
                    value,
                    what,
                });
            }
        };
        let grad_norm = against_others(ranks, |r| r.grad_norm);
        for (column, what) in [(loss, Quantity::Loss), (&grad_norm, Quantity::GradNorm)] {
            for (i, &pair) in column.iter().enumerate() {
                if let Some((own, others)) = pair
                    && others > 0.0
                    && own > 0.0
                {
                    // Either way: a rank far above or far below its peers.
                    let ratio = own / others;
                    consider(i, ratio.max(1.0 / ratio) - 1.0, ratio, what);
                }
            }
        }
        for (i, pair) in against_others(ranks, |r| r.cos_to_mean)
            .into_iter()
            .enumerate()
        {
            if let Some((own, others)) = pair {
                consider(i, others - own, others - own, Quantity::Cosine);
            }
        }
        best.into_iter().flatten().collect()
    }

    fn identical(&mut self, ranks: &[RankValues], needed: u32) -> Option<Breach> {
        let mut keyed: Vec<((u64, u64), u32)> = Vec::with_capacity(ranks.len());
        keyed.extend(ranks.iter().filter_map(|r| {
            let loss = r.loss.filter(|v| v.is_finite())?;
            let grad = r.grad_norm.filter(|v| v.is_finite() && *v > 0.0)?;
            Some(((loss.to_bits(), grad.to_bits()), r.rank))
        }));
        // Sorted by values, then rank: each run of equal values is a group, in rank order.
        keyed.sort_unstable();
        // Healthy ranks never share a value: that step ends here, with nothing built.
        if !keyed.windows(2).any(|w| w[0].0 == w[1].0) {
            self.identical = None;
            return None;
        }
        let (mut groups, mut odd): (Vec<Vec<u32>>, Vec<u32>) = (vec![], vec![]);
        for run in keyed.chunk_by(|a, b| a.0 == b.0) {
            match run {
                [(_, alone)] => odd.push(*alone),
                many => groups.push(many.iter().map(|&(_, r)| r).collect()),
            }
        }
        groups.sort_unstable();
        odd.sort_unstable();
        let steps = match &self.identical {
            Some((previous, n)) if *previous == groups => n + 1,
            _ => 1,
        };
        self.identical = Some((groups.clone(), steps));
        if steps < needed {
            return None;
        }
        let who = match groups.as_slice() {
            [all] if odd.is_empty() => format!("all {} ranks", all.len()),
            [one] => format!("ranks {}", list(one)),
            many => format!(
                "{} groups of ranks ({})",
                many.len(),
                many.iter().map(|g| list(g)).collect::<Vec<_>>().join("; ")
            ),
        };
        let rest = match (groups.as_slice(), odd.as_slice()) {
            ([all], []) => format!(
                "; the run computes 1/{} of the gradients it pays for",
                all.len()
            ),
            (_, []) => String::new(),
            (_, [r]) => format!("; rank {r} alone differs"),
            (_, many) => format!("; ranks {} differ", list(many)),
        };
        Some(Breach {
            severity: Severity::Warning,
            value: f64::from(steps),
            threshold: f64::from(needed),
            explanation: format!(
                "{who} computed the same loss and gradient norm, to the bit, for {steps} steps: they are {SAME_BATCHES} (a data seed or sampler shared where it must differ){rest}"
            ),
            // The ranks that share batches: which of a group is the copy cannot be told, and
            // every one of them computes a gradient another rank also paid for.
            outlier_ranks: {
                let mut sharing = groups.concat();
                sharing.sort_unstable();
                sharing
            },
        })
    }
}
