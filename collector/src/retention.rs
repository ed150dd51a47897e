//! Housekeeping: deleting runs, by hand or by a retention policy.
//!
//! A deletion goes through [`Housekeeper::delete_run`], which first has the alert engine
//! forget the run (so no late alert of it is raised after its data is gone, and receivers hear
//! its firing alerts are over), then has the store delete it (see [`Store::delete_run`]).
//!
//! Retention is a pure plan over each run's footprint ([`plan`]), then those deletions:
//! - by age: every run that last reported longer ago than `max_age`;
//! - by size: while the Parquet total is over `max_bytes`, the least recently seen run goes.
//!
//! A run that reported within `protect` (the active window) is never deleted by retention,
//! whatever the policy says: a cap that only active runs exceed is reported, not enforced by
//! destroying a live run, and a `max_age` shorter than the window (`"1ms"` in a request) does
//! not reach a run still training. Deleting a live run is `DELETE /api/v1/runs/{run}`, by name.

use std::sync::Arc;
use std::time::Duration;

use rankwatch_analytics::RunId;

use crate::alerting::EngineHandle;
use crate::error::Result;
use crate::store::{Deleted, RunUsage, Store};

/// What retention keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Policy {
    /// Runs silent longer than this are deleted.
    pub max_age: Option<Duration>,
    /// The Parquet total is kept under this many bytes, oldest runs first.
    pub max_bytes: Option<u64>,
    /// Runs seen this recently are never deleted for size.
    pub protect: Duration,
}

impl Policy {
    /// Whether the policy deletes anything at all.
    pub fn is_set(&self) -> bool {
        self.max_age.is_some() || self.max_bytes.is_some()
    }
}

/// Why a run is to be deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Age,
    Size,
}

/// One planned deletion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Doomed {
    pub run: RunId,
    pub reason: Reason,
    pub bytes: u64,
    pub last_seen_ms: i64,
}

/// The runs `policy` deletes, in the order it deletes them, and the bytes left after.
pub fn plan(usage: &[RunUsage], now_ms: i64, policy: &Policy) -> (Vec<Doomed>, u64) {
    let mut runs: Vec<&RunUsage> = usage.iter().collect();
    // Oldest first; the run id breaks ties so the plan is deterministic.
    runs.sort_by(|a, b| a.last_seen_ms.cmp(&b.last_seen_ms).then(a.run.cmp(&b.run)));
    let mut total: u64 = usage.iter().map(|u| u.bytes).sum();
    let mut doomed = Vec::new();
    let age_ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    for u in runs {
        let silent_ms = now_ms.saturating_sub(u.last_seen_ms);
        let reason = if silent_ms <= age_ms(policy.protect) {
            None // active: never retention's to delete
        } else if policy.max_age.is_some_and(|a| silent_ms > age_ms(a)) {
            Some(Reason::Age)
        } else if policy.max_bytes.is_some_and(|cap| total > cap) {
            Some(Reason::Size)
        } else {
            None
        };
        if let Some(reason) = reason {
            total -= u.bytes;
            doomed.push(Doomed {
                run: u.run.clone(),
                reason,
                bytes: u.bytes,
                last_seen_ms: u.last_seen_ms,
            });
        }
    }
    (doomed, total)
}

/// What a retention pass did (or, dry, would do).
#[derive(Debug, Clone)]
pub struct Report {
    pub dry_run: bool,
    pub deleted: Vec<Doomed>,
    /// Parquet bytes left after the pass.
    pub bytes_left: u64,
    /// Set when the size cap is still exceeded (only protected, recently active runs remain).
    pub over_cap: Option<String>,
}

impl From<Report> for rankwatch_api::RetentionReport {
    fn from(r: Report) -> Self {
        rankwatch_api::RetentionReport {
            dry_run: r.dry_run,
            deleted: r
                .deleted
                .into_iter()
                .map(|d| rankwatch_api::Doomed {
                    run: d.run.to_string(),
                    reason: match d.reason {
                        Reason::Age => rankwatch_api::RetentionReason::Age,
                        Reason::Size => rankwatch_api::RetentionReason::Size,
                    },
                    bytes: d.bytes,
                    last_seen_ms: d.last_seen_ms,
                })
                .collect(),
            bytes_left: r.bytes_left,
            over_cap: r.over_cap,
        }
    }
}

/// Deletes runs: the store and the alert engine together.
#[derive(Debug, Clone)]
pub struct Housekeeper {
    store: Arc<Store>,
    engine: Option<EngineHandle>,
}

impl Housekeeper {
    pub fn new(store: Arc<Store>, engine: Option<EngineHandle>) -> Self {
        Housekeeper { store, engine }
    }

    /// Deletes one run.
    pub async fn delete_run(&self, run: &RunId) -> Result<Deleted> {
        if let Some(engine) = &self.engine {
            engine.forget(run.clone()).await;
        }
        self.store.delete_run(run).await
    }

    /// Applies `policy` now (or only plans it, when `dry_run`).
    pub async fn retain(&self, policy: &Policy, dry_run: bool) -> Result<Report> {
        let (planned, bytes_left) = plan(&self.store.usage(), self.store.now_ms(), policy);
        let over_cap = policy.max_bytes.filter(|cap| bytes_left > *cap).map(|cap| {
            format!(
                "{bytes_left} bytes remain over the cap of {cap}: the rest were active within the last {} s",
                policy.protect.as_secs()
            )
        });
        let mut deleted = Vec::new();
        for doomed in planned {
            if !dry_run {
                match self.delete_run(&doomed.run).await {
                    Ok(_) => {}
                    // Deleted meanwhile by someone else: what retention wanted anyway.
                    Err(crate::error::Error::UnknownRun(_)) => continue,
                    Err(e) => return Err(e),
                }
            }
            deleted.push(doomed);
        }
        Ok(Report {
            dry_run,
            deleted,
            bytes_left,
            over_cap,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const DAY: i64 = 86_400_000;

    fn usage(runs: &[(&str, u64, i64)]) -> Vec<RunUsage> {
        runs.iter()
            .map(|(r, b, t)| RunUsage {
                run: RunId::new(*r).unwrap(),
                bytes: *b,
                last_seen_ms: *t,
            })
            .collect()
    }

    #[test]
    fn age_deletes_exactly_the_runs_silent_longer_than_the_limit() {
        let now = 100 * DAY;
        let u = usage(&[
            ("old", 10, now - 31 * DAY),
            ("edge", 10, now - 30 * DAY),
            ("new", 10, now - DAY),
        ]);
        let policy = Policy {
            max_age: Some(Duration::from_secs(30 * 86_400)),
            ..Policy::default()
        };
        let (doomed, left) = plan(&u, now, &policy);
        assert_eq!(
            doomed.iter().map(|d| d.run.as_str()).collect::<Vec<_>>(),
            ["old"]
        );
        assert_eq!(doomed[0].reason, Reason::Age);
        assert_eq!(left, 20);
    }

    #[test]
    fn size_deletes_oldest_first_until_under_the_cap_and_spares_active_runs() {
        let now = 10 * DAY;
        let u = usage(&[
            ("a", 40, now - 5 * DAY),
            ("b", 40, now - 4 * DAY),
            ("c", 40, now - 3 * DAY),
            ("live", 40, now - 1000),
        ]);
        let policy = Policy {
            max_bytes: Some(90),
            protect: Duration::from_secs(900),
            ..Policy::default()
        };
        let (doomed, left) = plan(&u, now, &policy);
        assert_eq!(
            doomed.iter().map(|d| d.run.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(left, 80);
        // A cap only the live run exceeds deletes every other run, never the live one.
        let (doomed, left) = plan(
            &u,
            now,
            &Policy {
                max_bytes: Some(10),
                ..policy
            },
        );
        assert_eq!(doomed.len(), 3);
        assert_eq!(left, 40);
    }

    proptest! {
        /// Whatever the runs: nothing active is deleted, every inactive run over the age is
        /// deleted, the plan's byte count is exact, and a cap is met unless only protected
        /// runs remain.
        #[test]
        fn plans_keep_their_promises(
            runs in prop::collection::vec((0u64..1_000, 0i64..(60 * DAY)), 0..30),
            age_hours in prop::option::of(0u64..(60 * 24)),
            cap in prop::option::of(0u64..20_000),
        ) {
            let now = 60 * DAY;
            let u: Vec<RunUsage> = runs.iter().enumerate().map(|(i, (b, t))| RunUsage {
                run: RunId::new(format!("r{i}")).unwrap(), bytes: *b, last_seen_ms: *t,
            }).collect();
            let policy = Policy {
                max_age: age_hours.map(|h| Duration::from_secs(h * 3_600)),
                max_bytes: cap,
                protect: Duration::from_secs(86_400),
            };
            let (doomed, left) = plan(&u, now, &policy);
            let total: u64 = u.iter().map(|r| r.bytes).sum();
            prop_assert_eq!(left, total - doomed.iter().map(|d| d.bytes).sum::<u64>());
            for r in &u {
                let silent = now - r.last_seen_ms;
                let gone = doomed.iter().find(|d| d.run == r.run);
                if let Some(hours) = age_hours && silent > (hours * 3_600_000) as i64 && silent > DAY {
                    prop_assert!(gone.is_some_and(|d| d.reason == Reason::Age));
                }
                if gone.is_some() {
                    prop_assert!(silent > DAY, "an active run was deleted");
                }
            }
            if let Some(cap) = cap && left > cap {
                // Only protected (recently active) runs are left.
                prop_assert!(u.iter().filter(|r| !doomed.iter().any(|d| d.run == r.run))
                    .all(|r| now - r.last_seen_ms <= DAY));
            }
        }
    }
}
