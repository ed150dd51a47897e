//! What a webhook or Slack receiver was told of a run's incidents, and what it must hear next.
//!
//! Receivers hear incidents, not alerts: one fault that raises 19 alerts (one per rank and
//! site) is one message when it opens. [`messages`] compares a run's incidents now
//! ([`RunIncidents`]) with the receiver's record ([`Told`]) and says what to send:
//!
//! - **opened** — a firing incident the receiver has not heard of;
//! - **updated** — one it heard of that got worse: a higher severity, a rule it did not name
//!   (a new kind of symptom), or incidents it heard of separately that are now one. A merge is
//!   told under the surviving id with the ids it absorbed (`merged`); so is an incident whose
//!   id moved because an alert with an earlier onset became its cause. More ranks or layers of
//!   a rule it already named are not news: the record takes them in silently;
//! - **resolved** — one it heard of firing whose alerts have all resolved, or that no longer
//!   exists (its run was deleted).
//!
//! A silenced incident (every open alert of it muted) is not announced and its changes are held
//! back; its resolution still goes out to a receiver that heard it fire. Pending incidents stay
//! inside the collector. The record is kept on disk by the sink (`DIR/alert-delivery/`), so a
//! restart neither repeats an announcement nor loses a resolution.

use std::collections::{BTreeMap, BTreeSet};

use rankwatch_analytics::{AlertState, Rule, Severity};
use rankwatch_api::Incident;
use serde::{Deserialize, Serialize};

use crate::alerting::incidents::RunIncidents;

/// An incident as a receiver is told of it (the webhook's `incident` object): where, how bad,
/// the evidence and what to do, with its alerts' ids. Holds no float, so it round-trips
/// through JSON (an alert's value may be NaN).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncidentNote {
    pub id: String,
    pub run: String,
    pub severity: Severity,
    pub state: AlertState,
    /// The rules involved, the cause's first.
    pub rules: Vec<Rule>,
    pub ranks: Vec<u32>,
    pub every_rank: bool,
    pub layers: Vec<u32>,
    pub sites: Vec<String>,
    pub first_step: u64,
    pub last_step: u64,
    pub fired_at_ms: Option<i64>,
    pub resolved_at_ms: Option<i64>,
    /// One line: the cause, where, and what followed.
    pub summary: String,
    /// The cause's own explanation: the figures that made it fire.
    pub evidence: String,
    /// What to do about it.
    pub action: String,
    /// Its alerts' ids, the cause first.
    pub alerts: Vec<String>,
}

impl From<&Incident> for IncidentNote {
    fn from(i: &Incident) -> IncidentNote {
        IncidentNote {
            id: i.id.clone(),
            run: i.run.clone(),
            severity: i.severity,
            state: i.state,
            rules: i.rules.clone(),
            ranks: i.ranks.clone(),
            every_rank: i.every_rank,
            layers: i.layers.clone(),
            sites: i.sites.clone(),
            first_step: i.first_step,
            last_step: i.last_step,
            fired_at_ms: i.fired_at_ms,
            resolved_at_ms: i.resolved_at_ms,
            summary: i.summary.clone(),
            evidence: i
                .alerts
                .first()
                .map(|a| a.explanation.clone())
                .unwrap_or_default(),
            action: i.action.clone(),
            alerts: i.alerts.iter().map(|a| a.id.clone()).collect(),
        }
    }
}

/// What a receiver was last told, per incident id (only incidents it heard firing).
pub type Told = BTreeMap<String, IncidentNote>;

/// What changed for the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    Opened,
    Updated,
    Resolved,
}

impl Event {
    pub fn as_str(self) -> &'static str {
        match self {
            Event::Opened => "opened",
            Event::Updated => "updated",
            Event::Resolved => "resolved",
        }
    }
}

/// One message for a receiver, or a silent change to its record (`event` `None`).
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub event: Option<Event>,
    pub note: IncidentNote,
    /// Ids the receiver heard of that are now part of this incident.
    pub merged: Vec<String>,
    /// Why it was sent, in words ("a new rule: loss_spike", "severity rose to critical").
    pub why: String,
}

impl Message {
    /// The receiver's record once it accepted this message.
    pub fn apply(&self, told: &mut Told) {
        for id in &self.merged {
            told.remove(id);
        }
        if self.note.state == AlertState::Resolved {
            told.remove(&self.note.id);
        } else {
            told.insert(self.note.id.clone(), self.note.clone());
        }
    }
}

/// What a receiver with record `told` must hear about `now` (one run), in onset order.
/// `now_ms` stamps the end of incidents that no longer exist.
pub fn messages(told: &Told, now: &RunIncidents, now_ms: i64) -> Vec<Message> {
    let run = now.run.as_str();
    let mut out = Vec::new();
    // Told incidents of this run that a current incident accounts for.
    let mut accounted: BTreeSet<String> = BTreeSet::new();
    for incident in &now.incidents {
        let note = IncidentNote::from(incident);
        let members: BTreeSet<&str> = note.alerts.iter().map(String::as_str).collect();
        let merged: Vec<String> = told
            .values()
            .filter(|t| t.run == run && t.id != note.id)
            .filter(|t| t.alerts.iter().any(|a| members.contains(a.as_str())))
            .map(|t| t.id.clone())
            .collect();
        let prior = told.get(&note.id);
        let heard = prior.is_some() || !merged.is_empty();
        if heard {
            accounted.insert(note.id.clone());
            accounted.extend(merged.iter().cloned());
        }
        match note.state {
            AlertState::Pending => {}
            AlertState::Resolved if heard => out.push(Message {
                event: Some(Event::Resolved),
                why: "every alert of it resolved".into(),
                note,
                merged,
            }),
            AlertState::Resolved => {}
            AlertState::Firing if now.muted.contains(&note.id) => {}
            AlertState::Firing => {
                let earlier: Vec<&IncidentNote> = prior
                    .into_iter()
                    .chain(merged.iter().filter_map(|id| told.get(id)))
                    .collect();
                let why = if earlier.is_empty() {
                    Some("opened".to_owned())
                } else {
                    news(&note, &earlier, &merged)
                };
                let event = match (&why, earlier.is_empty()) {
                    (_, true) => Some(Event::Opened),
                    (Some(_), false) => Some(Event::Updated),
                    (None, false) => None,
                };
                // Nothing new: the record still takes in the new members (silently), so a
                // later merge through one of them is recognised.
                if event.is_some() || prior != Some(&note) {
                    out.push(Message {
                        event,
                        note,
                        merged,
                        why: why.unwrap_or_default(),
                    });
                }
            }
        }
    }
    // What the receiver heard of that no incident accounts for any more: its run was deleted.
    for t in told.values().filter(|t| t.run == run) {
        if accounted.contains(&t.id) {
            continue;
        }
        let mut note = t.clone();
        note.state = AlertState::Resolved;
        note.resolved_at_ms = Some(now_ms);
        out.push(Message {
            event: Some(Event::Resolved),
            note,
            merged: Vec::new(),
            why: "its alerts no longer exist (the run was deleted)".into(),
        });
    }
    out
}

/// Why `note` is news to a receiver that heard `earlier` of it; `None` when it is not.
fn news(note: &IncidentNote, earlier: &[&IncidentNote], merged: &[String]) -> Option<String> {
    let mut why = Vec::new();
    if !merged.is_empty() {
        why.push(format!("merged with {}", merged.join(", ")));
    }
    if earlier.iter().all(|e| e.severity < note.severity) {
        why.push(format!("severity rose to {}", note.severity.as_str()));
    }
    let named: BTreeSet<Rule> = earlier
        .iter()
        .flat_map(|e| e.rules.iter().copied())
        .collect();
    let fresh: Vec<&str> = note
        .rules
        .iter()
        .filter(|r| !named.contains(r))
        .map(|r| r.as_str())
        .collect();
    if !fresh.is_empty() {
        let noun = if fresh.len() == 1 { "rule" } else { "rules" };
        why.push(format!("new {noun}: {}", fresh.join(", ")));
    }
    (!why.is_empty()).then(|| why.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::alert_log::test_alert;
    use rankwatch_analytics::incident::group;
    use rankwatch_analytics::{Alert, RunId};

    fn alert(id: &str, rule: Rule, step: u64, rank: u32, state: AlertState) -> Alert {
        let mut a = test_alert(id, "r", state, step as i64);
        a.rule = rule;
        a.rank = Some(rank);
        a.first_step = step;
        a
    }

    fn snapshot(alerts: &[Alert], muted: &[&str]) -> RunIncidents {
        let mut incidents = group(alerts.to_vec(), |_: &RunId| Some(4), 100);
        incidents.sort_by_key(|i| i.first_step);
        RunIncidents {
            run: RunId::new("r").unwrap(),
            muted: incidents
                .iter()
                .filter(|i| i.alerts.iter().any(|a| muted.contains(&a.id.as_str())))
                .map(|i| i.id.clone())
                .collect(),
            incidents,
        }
    }

    /// Delivers every message (the receiver accepts all); returns the events told.
    fn tell(told: &mut Told, now: &RunIncidents) -> Vec<(Event, String, Vec<String>)> {
        let mut heard = Vec::new();
        for m in messages(told, now, 99) {
            m.apply(told);
            if let Some(e) = m.event {
                heard.push((e, m.note.id.clone(), m.merged.clone()));
            }
        }
        heard
    }

    const F: AlertState = AlertState::Firing;

    #[test]
    fn one_fault_on_many_ranks_is_one_message_and_more_ranks_of_it_are_not_news() {
        let mut told = Told::new();
        let first = [alert("a0", Rule::ActivationOutlier, 240, 0, F)];
        assert_eq!(
            tell(&mut told, &snapshot(&first, &[])),
            [(Event::Opened, "incident:a0".to_owned(), vec![])]
        );
        // 14 more ranks and sites of the same rule: silent, but the record knows them.
        let mut more: Vec<Alert> = first.to_vec();
        more.extend(
            (1..15).map(|i| alert(&format!("a{i}"), Rule::ActivationOutlier, 240, i % 4, F)),
        );
        assert_eq!(tell(&mut told, &snapshot(&more, &[])), []);
        assert_eq!(told["incident:a0"].alerts.len(), 15);
        // A new kind of symptom is news.
        more.push(alert("spike", Rule::LossSpike, 250, 0, F));
        let heard = tell(&mut told, &snapshot(&more, &[]));
        assert_eq!(heard, [(Event::Updated, "incident:a0".to_owned(), vec![])]);
        // All resolved: one resolution.
        for a in &mut more {
            a.state = AlertState::Resolved;
        }
        assert_eq!(
            tell(&mut told, &snapshot(&more, &[])),
            [(Event::Resolved, "incident:a0".to_owned(), vec![])]
        );
        assert!(told.is_empty());
    }

    #[test]
    fn two_incidents_that_become_one_are_told_under_the_surviving_id() {
        let mut told = Told::new();
        let mut alerts = vec![
            alert("early", Rule::SilentInconsistency, 100, 1, F),
            alert("late", Rule::LossSpike, 250, 0, F),
        ];
        let heard = tell(&mut told, &snapshot(&alerts, &[]));
        assert_eq!(heard.len(), 2, "{heard:?}");
        // An alert whose onset bridges them: one incident, the earlier cause's id survives.
        alerts.push(alert("bridge", Rule::RankCollapse, 180, 2, F));
        let heard = tell(&mut told, &snapshot(&alerts, &[]));
        assert_eq!(
            heard,
            [(
                Event::Updated,
                "incident:early".to_owned(),
                vec!["incident:late".to_owned()]
            )]
        );
        assert_eq!(told.keys().collect::<Vec<_>>(), ["incident:early"]);
    }

    #[test]
    fn a_cause_found_later_moves_the_id_and_says_so() {
        let mut told = Told::new();
        let mut alerts = vec![alert("spike", Rule::LossSpike, 50, 0, F)];
        tell(&mut told, &snapshot(&alerts, &[]));
        // A NaN at the same onset is further upstream: it becomes the cause.
        alerts.push(alert("nan", Rule::Nonfinite, 50, 3, F));
        let messages = messages(&told, &snapshot(&alerts, &[]), 99);
        assert_eq!(messages.len(), 1, "{messages:#?}");
        assert_eq!(messages[0].event, Some(Event::Updated));
        assert_eq!(messages[0].note.id, "incident:nan");
        assert_eq!(messages[0].merged, ["incident:spike"]);
    }

    #[test]
    fn a_silenced_incident_is_not_announced_but_its_end_reaches_who_heard_it() {
        let mut told = Told::new();
        let mut alerts = vec![alert("x", Rule::Nonfinite, 10, 1, F)];
        assert_eq!(tell(&mut told, &snapshot(&alerts, &["x"])), []);
        // Told once the silence ends.
        assert_eq!(tell(&mut told, &snapshot(&alerts, &[])).len(), 1);
        // Silenced again while firing: a new rule is held back, the end is told.
        alerts.push(alert("y", Rule::LossSpike, 12, 0, F));
        assert_eq!(tell(&mut told, &snapshot(&alerts, &["x", "y"])), []);
        for a in &mut alerts {
            a.state = AlertState::Resolved;
        }
        assert_eq!(
            tell(&mut told, &snapshot(&alerts, &["x", "y"])),
            [(Event::Resolved, "incident:x".to_owned(), vec![])]
        );
    }

    #[test]
    fn a_deleted_run_ends_what_was_told_and_pending_incidents_stay_inside() {
        let mut told = Told::new();
        let alerts = vec![
            alert("fired", Rule::Nonfinite, 10, 1, F),
            alert("waiting", Rule::LossSpike, 500, 0, AlertState::Pending),
        ];
        assert_eq!(tell(&mut told, &snapshot(&alerts, &[])).len(), 1);
        let gone = messages(&told, &RunIncidents::none(RunId::new("r").unwrap()), 1234);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].event, Some(Event::Resolved));
        assert_eq!(gone[0].note.resolved_at_ms, Some(1234));
        assert!(gone[0].why.contains("deleted"), "{}", gone[0].why);
        // A receiver that heard nothing of a resolved incident hears nothing of it.
        let mut quiet = Told::new();
        let mut over = alerts.clone();
        over[0].state = AlertState::Resolved;
        assert_eq!(tell(&mut quiet, &snapshot(&over, &[])), []);
    }

    #[test]
    fn the_note_round_trips_through_json_and_carries_the_action() {
        let incidents = group(
            vec![alert("nan", Rule::Nonfinite, 7, 1, F)],
            |_: &RunId| Some(4),
            100,
        );
        let note = IncidentNote::from(&incidents[0]);
        assert!(note.action.starts_with("Only rank 1"), "{}", note.action);
        assert_eq!(note.evidence, incidents[0].alerts[0].explanation);
        let back: IncidentNote =
            serde_json::from_slice(&serde_json::to_vec(&note).unwrap()).unwrap();
        assert_eq!(back, note);
    }
}
