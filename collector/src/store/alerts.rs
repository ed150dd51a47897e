//! The store's side of alerts: the current state of every alert, revisions the training
//! process polls, and the journal that makes each change durable before it is told (see
//! `alert_log`); Parquet holds them from the next flush.

use rankwatch_analytics::{Alert, RunId};

use super::{Event, Store, alert_log};
use crate::error::Result;

impl Store {
    /// Lays the journal's alert changes over the alerts read from Parquet; the runs they touch
    /// are written to Parquet by the next flush, after which the journal files go.
    pub(super) fn apply_journal(&self, journaled: alert_log::Recovered) {
        let mut state = self.lock();
        for run in &journaled.deleted {
            state.alerts.retain(|_, a| &a.run != run);
        }
        for (id, alert) in journaled.alerts {
            let newer = state
                .alerts
                .get(&id)
                .is_none_or(|old| old.updated_at_ms <= alert.updated_at_ms);
            if newer {
                state.alerts_dirty.push(alert.run.clone());
                state.alerts.insert(id, alert);
            }
        }
    }

    /// Makes alert changes (already upserted) durable: the alert engine calls this before it
    /// tells any receiver.
    pub fn journal_alerts(&self, alerts: &[Alert]) -> Result<()> {
        self.alert_log.append(alerts)
    }

    /// Alerts, filtered.
    pub fn alerts(&self, run: Option<&RunId>) -> Vec<Alert> {
        self.lock()
            .alerts
            .values()
            .filter(|a| run.is_none_or(|r| a.run == *r))
            .cloned()
            .collect()
    }

    /// Records an alert's new state (the alert engine's entry point); persisted at the next
    /// flush, announced at once.
    pub fn upsert_alert(&self, alert: Alert) {
        {
            let mut state = self.lock();
            state.alerts_dirty.push(alert.run.clone());
            state.alert_revision += 1;
            let revision = state.alert_revision;
            state.alert_revisions.insert(alert.id.clone(), revision);
            state.alerts.insert(alert.id.clone(), alert.clone());
        }
        self.publish(Event::Alert {
            alert: Box::new((&alert).into()),
        });
    }

    /// The alerts of `run` that changed after `revision`, oldest change first, with the latest
    /// revision.
    pub fn alert_changes(&self, run: &RunId, revision: u64) -> (u64, Vec<Alert>) {
        let state = self.lock();
        let mut changed: Vec<(u64, Alert)> = state
            .alert_revisions
            .iter()
            .filter(|(_, rev)| **rev > revision)
            .filter_map(|(id, rev)| state.alerts.get(id).map(|a| (*rev, a)))
            .filter(|(_, a)| a.run == *run)
            .map(|(rev, a)| (rev, a.clone()))
            .collect();
        changed.sort_by_key(|(rev, _)| *rev);
        (
            state.alert_revision,
            changed.into_iter().map(|(_, a)| a).collect(),
        )
    }
}
