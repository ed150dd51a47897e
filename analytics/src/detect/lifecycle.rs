//! The alert lifecycle shared by every rule: consecutive-breach persistence before firing,
//! consecutive-clear persistence before resolving, severity that only escalates while open.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::alert::{Alert, AlertKey, AlertState, Rule, Severity};
use crate::error::{Error, Result};
use crate::validate::RunId;
use crate::vocab::Site;

/// Persistence in observations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleConfig {
    /// Breaching observations, with no clear between them, before an alert fires (1 = at once).
    pub pending_for: u32,
    /// Consecutive clear observations before a firing alert resolves.
    pub resolve_after: u32,
}

impl LifecycleConfig {
    /// Checks both counts are at least 1.
    pub fn validate(&self, rule: &str) -> Result<()> {
        if self.pending_for == 0 || self.resolve_after == 0 {
            return Err(Error::Config(format!(
                "{rule}: pending_for and resolve_after must be at least 1"
            )));
        }
        Ok(())
    }
}

/// A rule's verdict on one observation.
#[derive(Debug, Clone, PartialEq)]
pub enum Signal {
    /// The condition holds.
    Breach(Breach),
    /// Between the enter and exit thresholds (or no usable data): keep the current state.
    Hold,
    /// Back below the exit threshold.
    Clear,
}

impl Signal {
    /// Which of the three verdicts this is (0 breach, 1 hold, 2 clear).
    fn index(&self) -> usize {
        match self {
            Signal::Breach(_) => 0,
            Signal::Hold => 1,
            Signal::Clear => 2,
        }
    }
}

/// What a breach reports.
#[derive(Debug, Clone, PartialEq)]
pub struct Breach {
    pub severity: Severity,
    pub value: f64,
    pub threshold: f64,
    pub explanation: String,
    pub outlier_ranks: Vec<u32>,
}

impl Breach {
    /// One breach reporting both: `other`'s explanation after this one's, and its ranks not
    /// named yet after this one's; this one's severity, value and threshold.
    pub fn join(mut self, other: Breach) -> Breach {
        self.explanation = format!("{}; {}", self.explanation, other.explanation);
        for r in other.outlier_ranks {
            if !self.outlier_ranks.contains(&r) {
                self.outlier_ranks.push(r);
            }
        }
        self
    }
}

/// The lifecycle of the alerts on one key.
#[derive(Debug, Clone)]
pub struct AlertTracker {
    key: AlertKey,
    open: Option<Alert>,
    breaches: u32,
    clears: u32,
    /// The step [`AlertTracker::observe_once_per_step`] last counted, with the verdicts
    /// counted at it.
    counted: Option<(u64, [bool; 3])>,
    /// A clear `observe_once_per_step` has not counted yet (its step and time): another test
    /// of the same step may still breach or hold.
    tentative_clear: Option<(u64, i64)>,
}

impl AlertTracker {
    /// A tracker with no open alert.
    pub fn new(key: AlertKey) -> Self {
        AlertTracker {
            key,
            open: None,
            breaches: 0,
            clears: 0,
            counted: None,
            tentative_clear: None,
        }
    }

    /// As [`AlertTracker::observe`], for a rule whose step may reach it in several
    /// observations (a layer's probes of one step come in different reports, batched however
    /// the network had them): a verdict already counted at this step updates an open alert
    /// but counts no second time, and a clear counts only once an observation of a later step
    /// arrives (another test of its step may still breach or hold, and would have had the
    /// last word had they come together), so persistence counts steps, not batches. A clear
    /// therefore resolves one observation later than under [`AlertTracker::observe`].
    pub fn observe_once_per_step(
        &mut self,
        step: u64,
        time_ms: i64,
        signal: Signal,
        config: &LifecycleConfig,
    ) -> Vec<Alert> {
        let mut changed = Vec::new();
        match self.tentative_clear {
            Some((at, at_ms)) if step > at => {
                self.tentative_clear = None;
                changed.extend(self.count_once(at, at_ms, Signal::Clear, config));
            }
            // The same step's other test had the last word: its clear never counts.
            Some((at, _)) if step == at && !matches!(signal, Signal::Clear) => {
                self.tentative_clear = None;
            }
            _ => {}
        }
        if matches!(signal, Signal::Clear) {
            // A clear already held for this step (or an older one) stays the one held.
            self.tentative_clear.get_or_insert((step, time_ms));
            return changed;
        }
        changed.extend(self.count_once(step, time_ms, signal, config));
        changed
    }

    /// Counts `signal` unless its verdict was counted at `step` already (a breach still
    /// updates the open alert).
    fn count_once(
        &mut self,
        step: u64,
        time_ms: i64,
        signal: Signal,
        config: &LifecycleConfig,
    ) -> Option<Alert> {
        let verdict = signal.index();
        let mut seen = match self.counted {
            Some((at, seen)) if at == step => seen,
            _ => [false; 3],
        };
        if seen[verdict] {
            let Signal::Breach(breach) = signal else {
                return None;
            };
            let alert = self.open.as_mut()?;
            let escalated = breach.severity > alert.severity;
            apply(alert, breach, step, time_ms);
            return escalated.then(|| alert.clone());
        }
        seen[verdict] = true;
        self.counted = Some((step, seen));
        self.observe(step, time_ms, signal, config)
    }

    /// The open (pending or firing) alert, if any.
    pub fn open(&self) -> Option<&Alert> {
        self.open.as_ref()
    }

    /// First step of the current breach, if one is open.
    pub fn breach_started(&self) -> Option<u64> {
        self.open.as_ref().map(|a| a.first_step)
    }

    /// Applies one signal; returns the alert if it changed state or escalated.
    pub fn observe(
        &mut self,
        step: u64,
        time_ms: i64,
        signal: Signal,
        config: &LifecycleConfig,
    ) -> Option<Alert> {
        match signal {
            Signal::Breach(breach) => {
                self.clears = 0;
                self.breaches = self.breaches.saturating_add(1);
                let fire = self.breaches >= config.pending_for;
                match &mut self.open {
                    None => {
                        let mut alert = Alert {
                            id: Alert::id_for(&self.key, step),
                            run: self.key.run.clone(),
                            rule: self.key.rule,
                            severity: breach.severity,
                            state: AlertState::Pending,
                            layer: self.key.layer,
                            site: self.key.site,
                            rank: self.key.rank,
                            outlier_ranks: Vec::new(),
                            value: f64::NAN,
                            threshold: f64::NAN,
                            first_step: step,
                            last_step: step,
                            started_at_ms: time_ms,
                            updated_at_ms: time_ms,
                            fired_at_ms: None,
                            resolved_at_ms: None,
                            explanation: String::new(),
                        };
                        apply(&mut alert, breach, step, time_ms);
                        if fire {
                            alert.state = AlertState::Firing;
                            alert.fired_at_ms = Some(time_ms);
                        }
                        self.open = Some(alert.clone());
                        Some(alert)
                    }
                    Some(alert) => {
                        let escalated = breach.severity > alert.severity;
                        apply(alert, breach, step, time_ms);
                        if alert.state == AlertState::Pending && fire {
                            alert.state = AlertState::Firing;
                            alert.fired_at_ms = Some(time_ms);
                            Some(alert.clone())
                        } else if escalated {
                            Some(alert.clone())
                        } else {
                            None
                        }
                    }
                }
            }
            Signal::Hold => {
                self.clears = 0;
                None
            }
            Signal::Clear => {
                self.breaches = 0;
                self.clears = self.clears.saturating_add(1);
                let resolve = match &self.open {
                    None => false,
                    Some(a) if a.state == AlertState::Pending => true,
                    Some(_) => self.clears >= config.resolve_after,
                };
                if !resolve {
                    return None;
                }
                let mut alert = self.open.take()?;
                alert.resolve(time_ms, None);
                self.clears = 0;
                Some(alert)
            }
        }
    }
}

fn apply(alert: &mut Alert, breach: Breach, step: u64, time_ms: i64) {
    alert.severity = alert.severity.max(breach.severity);
    alert.value = breach.value;
    alert.threshold = breach.threshold;
    alert.explanation = breach.explanation;
    if !breach.outlier_ranks.is_empty() {
        alert.outlier_ranks = breach.outlier_ranks;
    }
    alert.last_step = step;
    alert.updated_at_ms = time_ms;
}

/// Where in the run an alert's subject is: (layer, site, rank), as in [`AlertKey`].
pub(crate) type Place = (Option<u32>, Option<Site>, Option<u32>);

/// Trackers for the subjects of one rule in one run, keyed by `K` (a layer, a rank, ...);
/// `place` maps a subject to the layer, site and rank of its alert key.
#[derive(Debug, Clone)]
pub(crate) struct Trackers<K: Ord> {
    run: RunId,
    rule: Rule,
    place: fn(&K) -> Place,
    map: BTreeMap<K, AlertTracker>,
    /// Whether each verdict counts once per step (`once_per_step`).
    once_per_step: bool,
}

impl<K: Ord + Clone> Trackers<K> {
    pub(crate) fn new(run: RunId, rule: Rule, place: fn(&K) -> Place) -> Self {
        Trackers {
            run,
            rule,
            place,
            map: BTreeMap::new(),
            once_per_step: false,
        }
    }

    /// First step of the open breach on `subject`, if any.
    pub(crate) fn breach_started(&self, subject: &K) -> Option<u64> {
        self.map.get(subject).and_then(AlertTracker::breach_started)
    }

    /// These trackers count each verdict once per step
    /// ([`AlertTracker::observe_once_per_step`]): for a rule whose step may come in several
    /// observations.
    pub(crate) fn once_per_step(mut self) -> Self {
        self.once_per_step = true;
        self
    }

    /// Applies `signal` to `subject`'s tracker; the alerts that changed (zero or one, or two
    /// where a clear held back from an earlier step counts now).
    pub(crate) fn observe(
        &mut self,
        subject: &K,
        step: u64,
        time_ms: i64,
        signal: Signal,
        config: &LifecycleConfig,
    ) -> Vec<Alert> {
        let once = self.once_per_step;
        let apply = |tracker: &mut AlertTracker, signal: Signal| {
            if once {
                tracker.observe_once_per_step(step, time_ms, signal, config)
            } else {
                tracker
                    .observe(step, time_ms, signal, config)
                    .into_iter()
                    .collect()
            }
        };
        if let Some(tracker) = self.map.get_mut(subject) {
            return apply(tracker, signal);
        }
        // A subject with no tracker is one with nothing open and no breach under way: a clear
        // or a hold changes nothing there, so it gets no tracker (every rank's `nonfinite`
        // and every activation site clear at almost every step).
        if !matches!(signal, Signal::Breach(_)) {
            return Vec::new();
        }
        let (layer, site, rank) = (self.place)(subject);
        let mut tracker = AlertTracker::new(AlertKey {
            run: self.run.clone(),
            rule: self.rule,
            layer,
            site,
            rank,
        });
        let changed = apply(&mut tracker, signal);
        self.map.insert(subject.clone(), tracker);
        changed
    }

    pub(crate) fn open(&self) -> Vec<Alert> {
        self.map
            .values()
            .filter_map(|t| t.open().cloned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breach(severity: Severity) -> Signal {
        Signal::Breach(Breach {
            severity,
            value: 1.0,
            threshold: 0.5,
            explanation: "x".into(),
            outlier_ranks: vec![],
        })
    }

    #[test]
    fn pending_firing_escalation_resolution() {
        let key = AlertKey {
            run: RunId::new("r").unwrap(),
            rule: Rule::LossSpike,
            layer: None,
            site: None,
            rank: Some(1),
        };
        let cfg = LifecycleConfig {
            pending_for: 2,
            resolve_after: 2,
        };
        let mut t = AlertTracker::new(key);
        let a = t.observe(10, 100, breach(Severity::Warning), &cfg).unwrap();
        assert_eq!((a.state, a.first_step), (AlertState::Pending, 10));
        assert_eq!(t.observe(11, 110, Signal::Hold, &cfg), None);
        let a = t.observe(12, 120, breach(Severity::Warning), &cfg).unwrap();
        assert_eq!((a.state, a.fired_at_ms), (AlertState::Firing, Some(120)));
        assert_eq!(t.observe(13, 130, breach(Severity::Warning), &cfg), None);
        let a = t
            .observe(14, 140, breach(Severity::Critical), &cfg)
            .unwrap();
        assert_eq!(
            (a.state, a.severity),
            (AlertState::Firing, Severity::Critical)
        );
        // Severity never drops while open.
        t.observe(15, 150, breach(Severity::Warning), &cfg);
        assert_eq!(t.open().unwrap().severity, Severity::Critical);
        assert_eq!(t.observe(16, 160, Signal::Clear, &cfg), None);
        assert_eq!(t.observe(17, 170, Signal::Hold, &cfg), None); // hold resets the clear streak
        assert_eq!(t.observe(18, 180, Signal::Clear, &cfg), None);
        let a = t.observe(19, 190, Signal::Clear, &cfg).unwrap();
        assert_eq!(
            (a.state, a.resolved_at_ms, a.last_step),
            (AlertState::Resolved, Some(190), 15)
        );
        assert_eq!(a.id, "r:loss_spike:-:-:1:10");
        assert!(t.open().is_none());
        // A pending alert that clears is withdrawn without ever firing.
        t.observe(30, 300, breach(Severity::Warning), &cfg);
        let a = t.observe(31, 310, Signal::Clear, &cfg).unwrap();
        assert_eq!(a.state, AlertState::Resolved);
        assert!(!a.has_fired());
    }
}
