//! Incidents: the alerts that share a cause, as one thing to look at.
//!
//! One fault raises many alerts: an activation blow-up is one `activation_outlier` per rank ×
//! site × layer, followed by a `loss_spike` and perhaps `nonfinite`. Listed one by one they
//! bury the cause under its symptoms. [`group`] folds a run's alerts into incidents:
//!
//! - **Same cause, same moment.** Alerts are taken in onset order (`first_step`); an alert
//!   joins the latest incident of its run when its onset is within `window_steps` of the
//!   latest onset already in it. A fault's symptoms follow it within a few dozen steps, so
//!   one window chains them; a long-firing alert does not swallow a new event hundreds of
//!   steps later, because only onsets count, not how long an alert lasts. The same (rule,
//!   layer, site) across ranks starts at the same step and therefore always lands together.
//! - **The first cause on top.** Inside an incident the alerts are ordered by onset, and at
//!   the same onset upstream rules first ([`upstream_order`]): a non-finite value or a
//!   silent rank explains a collapse or a spike, not the other way round. The first alert is
//!   the incident's cause; its id, prefixed, is the incident's id, so the id stays put when
//!   later symptoms join.
//! - **Outliers only when they stand out.** An incident says which ranks it touches; when a
//!   per-rank rule fired on every rank of the world it says "every rank", never calling one
//!   of them the outlier.
//!
//! Pending alerts that cleared without firing are noise a person never saw, and form no
//! incident. The grouping is a pure function of the alerts, recomputed on each request: it
//! survives restarts for free and cannot drift from the alerts it summarises.

use std::collections::BTreeSet;

pub use rankwatch_api::Incident;

use crate::alert::{Alert, AlertState, Rule};
use crate::validate::RunId;
use crate::vocab::Site;

/// Steps between onsets that still count as one event, by default.
pub const DEFAULT_WINDOW_STEPS: u64 = 100;

/// Where a rule sits in the chain of cause and symptom: smaller is further upstream.
/// A bad value or a silent or inconsistent rank feeds the averaged update; a collapsing
/// layer then shows in activations, and the loss is where everything ends up.
pub fn upstream_order(rule: Rule) -> u8 {
    match rule {
        // Replicas whose parameters differ (corrupted weights) explain everything after them.
        Rule::ReplicaDivergence => 0,
        Rule::Nonfinite => 1,
        Rule::StaleRank => 2,
        Rule::SilentInconsistency => 3,
        Rule::RankCollapse => 4,
        Rule::ActivationOutlier => 5,
        Rule::LossSpike => 6,
    }
}

/// Folds alerts (any runs, any order) into incidents, most urgent first: open before
/// resolved, then by severity, then by onset. `world_size` gives a run's world, when known.
/// What people did about them (`acknowledged`, `silenced_by`) is the caller's to fill in.
pub fn group(
    alerts: impl IntoIterator<Item = Alert>,
    world_size: impl Fn(&RunId) -> Option<u32>,
    window_steps: u64,
) -> Vec<Incident> {
    let mut alerts: Vec<Alert> = alerts
        .into_iter()
        .filter(|a| a.has_fired() || a.state == AlertState::Pending)
        .collect();
    alerts.sort_by(|a, b| {
        (&a.run, a.first_step, upstream_order(a.rule), &a.id).cmp(&(
            &b.run,
            b.first_step,
            upstream_order(b.rule),
            &b.id,
        ))
    });
    let mut groups: Vec<Vec<Alert>> = Vec::new();
    for alert in alerts {
        match groups.last_mut() {
            Some(open)
                if open[0].run == alert.run
                    && alert.first_step
                        <= open.last().map_or(0, |a| a.first_step) + window_steps =>
            {
                open.push(alert)
            }
            _ => groups.push(vec![alert]),
        }
    }
    let mut incidents: Vec<Incident> = groups
        .into_iter()
        .map(|alerts| {
            let world = world_size(&alerts[0].run);
            summarise(alerts, world)
        })
        .collect();
    incidents.sort_by(|a, b| {
        let open = |i: &Incident| i.state != AlertState::Resolved;
        (open(b), b.severity, a.first_step, &a.id).cmp(&(open(a), a.severity, b.first_step, &b.id))
    });
    incidents
}

fn summarise(alerts: Vec<Alert>, world: Option<u32>) -> Incident {
    let cause = &alerts[0];
    let mut rules: Vec<Rule> = Vec::new();
    for a in &alerts {
        if !rules.contains(&a.rule) {
            rules.push(a.rule);
        }
    }
    let ranks: BTreeSet<u32> = alerts
        .iter()
        .flat_map(|a| a.rank.into_iter().chain(a.outlier_ranks.iter().copied()))
        .collect();
    let layers: BTreeSet<u32> = alerts.iter().filter_map(|a| a.layer).collect();
    let sites: BTreeSet<Site> = alerts.iter().filter_map(|a| a.site).collect();
    let every_rank = world.is_some_and(|w| w > 1 && covers_every_rank(&alerts, w));
    let state = if alerts.iter().any(|a| a.state == AlertState::Firing) {
        AlertState::Firing
    } else if alerts.iter().any(|a| a.state == AlertState::Pending) {
        AlertState::Pending
    } else {
        AlertState::Resolved
    };
    let resolved_at_ms = (state == AlertState::Resolved)
        .then(|| alerts.iter().filter_map(|a| a.resolved_at_ms).max())
        .flatten();
    let ranks: Vec<u32> = ranks.into_iter().collect();
    let layers: Vec<u32> = layers.into_iter().collect();
    let summary = describe(&alerts, &rules, &ranks, every_rank, world, &layers);
    let mut incident = Incident {
        id: format!("incident:{}", cause.id),
        run: cause.run.to_string(),
        severity: alerts
            .iter()
            .map(|a| a.severity)
            .max()
            .unwrap_or(cause.severity),
        state,
        rules,
        ranks,
        every_rank,
        layers,
        sites: sites.into_iter().map(|s| s.as_str().to_owned()).collect(),
        first_step: cause.first_step,
        last_step: alerts
            .iter()
            .map(|a| a.last_step)
            .max()
            .unwrap_or(cause.last_step),
        started_at_ms: alerts.iter().map(|a| a.started_at_ms).min().unwrap_or(0),
        fired_at_ms: alerts.iter().filter_map(|a| a.fired_at_ms).min(),
        resolved_at_ms,
        summary,
        action: String::new(),
        acknowledged: None,
        silenced_by: Vec::new(),
        alerts: alerts.iter().map(Into::into).collect(),
    };
    incident.action = crate::advice::suggest(&incident, cause, world);
    incident
}

/// Whether some (rule, layer, site) was raised per rank on every rank of the world.
fn covers_every_rank(alerts: &[Alert], world: u32) -> bool {
    let mut by_kind: std::collections::BTreeMap<(Rule, Option<u32>, Option<Site>), BTreeSet<u32>> =
        Default::default();
    for a in alerts {
        if let Some(rank) = a.rank {
            by_kind
                .entry((a.rule, a.layer, a.site))
                .or_default()
                .insert(rank);
        }
    }
    by_kind
        .values()
        .any(|ranks| ranks.len() as u32 >= world && ranks.iter().all(|&r| r < world))
}

/// "activation_outlier on layers 1–3 (attn_out, mlp_out), every rank of 4; then loss_spike
/// (5 alerts): <the cause's explanation>".
fn describe(
    alerts: &[Alert],
    rules: &[Rule],
    ranks: &[u32],
    every_rank: bool,
    world: Option<u32>,
    layers: &[u32],
) -> String {
    let cause = &alerts[0];
    let mut text = cause.rule.as_str().to_owned();
    if !layers.is_empty() {
        text.push_str(&format!(" on {}", span("layer", layers)));
    }
    if every_rank {
        text.push_str(&format!(", every rank of {}", world.unwrap_or(0)));
    } else if !ranks.is_empty() {
        let of = world.map(|w| format!(" of {w}")).unwrap_or_default();
        text.push_str(&format!(", {}{of}", span("rank", ranks)));
    }
    if rules.len() > 1 {
        let rest: Vec<&str> = rules[1..].iter().map(|r| r.as_str()).collect();
        text.push_str(&format!("; then {}", rest.join(", ")));
    }
    if alerts.len() > 1 {
        text.push_str(&format!(" ({} alerts)", alerts.len()));
    }
    format!("{text}: {}", cause.explanation)
}

/// "layer 3", "layers 1–3", "ranks 0, 2, 5".
fn span(noun: &str, values: &[u32]) -> String {
    match values {
        [one] => format!("{noun} {one}"),
        _ => {
            let contiguous = values.windows(2).all(|w| w[1] == w[0] + 1);
            let list = if contiguous {
                format!("{}–{}", values[0], values[values.len() - 1])
            } else {
                values
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            format!("{noun}s {list}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::alert::Severity;

    fn alert(rule: Rule, first_step: u64, layer: Option<u32>, rank: Option<u32>) -> Alert {
        let run = RunId::new("r").unwrap();
        let key = crate::alert::AlertKey {
            run: run.clone(),
            rule,
            layer,
            site: layer.map(|_| Site::MlpOut),
            rank,
        };
        Alert {
            id: Alert::id_for(&key, first_step),
            run,
            rule,
            severity: Severity::Warning,
            state: AlertState::Firing,
            layer,
            site: key.site,
            rank,
            outlier_ranks: Vec::new(),
            value: 1.0,
            threshold: 1.0,
            first_step,
            last_step: first_step + 5,
            started_at_ms: first_step as i64,
            updated_at_ms: first_step as i64,
            fired_at_ms: Some(first_step as i64 + 1),
            resolved_at_ms: None,
            explanation: format!("{rule} at {first_step}"),
        }
    }

    #[test]
    fn spans_read_as_ranges_or_lists() {
        assert_eq!(span("layer", &[3]), "layer 3");
        assert_eq!(span("layer", &[1, 2, 3]), "layers 1–3");
        assert_eq!(span("rank", &[0, 2, 5]), "ranks 0, 2, 5");
    }

    #[test]
    fn onsets_chain_within_the_window_and_a_late_event_is_its_own() {
        let world = |_: &RunId| Some(2);
        let alerts = vec![
            alert(Rule::LossSpike, 130, None, None),
            alert(Rule::ActivationOutlier, 100, Some(1), Some(0)),
            alert(Rule::ActivationOutlier, 100, Some(1), Some(1)),
            // Chained: within 100 steps of the spike at 130, not of the first onset.
            alert(Rule::ActivationOutlier, 220, Some(2), Some(0)),
            alert(Rule::LossSpike, 900, None, None),
        ];
        let incidents = group(alerts, world, DEFAULT_WINDOW_STEPS);
        assert_eq!(incidents.len(), 2);
        let first = incidents.iter().find(|i| i.first_step == 100).unwrap();
        assert_eq!(first.alerts.len(), 4);
        assert_eq!(first.rules, vec![Rule::ActivationOutlier, Rule::LossSpike]);
        assert!(first.every_rank, "layer 1 fired on both ranks of 2");
        assert_eq!(first.layers, vec![1, 2]);
        assert!(
            first.summary.starts_with(
                "activation_outlier on layers 1–2, every rank of 2; then loss_spike (4 alerts)"
            ),
            "{}",
            first.summary
        );
    }

    #[test]
    fn the_upstream_rule_leads_at_the_same_onset() {
        let alerts = vec![
            alert(Rule::LossSpike, 50, None, None),
            alert(Rule::Nonfinite, 50, None, Some(3)),
        ];
        let incidents = group(alerts, |_: &RunId| Some(4), DEFAULT_WINDOW_STEPS);
        assert_eq!(incidents[0].alerts[0].rule, Rule::Nonfinite);
        assert_eq!(
            incidents[0].id,
            format!("incident:{}", incidents[0].alerts[0].id)
        );
        assert!(!incidents[0].every_rank);
        assert!(
            incidents[0].summary.contains("rank 3 of 4"),
            "{}",
            incidents[0].summary
        );
    }

    #[test]
    fn every_incident_suggests_an_action_for_where_its_cause_struck() {
        let one = group(
            vec![alert(Rule::Nonfinite, 40, None, Some(3))],
            |_: &RunId| Some(4),
            DEFAULT_WINDOW_STEPS,
        );
        assert!(
            one[0]
                .action
                .starts_with("Only rank 3 saw a non-finite value at step 40"),
            "{}",
            one[0].action
        );
        let all = group(
            (0..4).map(|r| alert(Rule::Nonfinite, 40, None, Some(r))),
            |_: &RunId| Some(4),
            DEFAULT_WINDOW_STEPS,
        );
        assert!(
            all[0].action.contains("every rank at step 40"),
            "{}",
            all[0].action
        );

        let mut corrupt = alert(Rule::ReplicaDivergence, 150, None, None);
        corrupt.outlier_ranks = vec![2];
        corrupt.explanation = "rank 2's parameters differ from ranks 0, 1, 3 at step 150".into();
        let mut pair = corrupt.clone();
        pair.outlier_ranks = vec![0, 1];
        pair.explanation =
            "the parameters of ranks 0, 1 differ at step 150; with two replicas, which one changed cannot be told".into();
        let majority = &group(vec![corrupt], |_: &RunId| Some(4), 100)[0].action;
        assert!(
            majority.contains("rank 2 no longer holds")
                && majority.contains("before step 150 without the node of rank 2"),
            "{majority}"
        );
        let untold = &group(vec![pair], |_: &RunId| Some(2), 100)[0].action;
        assert!(
            untold.contains("which ones changed cannot be told"),
            "{untold}"
        );

        for (named, says) in [
            (vec![2], "Rank 2 disagrees with its peers"),
            (vec![1, 2], "Ranks 1 and 2 disagree with their peers"),
        ] {
            let mut odd = alert(Rule::SilentInconsistency, 30, None, None);
            odd.outlier_ranks = named;
            let action = &group(vec![odd], |_: &RunId| Some(4), 100)[0].action;
            assert!(action.starts_with(says), "{action}");
        }
        // Ranks reading the same data, to the bit or nearly: what to check is the sampler,
        // whether the pair is all of a 2-rank run or two of four.
        for (text, world) in [
            (
                "ranks 0 and 1 agreed at 8 of the last 10 steps far more closely than ranks do (…): they are likely fed the same batches (…)",
                2,
            ),
            (
                "ranks 0, 1 computed the same loss and gradient norm, to the bit, for 10 steps: they are fed the same batches (…)",
                4,
            ),
        ] {
            let mut copied = alert(Rule::SilentInconsistency, 64, None, None);
            copied.outlier_ranks = vec![0, 1];
            copied.explanation = text.into();
            let action = &group(vec![copied], move |_: &RunId| Some(world), 100)[0].action;
            assert!(
                action.starts_with("Ranks 0 and 1 read the same batches by step 64")
                    && action.contains("DistributedSampler"),
                "{action}"
            );
        }

        let collapse = group(
            vec![
                alert(Rule::RankCollapse, 75, Some(1), None),
                alert(Rule::RankCollapse, 75, Some(2), None),
            ],
            |_: &RunId| Some(4),
            DEFAULT_WINDOW_STEPS,
        );
        assert!(
            collapse[0]
                .action
                .starts_with("Layers 1 and 2 are losing rank"),
            "{}",
            collapse[0].action
        );
    }

    #[test]
    fn open_and_severe_incidents_come_first_and_cleared_pending_alerts_are_dropped() {
        let mut resolved = alert(Rule::LossSpike, 10, None, None);
        resolved.state = AlertState::Resolved;
        resolved.resolved_at_ms = Some(99);
        let mut critical = alert(Rule::RankCollapse, 800, Some(0), None);
        critical.severity = Severity::Critical;
        let warning = alert(Rule::LossSpike, 400, None, None);
        let mut noise = alert(Rule::LossSpike, 600, None, None);
        noise.state = AlertState::Resolved;
        noise.fired_at_ms = None;
        let incidents = group(
            vec![resolved, warning, critical, noise],
            |_: &RunId| None,
            DEFAULT_WINDOW_STEPS,
        );
        let order: Vec<u64> = incidents.iter().map(|i| i.first_step).collect();
        assert_eq!(order, vec![800, 400, 10]);
        assert_eq!(incidents[2].state, AlertState::Resolved);
        assert_eq!(incidents[2].resolved_at_ms, Some(99));
    }
}
