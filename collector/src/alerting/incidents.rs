//! A run's incidents as people and receivers see them: the store's alerts grouped by cause
//! ([`rankwatch_analytics::incident::group`]), recomputed whenever they are asked for — by the
//! API on each request, by the engine each time it hands alert states to the receivers.
//!
//! Receivers (webhooks, Slack) hear incidents, not alerts: [`RunIncidents`] is one run's
//! incidents at one moment, with the ones a silence mutes marked, which the sinks compare with
//! what each receiver was last told (`sinks/told.rs`).

use std::collections::{BTreeSet, HashMap};

use rankwatch_analytics::incident::{self, DEFAULT_WINDOW_STEPS};
use rankwatch_analytics::{AlertState, RunId};
use rankwatch_api::{Alert, Incident};

use super::actions::AlertActions;
use crate::store::Store;

/// A run's (or every run's) incidents, grouped from the store's alerts.
pub fn of(store: &Store, run: Option<&RunId>) -> Vec<Incident> {
    incident::group(
        store.alerts(run),
        |r| store.world_size(r),
        DEFAULT_WINDOW_STEPS,
    )
}

/// `incidents` with what people did about them: the silences muting them, acknowledgements.
pub fn with_actions(mut incidents: Vec<Incident>, actions: &AlertActions) -> Vec<Incident> {
    for i in &mut incidents {
        let mut silenced_by: Vec<String> =
            i.alerts.iter().flat_map(|a| actions.muting(a)).collect();
        silenced_by.sort();
        silenced_by.dedup();
        i.silenced_by = silenced_by;
        i.acknowledged = actions.acknowledgement(&i.alerts);
    }
    incidents
}

/// One run's incidents at one moment, as receivers are told of them.
#[derive(Debug, Clone, PartialEq)]
pub struct RunIncidents {
    pub run: RunId,
    /// Its incidents, oldest onset first. Empty when the run has none (or was deleted).
    pub incidents: Vec<Incident>,
    /// Ids of the incidents a silence mutes: every alert of theirs still open is silenced.
    pub muted: BTreeSet<String>,
}

impl RunIncidents {
    /// `run`'s incidents now; `muted` says which open alerts a silence holds back.
    pub fn of(store: &Store, run: &RunId, muted: &dyn Fn(&Alert) -> bool) -> RunIncidents {
        RunIncidents::from_incidents(run.clone(), of(store, Some(run)), muted)
    }

    /// Every run's incidents now, one entry per run with alerts.
    pub fn every_run(store: &Store, muted: &dyn Fn(&Alert) -> bool) -> Vec<RunIncidents> {
        let mut by_run: std::collections::BTreeMap<String, Vec<Incident>> = Default::default();
        for i in of(store, None) {
            by_run.entry(i.run.clone()).or_default().push(i);
        }
        by_run
            .into_iter()
            .filter_map(|(run, incidents)| {
                let run = RunId::new(run).ok()?;
                Some(RunIncidents::from_incidents(run, incidents, muted))
            })
            .collect()
    }

    /// A run with no incidents (deleted): receivers hear the end of what they were told.
    pub fn none(run: RunId) -> RunIncidents {
        RunIncidents {
            run,
            incidents: Vec::new(),
            muted: BTreeSet::new(),
        }
    }

    fn from_incidents(
        run: RunId,
        mut incidents: Vec<Incident>,
        muted: &dyn Fn(&Alert) -> bool,
    ) -> RunIncidents {
        incidents.sort_by(|a, b| (a.first_step, &a.id).cmp(&(b.first_step, &b.id)));
        let muted = incidents
            .iter()
            .filter(|i| {
                let mut open = i
                    .alerts
                    .iter()
                    .filter(|a| a.state != AlertState::Resolved)
                    .peekable();
                open.peek().is_some() && open.all(muted)
            })
            .map(|i| i.id.clone())
            .collect();
        RunIncidents {
            run,
            incidents,
            muted,
        }
    }

    /// The incident each alert belongs to now: alert id → incident id.
    pub fn incident_of(&self) -> HashMap<String, String> {
        self.incidents
            .iter()
            .flat_map(|i| i.alerts.iter().map(|a| (a.id.clone(), i.id.clone())))
            .collect()
    }
}
