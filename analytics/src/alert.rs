//! Alerts and their lifecycle (`docs/detection.md`).
//!
//! An alert is identified by its [`AlertKey`] (run, rule, layer, site, rank): at most one alert
//! per key is open at a time, which is what deduplication means here. Its state moves
//! pending → firing → resolved; a pending alert whose condition clears before it fires is
//! resolved without ever having fired (`fired_at_ms` stays `None`), and sinks that page people
//! ignore those. The id is derived from the key and the first breaching step, so the same alert
//! replayed after a restart has the same id.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::validate::RunId;
use crate::vocab::Site;

// The alert vocabulary is part of the wire contract: one definition, in `rankwatch-api`.
pub use rankwatch_api::{AlertState, Rule, Severity};

/// What an alert is about; at most one open alert per key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AlertKey {
    pub run: RunId,
    pub rule: Rule,
    pub layer: Option<u32>,
    pub site: Option<Site>,
    /// The rank the alert is about, for per-rank rules (`stale_rank`, per-rank `nonfinite`).
    pub rank: Option<u32>,
}

/// One alert, as stored in the `alerts` table and delivered to sinks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Alert {
    pub id: String,
    pub run: RunId,
    pub rule: Rule,
    pub severity: Severity,
    pub state: AlertState,
    pub layer: Option<u32>,
    pub site: Option<Site>,
    pub rank: Option<u32>,
    /// Ranks named as outliers (silent inconsistency), most deviant first.
    pub outlier_ranks: Vec<u32>,
    /// The observed value that breached (ratio, z-score, count, ...; the explanation says which).
    pub value: f64,
    /// The threshold it breached.
    pub threshold: f64,
    /// First and latest step of the breach.
    pub first_step: u64,
    pub last_step: u64,
    pub started_at_ms: i64,
    pub updated_at_ms: i64,
    pub fired_at_ms: Option<i64>,
    pub resolved_at_ms: Option<i64>,
    /// One line a person can act on.
    pub explanation: String,
}

impl From<&Alert> for rankwatch_api::Alert {
    /// The alert as the API shows it: a non-finite value or threshold is null there.
    fn from(a: &Alert) -> Self {
        rankwatch_api::Alert {
            id: a.id.clone(),
            run: a.run.to_string(),
            rule: a.rule,
            severity: a.severity,
            state: a.state,
            layer: a.layer,
            site: a.site.map(|s| s.as_str().to_owned()),
            rank: a.rank,
            outlier_ranks: a.outlier_ranks.clone(),
            value: a.value.is_finite().then_some(a.value),
            threshold: a.threshold.is_finite().then_some(a.threshold),
            first_step: a.first_step,
            last_step: a.last_step,
            started_at_ms: a.started_at_ms,
            updated_at_ms: a.updated_at_ms,
            fired_at_ms: a.fired_at_ms,
            resolved_at_ms: a.resolved_at_ms,
            explanation: a.explanation.clone(),
        }
    }
}

impl Alert {
    /// The key that deduplicates this alert.
    pub fn key(&self) -> AlertKey {
        AlertKey {
            run: self.run.clone(),
            rule: self.rule,
            layer: self.layer,
            site: self.site,
            rank: self.rank,
        }
    }

    /// The stable id for the alert on `key` that started at `first_step`.
    pub fn id_for(key: &AlertKey, first_step: u64) -> String {
        fn opt<T: fmt::Display>(v: Option<T>) -> String {
            v.map_or_else(|| "-".to_owned(), |v| v.to_string())
        }
        format!(
            "{}:{}:{}:{}:{}:{}",
            key.run,
            key.rule,
            opt(key.layer),
            opt(key.site),
            opt(key.rank),
            first_step
        )
    }

    /// Ends the alert at `now_ms`; `why`, when given, is appended to its explanation (an end
    /// no detector decided: the run went quiet, was deleted).
    pub fn resolve(&mut self, now_ms: i64, why: Option<&str>) {
        self.state = AlertState::Resolved;
        self.resolved_at_ms = Some(now_ms);
        self.updated_at_ms = now_ms;
        if let Some(why) = why {
            self.explanation = format!("{} (resolved: {why})", self.explanation);
        }
    }

    /// Whether the alert ever reached `firing` (pending alerts that cleared did not).
    pub fn has_fired(&self) -> bool {
        self.fired_at_ms.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enums_round_trip_and_order() {
        for r in Rule::ALL {
            assert_eq!(r.as_str().parse::<Rule>().unwrap(), *r);
        }
        assert!(Severity::Critical > Severity::Warning && Severity::Warning > Severity::Info);
        let err = "boom".parse::<AlertState>().unwrap_err().to_string();
        assert!(err.contains("pending, firing, resolved"), "{err}");
    }

    #[test]
    fn ids_are_stable_and_distinct_per_key() {
        let key = AlertKey {
            run: RunId::new("r1").unwrap(),
            rule: Rule::RankCollapse,
            layer: Some(17),
            site: None,
            rank: None,
        };
        assert_eq!(Alert::id_for(&key, 40), "r1:rank_collapse:17:-:-:40");
        let other = AlertKey {
            layer: Some(18),
            ..key.clone()
        };
        assert_ne!(Alert::id_for(&key, 40), Alert::id_for(&other, 40));
    }
}
