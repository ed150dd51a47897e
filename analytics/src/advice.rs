//! What to do about an incident: the suggested action every incident carries to the Alerts
//! page, the API and the receivers (webhooks, Slack, Alertmanager).
//!
//! The action follows from the incident's *cause* (its first alert; the rules after it are
//! symptoms) and from where it struck: one rank points at that worker (its data, its device),
//! every rank points at the model or its numerics. Each text names the ranks, layers and step,
//! says where to look first, and what usually fixes it — the README's "when this fires" table,
//! per incident instead of per rule.

use crate::alert::{Alert, Rule};
use crate::detect::SAME_BATCHES;
use rankwatch_api::Incident;

/// The suggested action for `incident`, whose cause is `cause`, in a run of `world` ranks
/// (when known).
pub fn suggest(incident: &Incident, cause: &Alert, world: Option<u32>) -> String {
    let step = incident.first_step;
    let one_rank = !incident.every_rank && !incident.ranks.is_empty();
    let ranks = ranks_phrase(&incident.ranks);
    let layers = layers_phrase(&incident.layers);
    match cause.rule {
        Rule::ReplicaDivergence => {
            let named = ranks_phrase(&cause.outlier_ranks);
            // Every replica named (two replicas, or a tie): which changed cannot be told.
            let untold = world.is_some_and(|w| cause.outlier_ranks.len() >= w as usize);
            if untold {
                format!(
                    "Stop the run: its replicas no longer hold the same parameters, and which \
                     ones changed cannot be told. Restart from the last checkpoint saved before \
                     step {step} and run every named node's GPU diagnostics (e.g. `dcgmi diag -r 3`) \
                     before they rejoin."
                )
            } else {
                let hold = if cause.outlier_ranks.len() == 1 {
                    "holds"
                } else {
                    "hold"
                };
                format!(
                    "Stop the run: {named} no longer {hold} the parameters the other replicas hold, \
                     and every step from here averages diverged copies. Restart from the last \
                     checkpoint saved before step {step} without the node of {named}, and run its \
                     GPU diagnostics (e.g. `dcgmi diag -r 3`) before it rejoins; if {named} \
                     resumed or skipped a step, check it restored the same checkpoint as the rest."
                )
            }
        }
        Rule::Nonfinite if one_rank => format!(
            "Only {ranks} saw a non-finite value at step {step}: look at the batch it read then \
             and at its device (ECC errors, XID events in the kernel log); if it happens again on \
             the same rank, take that node out."
        ),
        Rule::Nonfinite => format!(
            "A NaN or infinity on every rank at step {step} is the model's numerics, not one \
             worker: lower the learning rate or clip gradients, check the loss scaler's skipped \
             steps, and resume from a checkpoint before step {step} if the loss does not recover."
        ),
        Rule::StaleRank => format!(
            "{} stopped reporting after step {step}: check that its process is alive and where it \
             waits (`py-spy dump --pid <pid>` on its host); a hung rank stalls every collective, \
             so restart it, or the job from its last checkpoint.",
            capitalise(&ranks)
        ),
        Rule::SilentInconsistency if cause.explanation.contains(SAME_BATCHES) => format!(
            "{} read the same batches by step {step}: the run pays for gradients it computes \
             twice and learns from fewer examples than it was set to. Check the sampler (a \
             `DistributedSampler` needs the data-parallel group's rank and size, and `set_epoch` \
             every epoch), each rank's data-loading seed and shard list; once fixed, resume from \
             the latest checkpoint (the steps so far saw less data, not wrong data).",
            capitalise(&ranks_phrase(&cause.outlier_ranks))
        ),
        Rule::SilentInconsistency if one_rank => {
            let (verb, its, device) = if incident.ranks.len() == 1 {
                ("disagrees", "its", "its device's")
            } else {
                ("disagree", "their", "their devices'")
            };
            format!(
                "{} {verb} with {its} peers while the averaged loss looks normal: compare {its} \
                 data shard and sampler seed with the others' (a duplicated or corrupt shard, \
                 another augmentation), {its} code and config, and {device} health; the \
                 Workers page shows {its} lines and cosine rows at step {step}.",
                capitalise(&ranks)
            )
        }
        Rule::SilentInconsistency => format!(
            "The workers disagree more than independent shards explain since step {step}: check \
             that every rank reads its own shard with the same code and config, and read the \
             Workers page's consistency figures for this run."
        ),
        Rule::RankCollapse => format!(
            "{} {} losing rank (the weights' spectrum folding onto one direction, an early sign of \
             divergence): lower the peak learning rate or lengthen the warm-up, check the \
             normalisation there (e.g. QK-norm), and keep the checkpoint before step {step} — \
             roll back to it if the token cosine keeps rising.",
            capitalise(&layers),
            if incident.layers.len() == 1 {
                "is"
            } else {
                "are"
            },
        ),
        Rule::ActivationOutlier => format!(
            "Activations in {layers} grew far beyond their own history at step {step}; in bf16 or \
             fp16 they overflow next: check that layer's normalisation and the learning rate, and \
             the batches around step {step} for outlier tokens."
        ),
        Rule::LossSpike => format!(
            "The loss jumped at step {step}: if it is back within a few dozen steps, note it and \
             go on; if not, roll back to a checkpoint before step {step}, skip the batches read \
             there, or lower the learning rate."
        ),
    }
}

fn ranks_phrase(ranks: &[u32]) -> String {
    list_phrase("rank", ranks)
}

fn layers_phrase(layers: &[u32]) -> String {
    if layers.is_empty() {
        "the model".to_owned()
    } else {
        list_phrase("layer", layers)
    }
}

/// "rank 2", "ranks 1 and 3", "ranks 0, 2 and 5"; "the named ranks" when none is known.
fn list_phrase(noun: &str, values: &[u32]) -> String {
    match values {
        [] => format!("the named {noun}s"),
        [one] => format!("{noun} {one}"),
        [rest @ .., last] => {
            let rest: Vec<String> = rest.iter().map(u32::to_string).collect();
            format!("{noun}s {} and {last}", rest.join(", "))
        }
    }
}

fn capitalise(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_read_as_english() {
        assert_eq!(list_phrase("rank", &[2]), "rank 2");
        assert_eq!(list_phrase("rank", &[1, 3]), "ranks 1 and 3");
        assert_eq!(list_phrase("layer", &[0, 2, 5]), "layers 0, 2 and 5");
        assert_eq!(capitalise("ranks 1 and 3"), "Ranks 1 and 3");
    }
}
