//! `replica_divergence`: data-parallel replicas whose parameters are no longer equal.
//!
//! DDP never re-broadcasts parameters after the first step: every replica applies the same
//! averaged gradient to the same weights, so the weights stay equal bit for bit — until one
//! replica's memory or arithmetic corrupts them (silent data corruption, a bit flip), it skips
//! or repeats an optimizer step, or it resumes from an older checkpoint. The averaged loss hides
//! all of these. Each rank sends, every fingerprint step, an exact digest of its parameters
//! (`param_fingerprint`) and one per block (`layer_fingerprint`); equal weights give equal
//! digests, and a single flipped bit always changes them (see the SDK's `fingerprint.py`). So
//! the rule needs no threshold and no baseline: it judges from the first fingerprinted step, and
//! any disagreement is critical.
//!
//! Ranks are compared within their replica set: all of them under DDP; under HSDP the ranks
//! holding the same shards (each rank sends its set, `replica_set`), since ranks holding other
//! shards hold other parameters by design. Who differs is decided by majority vote over the
//! whole-model digests of a set: the ranks outside a group holding more than half of them are
//! named. Without such a group (two replicas, or an even split) every rank outside the largest
//! group is named, and with two replicas both are, since which one changed cannot be told from
//! two. Where the ranks differ is read first off
//! each rank's locator (`param_locator`, see [`crate::math::locator`]): where a named rank
//! differs from the largest group in one tensor, that tensor is named, by the name the run's
//! `replica_fingerprint_tensors` tag gives it. Where it differs in several, the block digests
//! say where: the blocks whose digest is not the majority's for a named rank (the first few,
//! by index), or "outside the blocks" (embeddings, head, norms) when no block differs. Every
//! `fingerprint × 10` steps the ranks also send their optimizer state's digest
//! (`optim_fingerprint`: Adam's moments are replicated as the weights are), compared with the
//! parameters': a flip there is named before it reaches the weights. The alert resolves when
//! the digests agree again (the run restarted from a good checkpoint).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Detector;
use super::lifecycle::{Breach, LifecycleConfig, Signal, Trackers};
use crate::alert::{Alert, Rule, Severity};
use crate::error::Result;
use crate::math::locator::{digest_delta, locate};
use crate::validate::RunId;

/// Blocks named in an explanation before "and N more".
const NAMED_BLOCKS: usize = 3;

/// The run tag listing the fingerprinted tensors' names (a JSON list, in the digest's order).
pub const TENSORS_TAG: &str = "replica_fingerprint_tensors";

/// Positions of one parameter's state tensors in the optimizer state's digest: the k-th state
/// tensor of parameter i sits at `STATE_SLOTS`·i + k (the SDK's `fingerprint.py`).
const STATE_SLOTS: usize = 8;

/// Persistence of `replica_divergence`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicaDivergenceConfig {
    /// Default: fire at the first disagreement (equal weights never disagree), resolve at the
    /// first agreement.
    pub lifecycle: LifecycleConfig,
}

impl Default for ReplicaDivergenceConfig {
    fn default() -> Self {
        ReplicaDivergenceConfig {
            lifecycle: LifecycleConfig {
                pending_for: 1,
                resolve_after: 1,
            },
        }
    }
}

/// One rank's digests at one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankFingerprint {
    pub rank: u32,
    /// The digest of every replicated parameter.
    pub model: f64,
    /// Its locator (`param_locator`), where sent.
    #[serde(default)]
    pub locator: Option<f64>,
    /// (block index, digest of its parameters).
    pub layers: Vec<(u32, f64)>,
    /// The digest of its optimizer state, on the steps that carry one.
    #[serde(default)]
    pub optimizer: Option<f64>,
    /// The optimizer state's locator, with its digest.
    #[serde(default)]
    pub optimizer_locator: Option<f64>,
    /// The replica set the rank declared (HSDP: the index of the shards it holds); ranks are
    /// compared within their set. `None`: every rank holds the whole model.
    #[serde(default)]
    pub replica_set: Option<u32>,
}

/// The digests the ranks of one replica group sent for one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplicaObservation {
    pub step: u64,
    pub time_ms: i64,
    /// The replicas of the run: a step some of them sent no digest for is not judged (a step
    /// closed on its timeout without a slow rank would otherwise clear the alert about it, or
    /// call three replicas two).
    pub world_size: u32,
    pub ranks: Vec<RankFingerprint>,
    /// The fingerprinted tensors' names in the digest's order (the run's [`TENSORS_TAG`]);
    /// needed only when the ranks disagree, and may be empty (the tensor is then named by its
    /// position).
    #[serde(default)]
    pub tensors: Vec<String>,
}

impl ReplicaObservation {
    /// Whether any two ranks sent different digests (of the parameters or the optimizer state).
    pub fn disagree(&self) -> bool {
        let differs = |get: fn(&RankFingerprint) -> Option<f64>| {
            let mut values = self.ranks.iter().filter_map(get).map(f64::to_bits);
            values
                .next()
                .is_some_and(|first| values.any(|v| v != first))
        };
        differs(|r| Some(r.model)) || differs(|r| r.optimizer)
    }
}

/// The `replica_divergence` detector for one run.
#[derive(Debug, Clone)]
pub struct ReplicaDivergence {
    config: ReplicaDivergenceConfig,
    trackers: Trackers<()>,
    /// The last breach was the optimizer state's alone: a later step without optimizer digests
    /// (they come at a tenth of the cadence) cannot clear it.
    optimizer_only: bool,
}

impl ReplicaDivergence {
    /// A detector for `run`.
    pub fn new(run: RunId, config: ReplicaDivergenceConfig) -> Result<Self> {
        config.lifecycle.validate("replica_divergence")?;
        Ok(ReplicaDivergence {
            config,
            trackers: Trackers::new(run, Rule::ReplicaDivergence, |_| (None, None, None)),
            optimizer_only: false,
        })
    }
}

/// The ranks grouped by equal value, largest group first (ties: the group of the lowest rank).
fn groups<V: Ord>(values: impl Iterator<Item = (u32, V)>) -> Vec<Vec<u32>> {
    let mut by_value: BTreeMap<V, Vec<u32>> = BTreeMap::new();
    for (rank, value) in values {
        by_value.entry(value).or_default().push(rank);
    }
    let mut groups: Vec<Vec<u32>> = by_value.into_values().collect();
    for g in &mut groups {
        g.sort_unstable();
    }
    groups.sort_by(|a, b| b.len().cmp(&a.len()).then(a[0].cmp(&b[0])));
    groups
}

fn list(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn ranks_word(ranks: &[u32]) -> String {
    match ranks {
        [one] => format!("rank {one}"),
        _ => format!("ranks {}", list(ranks)),
    }
}

/// The tensor(s) in which `named` differ from `reference` (a rank of the largest group), when
/// each differs in one tensor its locator can name; `None` when any cannot be located.
fn located(
    obs: &ReplicaObservation,
    named: &[u32],
    reference: u32,
    params_agree: bool,
) -> Option<String> {
    let of = |rank: u32| obs.ranks.iter().find(|r| r.rank == rank);
    let base = of(reference)?;
    let pick = |r: &RankFingerprint| {
        if params_agree {
            r.optimizer.zip(r.optimizer_locator)
        } else {
            r.locator.map(|l| (r.model, l))
        }
    };
    let (base_digest, base_locator) = pick(base)?;
    // Positions run over the parameters, or over their state tensors' slots; without the
    // names they are unbounded: any below 2^20 is accepted.
    let per_tensor = if params_agree { STATE_SLOTS } else { 1 };
    let positions = if obs.tensors.is_empty() {
        1 << 20
    } else {
        obs.tensors.len() * per_tensor
    };
    let mut found: Vec<usize> = Vec::new();
    for &rank in named.iter().filter(|&&r| r != reference) {
        let (digest, locator) = pick(of(rank)?)?;
        let delta = digest_delta(digest, base_digest);
        if delta == 0 {
            continue; // in the reference's own group (a tie names every rank)
        }
        let at = locate(delta, digest_delta(locator, base_locator), positions)? / per_tensor;
        if !found.contains(&at) {
            found.push(at);
        }
    }
    if found.is_empty() {
        return None;
    }
    let names: Vec<String> = found
        .iter()
        .map(|&i| {
            obs.tensors
                .get(i)
                .cloned()
                .unwrap_or_else(|| format!("#{i} (the run sent no tensor names)"))
        })
        .collect();
    let noun = if names.len() == 1 {
        "tensor"
    } else {
        "tensors"
    };
    let state = if params_agree {
        "the optimizer state of "
    } else {
        ""
    };
    Some(format!("in {state}{noun} {}", names.join(", ")))
}

/// Where `named` differ from the rest: the tensor, where one locates it (see [`located`]);
/// else the blocks whose digest is not the majority's for one of them (first few by index), or
/// outside the blocks.
fn where_they_differ(
    obs: &ReplicaObservation,
    named: &[u32],
    reference: u32,
    params_agree: bool,
) -> String {
    if let Some(place) = located(obs, named, reference, params_agree) {
        return place;
    }
    let mut per_layer: BTreeMap<u32, Vec<(u32, f64)>> = BTreeMap::new();
    for r in &obs.ranks {
        for &(layer, value) in &r.layers {
            per_layer.entry(layer).or_default().push((r.rank, value));
        }
    }
    let differing: Vec<u32> = per_layer
        .into_iter()
        .filter(|(_, values)| {
            let g = groups(values.iter().map(|&(rank, v)| (rank, v.to_bits())));
            g.len() > 1
                && named
                    .iter()
                    .any(|r| !g[0].contains(r) || g[0].len() * 2 <= values.len())
        })
        .map(|(layer, _)| layer)
        .collect();
    if differing.is_empty() {
        if params_agree {
            return "(the parameters still agree; the next optimizer step will part them)"
                .to_owned();
        }
        let blocks_known = obs.ranks.iter().any(|r| !r.layers.is_empty());
        return if blocks_known {
            "outside the blocks (embeddings, head or norms)".to_owned()
        } else {
            "(no block map: which parameters cannot be told)".to_owned()
        };
    }
    let shown: Vec<String> = differing
        .iter()
        .take(NAMED_BLOCKS)
        .map(u32::to_string)
        .collect();
    let more = differing.len().saturating_sub(NAMED_BLOCKS);
    let noun = if differing.len() == 1 {
        "block"
    } else {
        "blocks"
    };
    if more > 0 {
        format!("in {noun} {} and {more} more", shown.join(", "))
    } else {
        format!("in {noun} {}", shown.join(", "))
    }
}

/// What one replica set's digests say: who differs, where, and whether only the optimizer
/// state does.
struct Verdict {
    named: Vec<u32>,
    /// "rank 2's parameters differ from ranks 0, 1, 3 at step 20 in tensor …".
    finding: String,
    params_agree: bool,
}

/// The verdict on `obs`'s ranks, all of one replica set; `None` when they all agree.
fn judge_set(obs: &ReplicaObservation, with_optimizer: bool) -> Option<Verdict> {
    // Digests are integers below 2^52, exact in an f64: compared by their bits. The optimizer
    // state's takes part where every rank sent one.
    let g = groups(obs.ranks.iter().map(|r| {
        let optimizer = r.optimizer.filter(|_| with_optimizer).map(f64::to_bits);
        (r.rank, (r.model.to_bits(), optimizer))
    }));
    if g.len() < 2 {
        return None;
    }
    let total = obs.ranks.len();
    let majority = g[0].len() * 2 > total;
    // Without a majority, the largest group is told apart only when it is the one largest
    // (and there are more than two replicas): a tie names everyone.
    let tied = g[0].len() == g[1].len();
    let mut named: Vec<u32> = if majority || (total > 2 && !tied) {
        g[1..].iter().flatten().copied().collect()
    } else {
        g.iter().flatten().copied().collect()
    };
    named.sort_unstable();
    let params_agree = groups(obs.ranks.iter().map(|r| (r.rank, r.model.to_bits()))).len() == 1;
    let place = where_they_differ(obs, &named, g[0][0], params_agree);
    let (what, differ) = if params_agree {
        ("optimizer state", "differs")
    } else {
        ("parameters", "differ")
    };
    let finding = if majority {
        format!(
            "{}'s {what} {differ} from {} at step {} {place}",
            ranks_word(&named),
            ranks_word(&g[0]),
            obs.step,
        )
    } else if total == 2 {
        format!(
            "the {what} of ranks {} {differ} at step {} {place}; with two replicas, which one \
             changed cannot be told",
            list(&named),
            obs.step,
        )
    } else {
        format!(
            "the replicas disagree with no majority at step {} {place} ({})",
            obs.step,
            g.iter()
                .map(|group| format!("[{}]", list(group)))
                .collect::<Vec<_>>()
                .join(" vs "),
        )
    };
    Some(Verdict {
        named,
        finding,
        params_agree,
    })
}

/// The breach for an observation whose ranks disagree within a replica set, and whether only
/// the optimizer state differs; `None` when every set agrees. Ranks are compared within the
/// set they declared (`replica_set`: HSDP's ranks holding the same shards); without one, all
/// ranks are one set.
fn judge(obs: &ReplicaObservation, with_optimizer: bool) -> Option<(Breach, bool)> {
    // One set (DDP: every rank holds the whole model) is judged as it came; only declared sets
    // are split into observations of their own.
    let one_set = obs
        .ranks
        .windows(2)
        .all(|w| w[0].replica_set == w[1].replica_set);
    let mut sets: BTreeMap<Option<u32>, ReplicaObservation> = BTreeMap::new();
    if !one_set {
        for r in &obs.ranks {
            sets.entry(r.replica_set)
                .or_insert_with(|| ReplicaObservation {
                    ranks: Vec::new(),
                    tensors: obs.tensors.clone(),
                    ..*obs
                })
                .ranks
                .push(r.clone());
        }
    }
    let observations: Vec<(Option<u32>, &ReplicaObservation)> = if one_set {
        vec![(obs.ranks.first().and_then(|r| r.replica_set), obs)]
    } else {
        sets.iter().map(|(set, o)| (*set, o)).collect()
    };
    let mut named = Vec::new();
    let mut findings = Vec::new();
    let mut params_agree = true;
    for (set, one) in observations {
        let Some(verdict) = judge_set(one, with_optimizer) else {
            continue;
        };
        named.extend(verdict.named);
        params_agree &= verdict.params_agree;
        findings.push(match set {
            Some(set) => format!("in replica set {set}, {}", verdict.finding),
            None => verdict.finding,
        });
    }
    if findings.is_empty() {
        return None;
    }
    named.sort_unstable();
    // The likely causes; what to do is the incident's suggested action (`advice.rs`).
    let action = "likely silent data corruption (a bit flip in its memory or arithmetic), a skipped or \
                  repeated optimizer step, or a resume from another checkpoint";
    let breach = Breach {
        severity: Severity::Critical,
        value: named.len() as f64,
        threshold: 0.0,
        explanation: format!("{}: {action}", findings.join("; ")),
        outlier_ranks: named,
    };
    Some((breach, params_agree))
}

impl Detector for ReplicaDivergence {
    type Observation = ReplicaObservation;

    fn observe(&mut self, obs: &ReplicaObservation) -> Vec<Alert> {
        if obs.ranks.len() < 2 || obs.ranks.len() < obs.world_size as usize {
            return Vec::new(); // nothing to compare, or not every replica: hold
        }
        let with_optimizer = obs.ranks.iter().all(|r| r.optimizer.is_some());
        let signal = match judge(obs, with_optimizer) {
            Some((breach, optimizer_only)) => {
                self.optimizer_only = optimizer_only;
                Signal::Breach(breach)
            }
            // The parameters agree, but the optimizer state that differed was not sent.
            None if self.optimizer_only && !with_optimizer => Signal::Hold,
            None => {
                self.optimizer_only = false;
                Signal::Clear
            }
        };
        self.trackers
            .observe(&(), obs.step, obs.time_ms, signal, &self.config.lifecycle)
    }

    fn open_alerts(&self) -> Vec<Alert> {
        self.trackers.open()
    }
}
