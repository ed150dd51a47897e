//! What people do about alerts: acknowledge an incident, silence what matches, as
//! Alertmanager does.
//!
//! **Acknowledgements** are kept per alert id, not per incident: incidents are recomputed from
//! the alerts on every request ([`rankwatch_analytics::incident`]), so an acknowledgement of
//! "this incident" is an acknowledgement of the alerts it held at that moment. An incident
//! shows as acknowledged while every one of its alerts is; a new symptom joining it makes it
//! unacknowledged again, which is the point — it changed after someone looked.
//!
//! **Silences** are matchers (run, rule, layer, site, rank; absent ones match anything) with
//! an end time. While one matches an alert, the alert is still detected, stored and shown,
//! but receivers (webhook, Slack, Alertmanager) are not told of it firing; the engine holds it
//! back and tells them once no silence matches any more (expired or deleted). Resolutions are
//! never held back: they reach only receivers already told of the firing, and holding them
//! would leave those receivers firing for ever. Ended silences stay listed for a week, as
//! history of who muted what.
//!
//! Both live in one small JSON file, `DIR/alert-actions.json`, rewritten atomically on each
//! change: people act rarely, and an action the collector answered must survive a crash. A
//! file that does not parse stops the collector with its path rather than being dropped:
//! forgetting silences would page people the silence was set to spare.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Mutex;

use rankwatch_analytics::{RunId, Site};
use rankwatch_api::{AckRequest, Acknowledgement, Alert, Matchers, NewSilence, Silence};
use serde::{Deserialize, Serialize};

use crate::clock::SharedClock;
use crate::error::{Error, Result};

/// Longest silence one request may set.
const MAX_SILENCE_S: u64 = 90 * 24 * 3600;
/// How long an ended silence stays listed.
const KEEP_ENDED_MS: i64 = 7 * 24 * 3600 * 1000;
/// Most active silences at once, and most ended ones kept listed: each costs a match per alert
/// state, and the read token that creates them is the dashboard's (before, unlimited).
pub const MAX_SILENCES: usize = 1_000;
/// Longest name or comment accepted.
const MAX_TEXT: usize = 1000;
const MAX_NAME: usize = 100;

#[derive(Debug, Default, Serialize, Deserialize)]
struct Saved {
    /// Alert id → its acknowledgement and run (to forget it with the run).
    acks: BTreeMap<String, (String, Acknowledgement)>,
    silences: Vec<SavedSilence>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct SavedSilence {
    id: String,
    matchers: Matchers,
    starts_at_ms: i64,
    ends_at_ms: i64,
    created_by: String,
    comment: String,
}

impl SavedSilence {
    fn active(&self, now_ms: i64) -> bool {
        self.starts_at_ms <= now_ms && now_ms < self.ends_at_ms
    }

    fn matches(&self, alert: &Alert) -> bool {
        let m = &self.matchers;
        m.run.as_deref().is_none_or(|r| r == alert.run)
            && m.rule.is_none_or(|r| r == alert.rule)
            && m.layer.is_none_or(|l| alert.layer == Some(l))
            && m.site
                .as_deref()
                .is_none_or(|s| alert.site.as_deref() == Some(s))
            && m.rank.is_none_or(|r| alert.rank == Some(r))
    }

    fn public(&self, now_ms: i64) -> Silence {
        Silence {
            id: self.id.clone(),
            matchers: self.matchers.clone(),
            starts_at_ms: self.starts_at_ms,
            ends_at_ms: self.ends_at_ms,
            created_by: self.created_by.clone(),
            comment: self.comment.clone(),
            active: self.active(now_ms),
        }
    }
}

/// Acknowledgements and silences, shared by the API and the alert engine.
#[derive(Debug)]
pub struct AlertActions {
    /// `None` keeps them in memory only (tests).
    path: Option<PathBuf>,
    clock: SharedClock,
    saved: Mutex<Saved>,
    /// Most active silences, and most ended ones kept ([`MAX_SILENCES`]).
    max_silences: usize,
}

impl AlertActions {
    /// The actions saved at `path` (none when it does not exist yet).
    pub fn open(path: Option<PathBuf>, clock: SharedClock) -> Result<AlertActions> {
        let saved = match &path {
            Some(p) if p.exists() => {
                let bytes = std::fs::read(p)?;
                serde_json::from_slice(&bytes).map_err(|e| Error::Corrupt {
                    what: p.display().to_string(),
                    reason: format!(
                        "{e}; fix or remove it (it holds silences and acknowledgements)"
                    ),
                })?
            }
            _ => Saved::default(),
        };
        Ok(AlertActions {
            path,
            clock,
            saved: Mutex::new(saved),
            max_silences: MAX_SILENCES,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Saved> {
        self.saved.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies `change` and saves; on a failed save the change is undone and the error returned,
    /// so the API never answers for an action a restart would forget.
    fn change<T>(&self, change: impl FnOnce(&mut Saved) -> Result<T>) -> Result<T> {
        let mut saved = self.lock();
        let before = serde_json::to_vec(&*saved)?;
        let out = change(&mut saved)?;
        if let Some(path) = &self.path {
            let bytes = serde_json::to_vec_pretty(&*saved)?;
            if let Err(e) = crate::fsutil::write_atomic(path, &bytes) {
                *saved = serde_json::from_slice(&before)?;
                return Err(e);
            }
        }
        Ok(out)
    }

    /// Acknowledges `alerts` (an incident's).
    pub fn acknowledge(&self, alerts: &[Alert], request: AckRequest) -> Result<Acknowledgement> {
        let by = text("by", &request.by, MAX_NAME, true)?;
        let comment = text("comment", &request.comment, MAX_TEXT, false)?;
        let ack = Acknowledgement {
            by,
            at_ms: self.clock.now_ms(),
            comment,
        };
        self.change(|saved| {
            for alert in alerts {
                saved
                    .acks
                    .insert(alert.id.clone(), (alert.run.clone(), ack.clone()));
            }
            Ok(ack.clone())
        })
    }

    /// Takes the acknowledgement of `alerts` back.
    pub fn unacknowledge(&self, alerts: &[Alert]) -> Result<()> {
        self.change(|saved| {
            for alert in alerts {
                saved.acks.remove(&alert.id);
            }
            Ok(())
        })
    }

    /// The latest acknowledgement when every one of `alerts` is acknowledged.
    pub fn acknowledgement(&self, alerts: &[Alert]) -> Option<Acknowledgement> {
        let saved = self.lock();
        let mut latest: Option<&Acknowledgement> = None;
        for alert in alerts {
            let (_, ack) = saved.acks.get(&alert.id)?;
            if latest.is_none_or(|l| ack.at_ms >= l.at_ms) {
                latest = Some(ack);
            }
        }
        latest.cloned()
    }

    /// Starts a silence.
    pub fn silence(&self, request: NewSilence) -> Result<Silence> {
        let m = &request.matchers;
        if m == &Matchers::default() {
            return Err(Error::BadRequest(
                "a silence needs at least one matcher (run, rule, layer, site or rank); it would mute every alert".into(),
            ));
        }
        if let Some(run) = &m.run {
            RunId::new(run.clone())?;
        }
        if let Some(site) = &m.site {
            site.parse::<Site>()
                .map_err(|e| Error::BadRequest(format!("matchers.site: {e}")))?;
        }
        if request.duration_s == 0 || request.duration_s > MAX_SILENCE_S {
            return Err(Error::BadRequest(format!(
                "duration_s must be 1 to {MAX_SILENCE_S} (90 days), got {}",
                request.duration_s
            )));
        }
        let now = self.clock.now_ms();
        let silence = SavedSilence {
            id: format!("silence-{}", rankwatch_analytics::random_hex_id()),
            matchers: request.matchers.clone(),
            starts_at_ms: now,
            ends_at_ms: now + (request.duration_s * 1000) as i64,
            created_by: text("created_by", &request.created_by, MAX_NAME, true)?,
            comment: text("comment", &request.comment, MAX_TEXT, false)?,
        };
        let max = self.max_silences;
        self.change(|saved| {
            saved
                .silences
                .retain(|s| now - s.ends_at_ms < KEEP_ENDED_MS);
            let active = saved.silences.iter().filter(|s| s.active(now)).count();
            if active >= max {
                return Err(Error::Cardinality(format!(
                    "{active} silences are active, the most this collector keeps ({max}); end \
                     some (DELETE /api/v1/silences/{{id}}) or widen one's matchers"
                )));
            }
            // Ended ones beyond the limit go, oldest end first.
            let ended = saved.silences.len() - active;
            if ended >= max {
                let mut ends: Vec<i64> = saved
                    .silences
                    .iter()
                    .filter(|s| !s.active(now))
                    .map(|s| s.ends_at_ms)
                    .collect();
                ends.sort_unstable();
                let cut = ends[ended - max];
                let mut drop = ended + 1 - max;
                saved.silences.retain(|s| {
                    let gone = drop > 0 && !s.active(now) && s.ends_at_ms <= cut;
                    drop -= usize::from(gone);
                    !gone
                });
            }
            saved.silences.push(silence.clone());
            Ok(silence.public(now))
        })
    }

    /// Ends a silence now (it stays listed as ended).
    pub fn expire(&self, id: &str) -> Result<Silence> {
        let now = self.clock.now_ms();
        self.change(|saved| {
            let silence = saved
                .silences
                .iter_mut()
                .find(|s| s.id == id)
                .ok_or_else(|| Error::Missing(format!("no silence {id:?}")))?;
            silence.ends_at_ms = silence.ends_at_ms.min(now);
            Ok(silence.public(now))
        })
    }

    /// Every silence, active ones first, newest first.
    pub fn silences(&self) -> Vec<Silence> {
        let now = self.clock.now_ms();
        let mut out: Vec<Silence> = self
            .lock()
            .silences
            .iter()
            .filter(|s| now - s.ends_at_ms < KEEP_ENDED_MS)
            .map(|s| s.public(now))
            .collect();
        out.sort_by_key(|s| std::cmp::Reverse((s.active, s.starts_at_ms)));
        out
    }

    /// Ids of the silences muting `alert` now.
    pub fn muting(&self, alert: &Alert) -> Vec<String> {
        let now = self.clock.now_ms();
        self.lock()
            .silences
            .iter()
            .filter(|s| s.active(now) && s.matches(alert))
            .map(|s| s.id.clone())
            .collect()
    }

    /// Whether receivers should not hear of `alert` firing now.
    pub fn is_muted(&self, alert: &Alert) -> bool {
        !self.muting(alert).is_empty()
    }

    /// Drops the acknowledgements of a deleted run's alerts (its silences stay: they may be
    /// set for a run name that will be used again).
    pub fn forget_run(&self, run: &RunId) -> Result<()> {
        if !self.lock().acks.values().any(|(r, _)| r == run.as_str()) {
            return Ok(());
        }
        self.change(|saved| {
            saved.acks.retain(|_, (r, _)| r != run.as_str());
            Ok(())
        })
    }
}

/// A trimmed name or comment within `max` characters; `required` ones must not be empty.
fn text(field: &str, value: &str, max: usize, required: bool) -> Result<String> {
    let value = value.trim();
    if required && value.is_empty() {
        return Err(Error::BadRequest(format!("{field} must not be empty")));
    }
    if value.chars().count() > max {
        return Err(Error::BadRequest(format!(
            "{field} is longer than {max} characters"
        )));
    }
    if value.chars().any(char::is_control) {
        return Err(Error::BadRequest(format!(
            "{field} holds a control character"
        )));
    }
    Ok(value.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use rankwatch_analytics::{AlertState, Rule, Severity};

    fn alert(rule: Rule, rank: Option<u32>) -> Alert {
        Alert {
            id: format!("r:{rule}:{rank:?}"),
            run: "r".to_owned(),
            rule,
            severity: Severity::Warning,
            state: AlertState::Firing,
            layer: Some(1),
            site: Some(Site::MlpOut.as_str().to_owned()),
            rank,
            outlier_ranks: vec![],
            value: Some(1.0),
            threshold: Some(1.0),
            first_step: 1,
            last_step: 2,
            started_at_ms: 0,
            updated_at_ms: 0,
            fired_at_ms: Some(0),
            resolved_at_ms: None,
            explanation: String::new(),
        }
    }

    fn silence(matchers: Matchers, duration_s: u64) -> NewSilence {
        NewSilence {
            matchers,
            duration_s,
            created_by: "ana".into(),
            comment: "known".into(),
        }
    }

    #[test]
    fn a_silence_mutes_what_it_matches_until_it_ends_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("alert-actions.json");
        let clock = ManualClock::at(1_000);
        let actions = AlertActions::open(Some(path.clone()), clock.clone() as SharedClock).unwrap();
        let s = actions
            .silence(silence(
                Matchers {
                    rule: Some(Rule::ActivationOutlier),
                    rank: Some(2),
                    ..Matchers::default()
                },
                60,
            ))
            .unwrap();
        assert!(s.active);
        assert!(actions.is_muted(&alert(Rule::ActivationOutlier, Some(2))));
        assert!(!actions.is_muted(&alert(Rule::ActivationOutlier, Some(1))));
        assert!(!actions.is_muted(&alert(Rule::LossSpike, Some(2))));

        let reopened =
            AlertActions::open(Some(path.clone()), clock.clone() as SharedClock).unwrap();
        assert_eq!(
            reopened.muting(&alert(Rule::ActivationOutlier, Some(2))),
            vec![s.id.clone()]
        );
        clock.advance(std::time::Duration::from_secs(61));
        assert!(
            !reopened.is_muted(&alert(Rule::ActivationOutlier, Some(2))),
            "expired"
        );
        assert!(
            !reopened.silences()[0].active,
            "an ended silence stays listed"
        );
    }

    #[test]
    fn bad_silences_are_refused_with_the_reason() {
        let actions = AlertActions::open(None, ManualClock::at(0)).unwrap();
        let err = |m: Matchers, d: u64| actions.silence(silence(m, d)).unwrap_err().to_string();
        assert!(err(Matchers::default(), 60).contains("at least one matcher"));
        let run = |r: &str| Matchers {
            run: Some(r.into()),
            ..Matchers::default()
        };
        assert!(err(run("r"), 0).contains("duration_s"));
        assert!(
            err(run("../etc"), 60).contains("run id"),
            "{}",
            err(run("../etc"), 60)
        );
        let site = Matchers {
            site: Some("elbow".into()),
            ..Matchers::default()
        };
        assert!(err(site, 60).contains("matchers.site"));
        let mut nameless = silence(run("r"), 60);
        nameless.created_by = "  ".into();
        assert!(
            actions
                .silence(nameless)
                .unwrap_err()
                .to_string()
                .contains("created_by")
        );
        assert!(
            actions
                .expire("silence-nope")
                .unwrap_err()
                .to_string()
                .contains("no silence")
        );
    }

    #[test]
    fn an_incident_is_acknowledged_while_every_alert_of_it_is() {
        let actions = AlertActions::open(None, ManualClock::at(5)).unwrap();
        let a = alert(Rule::ActivationOutlier, Some(0));
        let b = alert(Rule::LossSpike, None);
        let request = AckRequest {
            by: "ana".into(),
            comment: String::new(),
        };
        actions
            .acknowledge(std::slice::from_ref(&a), request)
            .unwrap();
        assert_eq!(
            actions
                .acknowledgement(std::slice::from_ref(&a))
                .unwrap()
                .by,
            "ana"
        );
        assert!(
            actions.acknowledgement(&[a.clone(), b]).is_none(),
            "b joined later"
        );
        actions.unacknowledge(std::slice::from_ref(&a)).unwrap();
        assert!(actions.acknowledgement(&[a]).is_none());
    }

    #[test]
    fn silences_are_bounded_active_and_ended() {
        let clock = ManualClock::at(0);
        let mut actions = AlertActions::open(None, clock.clone()).unwrap();
        assert_eq!(actions.max_silences, MAX_SILENCES);
        actions.max_silences = 20;
        let new = |run: String| NewSilence {
            matchers: Matchers {
                run: Some(run),
                ..Matchers::default()
            },
            duration_s: 60,
            created_by: "ana".into(),
            comment: String::new(),
        };
        for i in 0..20 {
            actions.silence(new(format!("r{i}"))).unwrap();
        }
        let e = actions.silence(new("one-more".into())).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::UNPROCESSABLE_ENTITY);
        assert!(e.to_string().contains("20 silences are active"), "{e}");
        // Once they end, new ones are taken, and the ended ones kept stay bounded.
        clock.advance(std::time::Duration::from_secs(61));
        for i in 0..MAX_SILENCES + 10 {
            actions.silence(new(format!("s{i}"))).unwrap();
            clock.advance(std::time::Duration::from_secs(61));
        }
        assert!(
            actions.lock().silences.len() <= 2 * MAX_SILENCES,
            "{}",
            actions.lock().silences.len()
        );
    }

    #[test]
    fn a_damaged_file_stops_the_start_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("alert-actions.json");
        std::fs::write(&path, b"{not json").unwrap();
        let err = AlertActions::open(Some(path), ManualClock::at(0)).unwrap_err();
        assert!(err.to_string().contains("alert-actions.json"), "{err}");
    }
}
