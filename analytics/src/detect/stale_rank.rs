//! `stale_rank`: a rank that stopped reporting while the others go on — a hung worker, a dead
//! agent, or a rank that will stall the next all-reduce. Checked on a timer by the collector
//! with each rank's last report. A rank is stale when it has been silent for `timeout_ms` while
//! another rank reported within it, or when it trails the leading rank by more than
//! `max_step_lag` steps. When every rank is silent the run has ended or stalled as a whole;
//! that is not one stale rank, so nothing changes (open alerts hold).
//!
//! When the run comes back from such a silence (a restart from a checkpoint), each rank's
//! silence is counted from the moment the first rank reported again, not from its own last
//! report before the gap: otherwise every rank slower than the first to report after a
//! restart is "silent" for the whole restart. Measured on the detection benchmark: a resume
//! whose new processes took 90 s to start raised `stale_rank` on the three ranks whose first
//! report came a moment after rank 1's. A rank never heard from (in a run the collector
//! watches afresh after a restart) is judged by its silence only, never by a step lag.

use serde::{Deserialize, Serialize};

use super::Detector;
use super::lifecycle::{Breach, LifecycleConfig, Signal, Trackers};
use crate::alert::{Alert, Rule, Severity};
use crate::error::{Error, Result};
use crate::validate::RunId;

/// Thresholds of `stale_rank`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StaleRankConfig {
    /// Silence that makes a rank stale, in milliseconds. Default 60 000.
    pub timeout_ms: i64,
    /// Steps behind the leading rank that make it stale; `None` disables. Default 200.
    pub max_step_lag: Option<u64>,
    /// Default: fire and resolve at once (the timeout is the persistence).
    pub lifecycle: LifecycleConfig,
}

impl Default for StaleRankConfig {
    fn default() -> Self {
        StaleRankConfig {
            timeout_ms: 60_000,
            max_step_lag: Some(200),
            lifecycle: LifecycleConfig {
                pending_for: 1,
                resolve_after: 1,
            },
        }
    }
}

impl StaleRankConfig {
    /// Checks the timeout is positive.
    pub fn validate(&self) -> Result<()> {
        if self.timeout_ms <= 0 {
            return Err(Error::Config(format!(
                "stale_rank: timeout_ms must be positive, got {}",
                self.timeout_ms
            )));
        }
        self.lifecycle.validate("stale_rank")
    }
}

/// Last report of each rank, as seen at `now_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RankActivity {
    pub now_ms: i64,
    /// When the run first reported; ranks never seen are measured from here.
    pub run_started_ms: i64,
    /// Index = rank; `(last step, time of last report)`, or `None` if never seen.
    pub last_seen: Vec<Option<(u64, i64)>>,
}

/// The `stale_rank` detector for one run.
#[derive(Debug, Clone)]
pub struct StaleRank {
    config: StaleRankConfig,
    trackers: Trackers<u32>,
    /// Set when an observation found every rank silent: reports at or after this time came
    /// after that silence.
    quiet_before_ms: Option<i64>,
    /// When the run last came back from a silence of every rank.
    resumed_ms: Option<i64>,
}

impl StaleRank {
    /// A detector for `run`.
    pub fn new(run: RunId, config: StaleRankConfig) -> Result<Self> {
        config.validate()?;
        Ok(StaleRank {
            config,
            trackers: Trackers::new(run, Rule::StaleRank, |rank| (None, None, Some(*rank))),
            quiet_before_ms: None,
            resumed_ms: None,
        })
    }
}

fn seconds(ms: i64) -> String {
    format!("{:.0} s", ms as f64 / 1000.0)
}

impl Detector for StaleRank {
    type Observation = RankActivity;

    fn observe(&mut self, obs: &RankActivity) -> Vec<Alert> {
        let c = self.config;
        let seen = || obs.last_seen.iter().flatten();
        let freshest = seen().map(|&(_, t)| t).max();
        let lead = seen().map(|&(s, _)| s).max().unwrap_or(0);
        let active = freshest.is_some_and(|t| obs.now_ms.saturating_sub(t) <= c.timeout_ms);
        if !active {
            // A run no rank has reported in yet has not gone quiet: it has not started, and a
            // rank that never reports is measured from the run's start (taking the first
            // report as a resume measured its silence from then: a rank silent since the
            // start went unflagged when the first check came after other ranks' reports).
            if freshest.is_some() {
                self.quiet_before_ms = Some(obs.now_ms.saturating_sub(c.timeout_ms));
            }
        } else if let Some(quiet_before) = self.quiet_before_ms.take() {
            // The first report after the silence, not the freshest: checks may be seconds
            // apart, and the run came back when its first rank did.
            self.resumed_ms = seen().map(|&(_, t)| t).filter(|&t| t >= quiet_before).min();
        }
        let mut changed = Vec::new();
        for (rank, last) in obs.last_seen.iter().enumerate() {
            let rank = rank as u32;
            let since = last
                .map_or(obs.run_started_ms, |(_, t)| t)
                .max(self.resumed_ms.unwrap_or(i64::MIN));
            let silent = obs.now_ms.saturating_sub(since);
            // A rank not heard from has no step to lag by: it is judged by its silence alone.
            // Counting it at step 0 made every rank slower to report than the first, after a
            // resume at step 1,200, "1,219 steps behind" within seconds of the restart.
            let lag = last.map_or(0, |(s, _)| lead.saturating_sub(s));
            let breach = |value: f64, threshold: f64, explanation: String| {
                Signal::Breach(Breach {
                    severity: Severity::Warning,
                    value,
                    threshold,
                    explanation,
                    outlier_ranks: vec![rank],
                })
            };
            let signal = if !active {
                Signal::Hold
            } else if silent > c.timeout_ms {
                let detail = match last {
                    Some((step, _)) => format!("last step {step}, others at {lead}"),
                    None => "never reported".to_owned(),
                };
                breach(
                    silent as f64,
                    c.timeout_ms as f64,
                    format!("rank {rank} silent for {} ({detail})", seconds(silent)),
                )
            } else if let Some(max_lag) = c.max_step_lag.filter(|m| lag > *m) {
                breach(
                    lag as f64,
                    max_lag as f64,
                    format!("rank {rank} is {lag} steps behind the leading rank (step {lead})"),
                )
            } else {
                Signal::Clear
            };
            let step = last.map_or(0, |(s, _)| s);
            changed.extend(
                self.trackers
                    .observe(&rank, step, obs.now_ms, signal, &c.lifecycle),
            );
        }
        changed
    }

    fn open_alerts(&self) -> Vec<Alert> {
        self.trackers.open()
    }
}
