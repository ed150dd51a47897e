//! What the other ranks of the same step say about one rank, with no baseline at all: the
//! part of `silent_inconsistency` that sees an inconsistency present from step 0.
//!
//! Healthy data-parallel workers are exchangeable: each draws its batch from the same
//! distribution, so which rank has the highest loss, the largest gradient norm or the lowest
//! cosine to the mean changes from step to step, each rank about 1/K of the time. Two things
//! break that, whatever the run's history:
//!
//! * **A rank that stands out step after step.** Each step, the rank furthest from the median of
//!   the *other* ranks (loss or gradient norm relative to theirs, cosine to the mean below
//!   theirs) is noted when that distance reaches `peer_min_effect`; a rank noted at
//!   `peer_share` of the last `peer_window` steps breaches. By chance, with K = 4, the same
//!   rank tops 40 of 50 steps with probability ~10⁻¹⁹. The effect floor is what keeps healthy
//!   differences out: ranks reading contiguous shards of a corpus have persistently different
//!   content (measured on the real-text harness: per-rank losses a few per cent apart, the same
//!   rank highest for hundreds of steps), and that is how many pipelines shard, not a fault.
//!   A rank whose data is corrupted or off-task, or whose gradient is scaled, is far past it.
//! * **Ranks fed identical data.** Ranks that compute the same loss and the same gradient norm,
//!   to the bit, for `identical_steps` steps are training on the same batches: a data seed or
//!   sampler shared where it must differ (the first setting of arXiv 2602.14462's seed
//!   experiment), which silently shrinks the effective batch. With different data the chance
//!   of two bit-identical float losses is nil; the gradient norm (measured by the agent, never
//!   rounded by the user) must match too.
//!
//! Both need no baseline, so they judge from step 0 and cannot latch; both need the per-rank
//! values of every rank at the step, and the stand-out test needs three ranks or more.

use std::collections::VecDeque;

use super::short;
use crate::math::dispersion::median;
use crate::math::step::RankValues;

/// One step's most distant rank.
#[derive(Debug, Clone, Copy)]
struct Standout {
    rank: u32,
    /// Loss or gradient norm relative to the others' median (e.g. 2.9 for 2.9×), or the
    /// cosine gap, as described by `what`.
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
pub(super) struct PeerFinding {
    pub(super) explanation: String,
    pub(super) ranks: Vec<u32>,
    /// The share of the window (stand-out) or the steps identical (identical data).
    pub(super) value: f64,
    pub(super) threshold: f64,
}

/// Thresholds, from `SilentInconsistencyConfig`.
#[derive(Debug, Clone, Copy)]
pub(super) struct PeerConfig {
    pub(super) window: usize,
    pub(super) share: f64,
    pub(super) min_effect: f64,
    pub(super) identical_steps: u32,
}

#[derive(Debug, Clone, Default)]
pub(super) struct Peers {
    recent: VecDeque<Option<Standout>>,
    /// The largest group of ranks with bit-identical values, and for how many steps in a row.
    identical: Option<(Vec<u32>, u32)>,
}

type Getter = fn(&RankValues) -> Option<f64>;

/// The others' median of `get`, and `rank`'s own value.
fn against_others(ranks: &[RankValues], i: usize, get: Getter) -> Option<(f64, f64)> {
    let own = get(&ranks[i]).filter(|v| v.is_finite())?;
    let mut others: Vec<f64> = ranks
        .iter()
        .enumerate()
        .filter(|&(j, _)| j != i)
        .filter_map(|(_, r)| get(r).filter(|v| v.is_finite()))
        .collect();
    if others.len() < 2 {
        return None;
    }
    Some((own, median(&mut others)))
}

impl Peers {
    /// Folds in one step; returns a finding when one of the two tests breaches.
    pub(super) fn observe(&mut self, ranks: &[RankValues], c: PeerConfig) -> Option<PeerFinding> {
        let identical = (c.identical_steps > 0)
            .then(|| self.identical(ranks, c.identical_steps))
            .flatten();
        let standout = (c.window > 0).then(|| self.standout(ranks, c)).flatten();
        match (identical, standout) {
            (Some(a), Some(b)) => Some(PeerFinding {
                explanation: format!("{}; {}", a.explanation, b.explanation),
                ranks: a.ranks.into_iter().chain(b.ranks).collect(),
                ..a
            }),
            (a, b) => a.or(b),
        }
    }

    fn standout(&mut self, ranks: &[RankValues], c: PeerConfig) -> Option<PeerFinding> {
        let top = (ranks.len() >= 3)
            .then(|| Self::most_distant(ranks, c.min_effect))
            .flatten();
        self.recent.push_back(top);
        while self.recent.len() > c.window {
            self.recent.pop_front();
        }
        if self.recent.len() < c.window {
            return None;
        }
        let last = top?;
        let noted: Vec<&Standout> = self
            .recent
            .iter()
            .flatten()
            .filter(|s| s.rank == last.rank)
            .collect();
        let share = noted.len() as f64 / c.window as f64;
        if share < c.share {
            return None;
        }
        let typical = {
            let mut values: Vec<f64> = noted
                .iter()
                .filter(|s| s.what == last.what)
                .map(|s| s.value)
                .collect();
            // Two decimals are enough to say how far ("1.4× theirs").
            (median(&mut values) * 100.0).round() / 100.0
        };
        let how = match last.what {
            Quantity::Loss => format!("loss {}× theirs", short(typical)),
            Quantity::GradNorm => format!("gradient norm {}× theirs", short(typical)),
            Quantity::Cosine => format!(
                "cosine to the mean gradient {} below theirs",
                short(typical)
            ),
        };
        Some(PeerFinding {
            explanation: format!(
                "rank {} stood out from the other {} ranks at {} of the last {} steps ({how})",
                last.rank,
                ranks.len() - 1,
                noted.len(),
                c.window
            ),
            ranks: vec![last.rank],
            value: share,
            threshold: c.share,
        })
    }

    /// The rank furthest from the others' median this step, if at least `min_effect` away.
    fn most_distant(ranks: &[RankValues], min_effect: f64) -> Option<Standout> {
        let mut best: Option<(f64, Standout)> = None;
        for (i, r) in ranks.iter().enumerate() {
            let mut consider = |effect: f64, value: f64, what: Quantity| {
                if effect >= min_effect && best.is_none_or(|(e, _)| effect > e) {
                    best = Some((
                        effect,
                        Standout {
                            rank: r.rank,
                            value,
                            what,
                        },
                    ));
                }
            };
            let sized: [(Getter, Quantity); 2] = [
                (|r| r.loss, Quantity::Loss),
                (|r| r.grad_norm, Quantity::GradNorm),
            ];
            for (get, what) in sized {
                if let Some((own, others)) = against_others(ranks, i, get)
                    && others > 0.0
                    && own > 0.0
                {
                    // Either way: a rank far above or far below its peers.
                    let ratio = own / others;
                    consider(ratio.max(1.0 / ratio) - 1.0, ratio, what);
                }
            }
            if let Some((own, others)) = against_others(ranks, i, |r| r.cos_to_mean) {
                consider(others - own, others - own, Quantity::Cosine);
            }
        }
        best.map(|(_, s)| s)
    }

    fn identical(&mut self, ranks: &[RankValues], needed: u32) -> Option<PeerFinding> {
        let mut keyed: Vec<((u64, u64), u32)> = ranks
            .iter()
            .filter_map(|r| {
                let loss = r.loss.filter(|v| v.is_finite())?;
                let grad = r.grad_norm.filter(|v| v.is_finite() && *v > 0.0)?;
                Some(((loss.to_bits(), grad.to_bits()), r.rank))
            })
            .collect();
        keyed.sort_unstable();
        let group: Vec<u32> = keyed
            .chunk_by(|a, b| a.0 == b.0)
            .max_by_key(|g| g.len())
            .filter(|g| g.len() >= 2)
            .map(|g| g.iter().map(|(_, r)| *r).collect())
            .unwrap_or_default();
        if group.is_empty() {
            self.identical = None;
            return None;
        }
        let steps = match &self.identical {
            Some((previous, n)) if *previous == group => n + 1,
            _ => 1,
        };
        self.identical = Some((group.clone(), steps));
        if steps < needed {
            return None;
        }
        let odd: Vec<u32> = ranks
            .iter()
            .map(|r| r.rank)
            .filter(|r| !group.contains(r))
            .collect();
        let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
        let who = if odd.is_empty() {
            format!("all {} ranks", group.len())
        } else {
            format!("ranks {}", list(&group))
        };
        let rest = match odd.as_slice() {
            [] => format!(
                "; the run computes 1/{} of the gradients it pays for",
                group.len()
            ),
            [r] => format!("; rank {r} alone differs"),
            many => format!("; ranks {} differ", list(many)),
        };
        Some(PeerFinding {
            explanation: format!(
                "{who} computed the same loss and gradient norm, to the bit, for {steps} steps: they are fed identical batches (a data seed or sampler shared where it must differ){rest}"
            ),
            // The odd ranks when there are some (the one configured differently), else none.
            ranks: odd,
            value: f64::from(steps),
            threshold: f64::from(needed),
        })
    }
}
