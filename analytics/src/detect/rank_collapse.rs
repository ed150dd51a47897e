//! `rank_collapse`: a layer's MLP/attention spectral ratio drifting far from where it settled,
//! or its token states converging onto one direction.
//!
//! The ratio σ_mlp/σ_attn is an early, indirect signal (the public "1:1 rule"); token cosine,
//! the mean pairwise cosine of token states, is the direct one (Noci et al. 2022).
//!
//! Measured on real training (docs/detection.md), the published 0.5–2 band is not a healthy
//! range in general: every model starts near 0.3 (initialisation, not learning), and healthy
//! small GPTs settle anywhere between 1 and 25, drifting several-fold over a run (a healthy
//! 4-layer GPT's layer 3 went from 1.2 at step 90 to 29 at step 990). So by default the ratio
//! is judged against the layer's *own recent* level: the median of its probes over the last
//! `ratio_window_steps` (200) steps after the early phase (or its last 2·`pending_for` + 1 = 7
//! probes, where a coarse cadence leaves fewer in the window, so a lasting shift stays out of
//! the median long enough to fire). It breaches when it is `drift_factor` away from that
//! median (either way), or when a least-squares fit of log(ratio) against the step over the
//! same window has a slope with t-statistic ≥ `trend_min_t` that projects it out within
//! `trend_horizon_steps`. Windows and horizons are in steps, not probes, so a finer cadence
//! does not make the rule touchier. Because the median takes in a new level, the test judges
//! how fast the ratio moves, not how far it is from where it started: a shift that lasts
//! resolves once the window holds it (token cosine holds the alert where the tokens really
//! collapsed). (The first version learned the baseline once from the first 5
//! probes after step 50 and counted the trend in probes: at a probe every 10 steps that
//! baseline came from steps 50–90 and two healthy runs drifted ×4–24 past it. Against a
//! trailing median, natural collapses moved the ratio ×7.5–78 within 100 steps, while healthy
//! layers stayed within ×3.4 of it over 3 probes in a row.) An absolute band (`band_low`, `band_high`)
//! can be added for models where it has been calibrated; it is off by default.
//!
//! Token cosine is judged against the layer's own history. After the early phase (below) it
//! breaches when it is at or above `token_cosine_warning` (a warning) or `token_cosine_critical`
//! (critical) *and* the spread 1 − cosine has shrunk by `token_cosine_contraction` from its
//! widest since the early phase ended. Both conditions, because on real text a healthy layer
//! passes through high cosine early (a byte-level GPT on the standard library's docstrings:
//! 0.92 at step 25, 0.91 at step 75, falling to 0.2 by step 1,000, as it first learns byte
//! frequencies, then context) and a pretrained model's uncentred cosine sits high for good
//! (anisotropy); what collapse adds is the token states *converging further* than the layer
//! has been.
//!
//! **The early phase.** Post-LN GPTs pass through a real, transient collapse early: token
//! cosine 0.95–0.999 in most layers from step ~40 to 125–250, the loss flat at the unigram
//! level, then training escapes it (docs/detection.md § 2d: every one of 13 healthy post-LN
//! runs, the longest 235 steps). Judged against a layer's own recent past, that plateau and
//! what moves with it (the ratios of the layers outside it trend 8 % every 10 steps) fired
//! critical alerts on all of them. So a layer *enters its plateau* when its token cosine
//! reaches `token_cosine_critical` with its spread `token_cosine_early_contraction` (25) times
//! narrower than its widest since the first probe, and stays in it until token cosine falls
//! below `token_cosine_plateau_exit` (0.8; a dip under 0.9 is not a way out). The run's early
//! phase lasts until `warmup_steps` have passed, the learning rate is off its first rise (the
//! schedule's warm-up, from `learning_rate`, which the agent reads from the optimizer it
//! watches; runs that send none skip this: a post-LN 7 × 40 with a 300-step warm-up was still
//! rising into its plateau at step 75, when every test of the token states alone had let the
//! phase end, set 4 of docs/detection.md; a later rise, an LR ramp, does not count) and no
//! layer is in its plateau: it ends at a
//! step every layer still probed has reported (a step's layers arrive one by one), or when a
//! later step's token cosine arrives with none back in; only token cosine moves it (another
//! rank's ratios may arrive ahead of the rank that measures it), a layer *climbing* toward a
//! plateau holds the run early like one (its spread narrowed `token_cosine_climb` (2) times
//! within the last `token_cosine_climb_steps` (25), or since its previous probe when probes
//! are further apart: a post-LN GPT with a 200-step warm-up was
//! still at 0.3–0.8 at step 50, the first probe after the warm-up, and entered its plateau at
//! step 75, set 3 of docs/detection.md), a layer whose token cosine
//! stopped coming 300 steps ago no longer holds it, and without any token cosine it ends at
//! twice the warm-up or with the learning rate's rise, the later. It ends once; the ratio's window and the spreads a contraction is
//! measured from start there. Inside it only one test judges: a layer still in its plateau
//! `token_cosine_early_persist_steps` (300) after entering it has stayed longer than any
//! healthy one and is critical (the same test holds after the phase, for a layer that
//! collapses later and stays; the tests below fire on that first). A model that
//! never leaves its collapse (an 8-layer post-LN GPT without warm-up, at 0.9 from step 10) is
//! therefore named at step ~310, not ~70: until then it cannot be told from a healthy plateau
//! by these signals. (The first versions fired on a 25-fold contraction held 50 steps, and
//! judged from step 50 whatever the layers were doing.) A model without a plateau (pre-LN
//! GPTs, whose token cosine is out of it within 10–30 steps; pretrained models, whose first
//! probe is already high) ends its early phase at the warm-up. The price of the climb: a layer
//! that climbs during the early phase and settles just under a plateau's entry (0.93, say)
//! is judged after it against the spread it settled at, so it is not named. The price of the
//! learning rate: while it rises only the plateau's 300 steps judge, so a collapse inside a
//! long warm-up that is not a plateau waits for the warm-up's end, and a schedule that rises
//! for long (one-cycle: 30 % of the run) keeps early training that long; a rise raised in
//! stages more than `learning_rate_settle_steps` apart ends at its first stage. Without token cosine no layer
//! can be in a plateau, and the phase ends at the warm-up. An alert clears only when the ratio
//! is back inside its bounds shrunk by `exit_margin` and token cosine is below
//! `token_cosine_exit`, or out of its plateau with its contraction back below its level
//! narrowed by `exit_margin` (hysteresis).
//!
//! **One verdict per step.** A layer's ratio and token cosine of one step come in different
//! reports (the spectral probe reads back on its own), so the rule may see the step as two
//! observations in either order. Each test (ratio, token cosine, effective rank) speaks only
//! when its own value arrives and keeps whether it was calm then; a layer clears only when all
//! three are; a verdict counts once per step and a clear only once a later step arrives
//! ([`AlertTracker::observe_once_per_step`](super::AlertTracker::observe_once_per_step)); and
//! ratios that come while the early phase's end is undecided join the window when it ends.
//! So the same probes raise the same alerts however they were batched (docs/detection.md § 2e;
//! a ratio arriving after a later step's token cosine is the exception left).
//!
//! The block's effective rank — the participation ratio of its linearised map
//! (I + W_down·W_up)(I + W_o·W_v), measured from the weights by the spectral probe — can be
//! judged against its own recent past, opt-in (`effective_rank_drop`, off by default): a
//! warning when it falls that many times below its median over the last
//! `effective_rank_window` (100) steps, from step `effective_rank_skip_steps` (200) on, after
//! the early phase. Why
//! opt-in, from docs/detection.md § 2c: on post-LN models it led every natural collapse
//! (halved 10–50 steps before token cosine or the ratio breached, down to 2–4 % of its
//! trailing median, while healthy twins never went below 52 %), but a healthy pre-LN model
//! (4 layers × 128, lr 3e-3) drove it from 127 to ~1.3 in its deeper blocks while its loss
//! fell steadily: the linearisation leaves out the layer norm that, in a pre-LN block, shrinks
//! the branches as the residual stream grows, so a small value there says nothing about the
//! tokens. The window is in steps, not probes, so the test means the same at any cadence; it
//! absorbs a new level within about half a window, so the alert cannot latch. It clears once
//! the fall is back under `effective_rank_drop` narrowed by `exit_margin`.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::baseline::TrailingMedian;
use super::lifecycle::{Breach, LifecycleConfig, Signal, Trackers};
use super::warmup::FirstRise;
use super::{Detector, short};
use crate::alert::{Alert, Rule, Severity};
use crate::error::{Error, Result};
use crate::validate::RunId;

/// Thresholds of `rank_collapse`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RankCollapseConfig {
    /// Steps at the start of training that are always early (the initialisation transient):
    /// the early phase lasts at least this long, longer while a layer is in its plateau or
    /// climbing toward one. Default 50.
    pub warmup_steps: u64,
    /// Steps of history (after the early phase) whose median ratio the current one is judged
    /// against, and over which its trend is fitted; at least the last 2·`pending_for` + 1
    /// probes (7). Default 200.
    pub ratio_window_steps: u64,
    /// How far (as a factor, either way) the ratio may move from that median. Default 4.
    pub drift_factor: f64,
    /// Optional absolute lower edge of the healthy ratio band (the "1:1 rule" says 0.5). Off.
    pub band_low: Option<f64>,
    /// Optional absolute upper edge of the healthy ratio band (the "1:1 rule" says 2). Off.
    pub band_high: Option<f64>,
    /// To clear, the ratio must be inside its bounds shrunk by the factor 1+m. Default 0.05.
    pub exit_margin: f64,
    /// How far ahead, in steps, the fitted trend may project out of the bounds (0 disables
    /// the trend test). Default 50 (100 until the trend was heard at every ratio probe, when
    /// healthy post-LN twins trending 10 % per 10 steps fired: docs/detection.md § 2e).
    pub trend_horizon_steps: f64,
    /// Minimum |t| of the fitted slope for a trend to count. Default 4.
    pub trend_min_t: f64,
    /// Token cosine at or above this (after the early phase, and contracted) is a warning.
    /// Default 0.5.
    pub token_cosine_warning: f64,
    /// Token cosine at or above this (contracted) is critical. Default 0.9.
    pub token_cosine_critical: f64,
    /// How many times the spread 1 − token cosine must have shrunk from its widest since the
    /// early phase ended for a level to count. Default 2.
    pub token_cosine_contraction: f64,
    /// The contraction from the widest spread since the first probe at which token cosine at
    /// or above `token_cosine_critical` enters a layer's plateau. Default 25.
    pub token_cosine_early_contraction: f64,
    /// Steps a layer must have stayed in its early plateau (entered at the early contraction
    /// and `token_cosine_critical`, left below `token_cosine_plateau_exit`) before it is
    /// critical. Default 300: healthy post-LN GPTs stayed up to 235 steps (module docs).
    pub token_cosine_early_persist_steps: u64,
    /// A layer in its early plateau leaves it when its token cosine falls below this.
    /// Default 0.8.
    pub token_cosine_plateau_exit: f64,
    /// A layer whose spread 1 − token cosine narrowed this many times within the last
    /// `token_cosine_climb_steps` (or since its previous probe, when that is older) is climbing
    /// toward a plateau, and keeps the run early like one while its latest probe is that
    /// recent (0 turns it off). Default 2.
    pub token_cosine_climb: f64,
    /// The steps over which a climb is measured. Default 25.
    pub token_cosine_climb_steps: u64,
    /// Whether the early phase also lasts while the learning rate (`learning_rate`, which the
    /// agent reads from the optimizer it watches) is on its first rise: the schedule's
    /// warm-up. Runs that report none are judged as before. Default true.
    pub learning_rate_warmup: bool,
    /// Steps the learning rate may hold its highest value before its rise counts as over (a
    /// schedule flat from its first step has none to wait for). Default 20.
    pub learning_rate_settle_steps: u64,
    /// Token cosine must fall below this to clear. Default 0.4.
    pub token_cosine_exit: f64,
    /// How many times the effective rank must fall below its trailing median for a warning;
    /// 0 (the default) turns the test off. 4 separated collapse from health on post-LN
    /// models; pre-LN models drive the value down while healthy (see the module docs).
    pub effective_rank_drop: f64,
    /// Steps of history whose median the effective rank is compared with. Default 100.
    pub effective_rank_window: u64,
    /// Steps at the start of training whose effective rank is not judged. Default 200.
    pub effective_rank_skip_steps: u64,
    /// Default: fire after 3 breaching observations, resolve after 3 clear ones.
    pub lifecycle: LifecycleConfig,
}

impl Default for RankCollapseConfig {
    fn default() -> Self {
        RankCollapseConfig {
            warmup_steps: 50,
            ratio_window_steps: 200,
            drift_factor: 4.0,
            band_low: None,
            band_high: None,
            exit_margin: 0.05,
            trend_horizon_steps: 50.0,
            trend_min_t: 4.0,
            token_cosine_warning: 0.5,
            token_cosine_critical: 0.9,
            token_cosine_contraction: 2.0,
            token_cosine_early_contraction: 25.0,
            token_cosine_early_persist_steps: 300,
            token_cosine_plateau_exit: 0.8,
            token_cosine_climb: 2.0,
            token_cosine_climb_steps: 25,
            learning_rate_warmup: true,
            learning_rate_settle_steps: 20,
            token_cosine_exit: 0.4,
            effective_rank_drop: 0.0,
            effective_rank_window: 100,
            effective_rank_skip_steps: 200,
            lifecycle: LifecycleConfig {
                pending_for: 3,
                resolve_after: 3,
            },
        }
    }
}

impl RankCollapseConfig {
    /// Checks the band and thresholds are coherent.
    pub fn validate(&self) -> Result<()> {
        let margin = 1.0 + self.exit_margin;
        let band_ok = match (self.band_low, self.band_high) {
            (None, None) => true,
            (Some(low), Some(high)) => low > 0.0 && low * margin < high / margin,
            _ => false,
        };
        let ok = band_ok
            && self.exit_margin >= 0.0
            && self.ratio_window_steps >= 1
            && self.drift_factor > margin * margin
            && self.trend_horizon_steps >= 0.0
            && self.trend_min_t > 0.0
            && self.token_cosine_contraction >= 1.0
            && self.token_cosine_early_contraction >= 1.0
            && self.token_cosine_exit <= self.token_cosine_warning
            && self.token_cosine_warning <= self.token_cosine_critical
            && self.token_cosine_plateau_exit <= self.token_cosine_critical
            && (self.token_cosine_climb == 0.0
                || (self.token_cosine_climb > 1.0 && self.token_cosine_climb_steps >= 1))
            && self.token_cosine_climb_steps <= 10_000
            && (self.effective_rank_drop == 0.0 || self.effective_rank_drop > margin)
            && self.effective_rank_window >= 1;
        if !ok {
            return Err(Error::Config(format!(
                "rank_collapse: need band_low and band_high both set (0 < band_low < band_high, \
                 with room for exit_margin) or both unset, ratio_window_steps ≥ 1, \
                 drift_factor > (1 + exit_margin)², trend_horizon_steps ≥ 0, trend_min_t > 0, \
                 token_cosine_contraction ≥ 1, token_cosine_early_contraction ≥ 1, token_cosine_exit ≤ token_cosine_warning ≤ token_cosine_critical, \
                 token_cosine_plateau_exit ≤ token_cosine_critical, token_cosine_climb 0 or > 1 with \
                 token_cosine_climb_steps 1–10000, \
                 effective_rank_drop 0 or > 1 + exit_margin and effective_rank_window ≥ 1; got {self:?}"
            )));
        }
        self.lifecycle.validate("rank_collapse")
    }
}

/// What one probe of one layer measured; either value may be absent (different cadences).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CollapseObservation {
    pub step: u64,
    pub time_ms: i64,
    pub layer: u32,
    pub ratio: Option<f64>,
    pub token_cosine: Option<f64>,
    /// The block's data-free effective rank (`effective_rank`).
    #[serde(default)]
    pub effective_rank: Option<f64>,
}

/// The three tests of a layer, each speaking only when its own value arrives.
const RATIO: usize = 0;
const TOKEN_COSINE: usize = 1;
const EFFECTIVE_RANK: usize = 2;

/// Which values arrived with the current observation.
#[derive(Debug, Clone, Copy)]
struct Fresh {
    ratio: bool,
    token_cosine: bool,
    effective_rank: bool,
}

#[derive(Debug, Clone)]
struct LayerState {
    /// log(ratio) over the trailing window after the early phase.
    log_ratios: TrailingMedian,
    /// The median ratio of the window before the latest probe.
    ratio_reference: Option<f64>,
    ratio: Option<f64>,
    token_cosine: Option<f64>,
    /// The step of the latest token-cosine probe (one rank measures it: steps go back only
    /// on a resume).
    token_cosine_step: Option<u64>,
    previous_token_cosine: Option<f64>,
    /// The widest spread 1 − token cosine seen since the early phase ended.
    widest_spread: Option<f64>,
    /// The widest spread seen since the first probe.
    widest_spread_early: Option<f64>,
    /// The step this layer entered its plateau (token cosine at the critical level, its
    /// spread the early contraction narrower than at the first probe), until it falls below
    /// `token_cosine_plateau_exit`.
    plateau_since: Option<u64>,
    /// Token-cosine probes (step, spread) of the last `token_cosine_climb_steps`.
    recent_spreads: VecDeque<(u64, f64)>,
    /// Whether the spread narrowed `token_cosine_climb` times within them, at the latest probe.
    climbing: bool,
    /// The effective ranks within the trailing window.
    effective_ranks: TrailingMedian,
    effective_rank: Option<f64>,
    /// The median of the window before the latest effective rank (two values at least).
    effective_rank_reference: Option<f64>,
    /// Ratios probed while the early phase was undecided (step, ratio), the latest
    /// `UNDECIDED_KEPT`: those from the step it ends at on join the window then.
    undecided_ratios: VecDeque<(u64, f64)>,
    /// Whether each test (`RATIO`, `TOKEN_COSINE`, `EFFECTIVE_RANK`) was calm at its latest
    /// value: a layer clears only when all three are. A step's ratio and token cosine come in
    /// different reports, so one observation must not clear what the other's test found
    /// (a token cosine arriving after a ratio's trend breach of the same step cleared it, or
    /// not, as the rows happened to be batched).
    calm: [bool; 3],
}

impl Default for LayerState {
    fn default() -> Self {
        LayerState {
            log_ratios: TrailingMedian::default(),
            ratio_reference: None,
            ratio: None,
            token_cosine: None,
            token_cosine_step: None,
            previous_token_cosine: None,
            widest_spread: None,
            widest_spread_early: None,
            plateau_since: None,
            recent_spreads: VecDeque::new(),
            climbing: false,
            effective_ranks: TrailingMedian::default(),
            effective_rank: None,
            effective_rank_reference: None,
            undecided_ratios: VecDeque::new(),
            // A test that has seen nothing has found nothing.
            calm: [true; 3],
        }
    }
}

/// The healthy range of one layer's ratio: the band, if set, within the drift bounds around
/// the baseline, if known.
#[derive(Debug, Clone, Copy)]
struct Bounds {
    low: f64,
    high: f64,
}

/// Points a trend fit needs.
const MIN_PROBES: usize = 4;

/// Ratios a layer holds while the early phase is undecided: its end is confirmed within a
/// probe or two of its step, so only the latest few can be from it on.
const UNDECIDED_KEPT: usize = 16;

impl RankCollapseConfig {
    /// Probes a trailing window keeps however old they are: enough that a lasting shift stays
    /// out of the median for `pending_for` probes, so it can fire at any cadence (with 4, a ×6
    /// step probed every 50 steps was absorbed after two breaches and never fired).
    fn window_floor(&self) -> usize {
        (2 * self.lifecycle.pending_for as usize + 1).max(MIN_PROBES)
    }
}

impl LayerState {
    /// Records a token-cosine probe at `step`: the plateau this layer is in, if any, and
    /// whether it is climbing toward one.
    fn record_token_cosine(&mut self, c: &RankCollapseConfig, step: u64, tc: f64) {
        self.previous_token_cosine = self.token_cosine;
        self.token_cosine = Some(tc);
        // Token cosine comes from one rank, in step order but for a resume.
        self.token_cosine_step = Some(step);
        let spread = 1.0 - tc;
        let widest_early = self.widest_spread_early.map_or(spread, |w| w.max(spread));
        self.widest_spread_early = Some(widest_early);
        let enters = tc >= c.token_cosine_critical
            && widest_early / spread.max(1e-12) >= c.token_cosine_early_contraction;
        // In the plateau until it falls below the exit level (a dip under the critical level
        // is not a way out); a resume that went back starts the count again.
        self.plateau_since = match self.plateau_since.filter(|&s| s <= step) {
            Some(since) if tc >= c.token_cosine_plateau_exit => Some(since),
            _ => enters.then_some(step),
        };
        let recent = &mut self.recent_spreads;
        // A resume that went back leaves nothing of what came after.
        recent.retain(|&(s, _)| s < step);
        // The probes of the window, and the latest one before it: probed more coarsely than
        // the window, a climb is measured since the previous probe.
        let window_start = step.saturating_sub(c.token_cosine_climb_steps);
        while recent.len() > 1 && recent.get(1).is_some_and(|&(s, _)| s <= window_start) {
            recent.pop_front();
        }
        let widest_recent = recent.iter().map(|&(_, w)| w).fold(spread, f64::max);
        recent.push_back((step, spread));
        self.climbing =
            c.token_cosine_climb > 0.0 && widest_recent / spread.max(1e-12) >= c.token_cosine_climb;
    }

    /// Whether this layer's token cosine was probed within `steps` before `at`.
    fn probed_since(&self, at: u64, steps: u64) -> bool {
        self.token_cosine_step.is_some_and(|s| s + steps >= at)
    }

    fn bounds(&self, c: &RankCollapseConfig) -> Option<Bounds> {
        let band = c.band_low.zip(c.band_high);
        let drift = self
            .ratio_reference
            .map(|b| (b / c.drift_factor, b * c.drift_factor));
        match (band, drift) {
            (None, None) => None,
            (Some((l, h)), None) | (None, Some((l, h))) => Some(Bounds { low: l, high: h }),
            (Some((bl, bh)), Some((dl, dh))) => Some(Bounds {
                low: bl.max(dl),
                high: bh.min(dh),
            }),
        }
    }

    /// Says which bound `ratio` is measured against, for the explanation: the band's edge, or
    /// the drift bound around the baseline where that is the tighter one (or the only one).
    fn describe(&self, c: &RankCollapseConfig, ratio: f64, bounds: Bounds) -> String {
        let above = ratio > bounds.high;
        let side = if above { "above" } else { "below" };
        let edge = if above { bounds.high } else { bounds.low };
        let band_edge = if above { c.band_high } else { c.band_low };
        match self.ratio_reference {
            Some(baseline) if band_edge != Some(edge) => {
                let factor = if above {
                    ratio / baseline
                } else {
                    baseline / ratio
                };
                format!(
                    "{}× {side} its median {} over the last {} steps",
                    short(factor),
                    short(baseline),
                    c.ratio_window_steps
                )
            }
            _ => format!(
                "{side} band {}–{}",
                short(c.band_low.unwrap_or(0.0)),
                short(c.band_high.unwrap_or(0.0))
            ),
        }
    }
}

/// The `rank_collapse` detector for one run, all layers.
#[derive(Debug, Clone)]
pub struct RankCollapse {
    config: RankCollapseConfig,
    layers: BTreeMap<u32, LayerState>,
    /// The step the run's early phase ended: the first probe after the warm-up with no layer
    /// in its early plateau. The tests against a layer's own recent past judge from there.
    late_from: Option<u64>,
    /// A step after the warm-up at which every layer seen was out of its plateau: the end of
    /// the early phase once every layer has reported that step, or a later step arrives, with
    /// none back in meanwhile (a step's layers arrive one by one, so the first of them cannot
    /// speak for the rest).
    phase_end: Option<u64>,
    /// The learning rate's first rise (the schedule's warm-up), which holds the early phase.
    learning_rate: FirstRise,
    trackers: Trackers<u32>,
}

impl RankCollapse {
    /// A detector for `run`.
    pub fn new(run: RunId, config: RankCollapseConfig) -> Result<Self> {
        config.validate()?;
        Ok(RankCollapse {
            config,
            layers: BTreeMap::new(),
            late_from: None,
            phase_end: None,
            learning_rate: FirstRise::default(),
            // A layer's probes of one step come in different reports.
            trackers: Trackers::new(run, Rule::RankCollapse, |layer| (Some(*layer), None, None))
                .once_per_step(),
        })
    }

    /// Folds in one rank's learning rate at `step` (`learning_rate`): while it is on its first
    /// rise, the run's early phase goes on. Raises nothing by itself.
    pub fn observe_learning_rate(&mut self, step: u64, learning_rate: f64) {
        self.learning_rate
            .observe(step, learning_rate, self.config.learning_rate_settle_steps);
    }

    /// Moves the run's early phase on after an observation at `step` was recorded. Early
    /// training ends for every layer at once: while one is still in its plateau, the others'
    /// ratios and spreads move with it (healthy post-LN GPTs: ratio trends and 2× contractions
    /// in layers outside the plateau, docs/detection.md § 2d). Only token cosine speaks for the
    /// plateaus: another rank's ratios may arrive ahead of the rank that measures it.
    fn advance_phase(&mut self, step: u64, token_cosine: bool) {
        let c = &self.config;
        if self.late_from.is_some() {
            return;
        }
        // The schedule's warm-up: training is early while the learning rate still climbs.
        let warmed_up = !c.learning_rate_warmup || self.learning_rate.over_by(step);
        // A layer whose token cosine stopped coming (a probe turned off, NaN from then on)
        // cannot keep the run early for good.
        let current =
            |l: &LayerState, at: u64| l.probed_since(at, c.token_cosine_early_persist_steps);
        if !self.layers.values().any(|l| l.token_cosine_step.is_some()) {
            // No token cosine yet: past twice the warm-up (and the schedule's), there is none
            // to wait for.
            if step >= c.warmup_steps.saturating_mul(2) && warmed_up {
                self.end_early_phase(step);
            }
            return;
        }
        if self.layers.values().any(|l| {
            let climbing = l.climbing && l.probed_since(step, c.token_cosine_climb_steps);
            (l.plateau_since.is_some() || climbing) && current(l, step)
        }) {
            self.phase_end = None;
            return;
        }
        if token_cosine && step >= c.warmup_steps && warmed_up && self.phase_end.is_none() {
            // The spreads a late contraction is measured from start here (with this step's
            // probes of the layers that came before this one).
            self.phase_end = Some(step);
            for layer in self.layers.values_mut() {
                layer.widest_spread = layer
                    .token_cosine
                    .filter(|_| layer.token_cosine_step == Some(step))
                    .map(|tc| 1.0 - tc);
            }
        }
        // Every layer still probed has spoken for this step.
        if let Some(end) = self.phase_end
            && self
                .layers
                .values()
                .all(|l| l.token_cosine_step.is_none_or(|s| s == end) || !current(l, end))
        {
            self.end_early_phase(end);
        }
    }

    /// Ends the early phase at `end` (once): the ratios that came while it was undecided from
    /// `end` on join their layers' windows, in step order, as if they had come after it. (A
    /// step's ratio and token cosine come in different reports: whether the ratio that ended
    /// the phase counted in the window depended on which was batched first, and with it
    /// whether a trend had four probes to fit.)
    fn end_early_phase(&mut self, end: u64) {
        if self.late_from.is_some() {
            return;
        }
        self.late_from = Some(end);
        let c = &self.config;
        for layer in self.layers.values_mut() {
            let mut held: Vec<(u64, f64)> = layer.undecided_ratios.drain(..).collect();
            // In step order (stable: the window takes a step's last ratio in place of its
            // earlier one, as for a resent row).
            held.sort_by_key(|&(step, _)| step);
            for (step, ratio) in held.into_iter().filter(|&(step, _)| step >= end) {
                layer.ratio_reference = layer
                    .log_ratios
                    .update_keeping(step, ratio.ln(), c.ratio_window_steps, 2, c.window_floor())
                    .map(f64::exp);
            }
        }
    }
}

/// Slope per step of a least-squares line through `points` (step, value), with its
/// t-statistic and the fitted value at the last step; `None` under `MIN_PROBES` points.
/// Read straight from the window (every observation of a layer fits its whole window, so
/// copying it first showed in the collector's profile); sums run in window order.
fn fitted_trend<I>(points: I) -> Option<(f64, f64, f64)>
where
    I: ExactSizeIterator<Item = (u64, f64)> + Clone,
{
    let n = points.len() as f64;
    if points.len() < MIN_PROBES {
        return None;
    }
    let last = points.clone().last()?.0;
    // Steps before the last, so the numbers stay small.
    let xy = || {
        points
            .clone()
            .map(move |(s, y)| (s as f64 - last as f64, y))
    };
    // Sums that share a pass are still each added in window order from -0.0, as
    // `Iterator::sum` adds: the same bits as one pass per sum.
    let (x_sum, y_sum) = xy().fold((-0.0, -0.0), |(sx, sy), (x, y)| (sx + x, sy + y));
    let (x_mean, y_mean) = (x_sum / n, y_sum / n);
    let (sxx, sxy) = xy().fold((-0.0, -0.0), |(sxx, sxy), (x, y)| {
        (
            sxx + (x - x_mean).powi(2),
            sxy + (x - x_mean) * (y - y_mean),
        )
    });
    if sxx <= 0.0 {
        return None;
    }
    let slope = sxy / sxx;
    let intercept = y_mean - slope * x_mean;
    let sse: f64 = xy().map(|(x, y)| (y - intercept - slope * x).powi(2)).sum();
    let se = (sse / (n - 2.0) / sxx).sqrt();
    let t = if se > 0.0 {
        slope / se
    } else if slope == 0.0 {
        0.0
    } else {
        f64::INFINITY.copysign(slope)
    };
    // x = 0 at the last step.
    Some((slope, t, intercept))
}

impl RankCollapseConfig {
    /// Only values that arrived with this observation can breach (so one out-of-band probe is
    /// not counted again by the token-cosine observations that follow it); the latest known
    /// values decide whether the layer is clear.
    fn signal(
        &self,
        layer: u32,
        state: &LayerState,
        fresh: Fresh,
        since: u64,
        step: u64,
        late_from: Option<u64>,
    ) -> (Signal, [bool; 3]) {
        let c = self;
        let warm = late_from.is_some();
        // Explanations are built only on a breach: most observations are clear.
        let cosine_note = || match (state.token_cosine, state.previous_token_cosine) {
            (Some(tc), Some(prev)) if tc > prev + 1e-3 => {
                format!("; token cosine {} and rising", short(tc))
            }
            (Some(tc), Some(prev)) if tc < prev - 1e-3 => {
                format!("; token cosine {} and falling", short(tc))
            }
            (Some(tc), _) => format!("; token cosine {}", short(tc)),
            _ => String::new(),
        };
        let ratio_note = || {
            state
                .ratio
                .map(|r| format!("; MLP/attention spectral ratio {}", short(r)))
                .unwrap_or_default()
        };
        // How far the spread has shrunk from its widest since the early phase ended (a level
        // counts after it); before, only a plateau that outlasts healthy ones counts.
        let late = |tc: f64| {
            state
                .widest_spread
                .filter(|_| warm)
                .map_or(1.0, |w| w / (1.0 - tc).max(1e-12))
        };
        let margin = 1.0 + c.exit_margin;
        let rank_fall = match (state.effective_rank, state.effective_rank_reference) {
            (Some(er), Some(reference))
                if c.effective_rank_drop > 0.0 && warm && step >= c.effective_rank_skip_steps =>
            {
                Some((er, reference, reference / er.max(1e-12)))
            }
            _ => None,
        };
        let bounds = state.bounds(c).filter(|_| warm);
        // Each test whose value arrived says whether it is calm now; the others keep what they
        // said at their own value.
        let mut calm = state.calm;
        if fresh.ratio {
            calm[RATIO] = match (state.ratio, bounds) {
                (Some(ratio), Some(b)) => ratio >= b.low * margin && ratio <= b.high / margin,
                _ => true,
            };
        }
        if fresh.token_cosine {
            calm[TOKEN_COSINE] = state.token_cosine.is_none_or(|tc| {
                tc < c.token_cosine_exit
                    || (late(tc) * margin < c.token_cosine_contraction
                        && state.plateau_since.is_none())
            });
        }
        if fresh.effective_rank {
            calm[EFFECTIVE_RANK] =
                rank_fall.is_none_or(|(_, _, fall)| fall * margin < c.effective_rank_drop);
        }
        // Every test whose value arrived is heard (one that breaches is not calm, whatever
        // another found), and the gravest breach speaks for the step; at equal severity the
        // first in this order.
        let mut found: Vec<(usize, Breach)> = Vec::new();
        if let Some(tc) = state.token_cosine.filter(|_| fresh.token_cosine) {
            if let Some(entered) = state.plateau_since.filter(|&entered| {
                step.saturating_sub(entered) >= c.token_cosine_early_persist_steps
            }) {
                found.push((
                    TOKEN_COSINE,
                    Breach {
                        severity: Severity::Critical,
                        value: tc,
                        threshold: c.token_cosine_plateau_exit,
                        explanation: format!(
                            "layer {layer}: token cosine {}, at or above {} for {} steps since step {entered} (when it reached {} with its spread {}× narrower than at its widest before): longer than a healthy early plateau, token states are collapsed onto one direction{}",
                            short(tc),
                            short(c.token_cosine_plateau_exit),
                            step - entered,
                            short(c.token_cosine_critical),
                            short(c.token_cosine_early_contraction),
                            ratio_note()
                        ),
                        outlier_ranks: vec![],
                    },
                ));
            }
            let contracted = late(tc);
            let late_level = contracted >= c.token_cosine_contraction;
            let since_step = late_from.unwrap_or(c.warmup_steps);
            let level = if late_level && tc >= c.token_cosine_critical {
                Some((
                    Severity::Critical,
                    c.token_cosine_critical,
                    "collapsing onto",
                ))
            } else if late_level && tc >= c.token_cosine_warning {
                Some((
                    Severity::Warning,
                    c.token_cosine_warning,
                    "converging toward",
                ))
            } else {
                None
            };
            if let Some((severity, threshold, what)) = level.filter(|_| found.is_empty()) {
                found.push((
                    TOKEN_COSINE,
                    Breach {
                        severity,
                        value: tc,
                        threshold,
                        explanation: format!(
                            "layer {layer}: token cosine {} ≥ {}, its spread {}× narrower than at its widest since step {}: token states are {what} one direction{}",
                            short(tc),
                            short(threshold),
                            short(contracted),
                            since_step,
                            ratio_note()
                        ),
                        outlier_ranks: vec![],
                    },
                ));
            }
        }
        if let Some((er, reference, fall)) = rank_fall.filter(|_| fresh.effective_rank)
            && fall >= c.effective_rank_drop
        {
            found.push((
                EFFECTIVE_RANK,
                Breach {
                    severity: Severity::Warning,
                    value: er,
                    threshold: reference / c.effective_rank_drop,
                    explanation: format!(
                        "layer {layer}: effective rank {} of its linearised map, {}× below its median {} over the last {} steps: the block keeps fewer and fewer directions{}{}",
                        short(er),
                        short(fall),
                        short(reference),
                        c.effective_rank_window,
                        ratio_note(),
                        cosine_note()
                    ),
                    outlier_ranks: vec![],
                },
            ));
        }
        if let (Some(ratio), Some(bounds)) = (state.ratio.filter(|_| fresh.ratio), bounds) {
            let steps = step.saturating_sub(since);
            if let Some(breach) =
                self.ratio_breach(layer, ratio, state, bounds, &cosine_note, steps)
            {
                found.push((RATIO, breach));
            }
        }
        for (test, _) in &found {
            calm[*test] = false;
        }
        let gravest = found.into_iter().reduce(|kept, next| {
            if next.1.severity > kept.1.severity {
                next
            } else {
                kept
            }
        });
        if let Some((_, breach)) = gravest {
            return (Signal::Breach(breach), calm);
        }
        let signal = if calm.iter().all(|&c| c) {
            Signal::Clear
        } else {
            Signal::Hold
        };
        (signal, calm)
    }

    fn ratio_breach(
        &self,
        layer: u32,
        ratio: f64,
        state: &LayerState,
        bounds: Bounds,
        cosine_note: &dyn Fn() -> String,
        steps: u64,
    ) -> Option<Breach> {
        let c = self;
        if ratio < bounds.low || ratio > bounds.high {
            let edge = if ratio > bounds.high {
                bounds.high
            } else {
                bounds.low
            };
            return Some(Breach {
                severity: Severity::Warning,
                value: ratio,
                threshold: edge,
                explanation: format!(
                    "layer {layer}: MLP/attention spectral ratio {} {} for {steps} steps{}",
                    short(ratio),
                    state.describe(c, ratio, bounds),
                    cosine_note()
                ),
                outlier_ranks: vec![],
            });
        }
        if c.trend_horizon_steps > 0.0
            && let Some((slope, t, last_fit)) = fitted_trend(state.log_ratios.values())
            && t.abs() >= c.trend_min_t
        {
            let projected = (last_fit + slope * c.trend_horizon_steps).exp();
            let leaving =
                (slope > 0.0 && projected > bounds.high) || (slope < 0.0 && projected < bounds.low);
            if leaving {
                let edge = if slope > 0.0 { bounds.high } else { bounds.low };
                return Some(Breach {
                    severity: Severity::Warning,
                    value: ratio,
                    threshold: edge,
                    explanation: format!(
                        "layer {layer}: MLP/attention spectral ratio {} trending {} ({:+.1}% per 10 steps), projected to leave {}–{} within {} steps{}",
                        short(ratio),
                        if slope > 0.0 { "up" } else { "down" },
                        ((slope * 10.0).exp() - 1.0) * 100.0,
                        short(bounds.low),
                        short(bounds.high),
                        short(c.trend_horizon_steps),
                        cosine_note()
                    ),
                    outlier_ranks: vec![],
                });
            }
        }
        None
    }
}

impl Detector for RankCollapse {
    type Observation = CollapseObservation;

    fn observe(&mut self, obs: &CollapseObservation) -> Vec<Alert> {
        let fresh_tc = obs.token_cosine.filter(|t| t.is_finite());
        // NaN is the `nonfinite` rule's business; 0 and +Inf (a zero σ) are out of band.
        let fresh_ratio = obs.ratio.filter(|r| !r.is_nan() && *r >= 0.0);
        // While the phase is undecided a ratio is held: if the phase ends at or before its
        // step, it joins the window then (`end_early_phase`).
        let undecided = self.late_from.is_none();
        if undecided && let Some(r) = fresh_ratio.filter(|r| r.is_finite() && *r > 0.0) {
            let held = &mut self.layers.entry(obs.layer).or_default().undecided_ratios;
            if held.len() == UNDECIDED_KEPT {
                held.pop_front();
            }
            held.push_back((obs.step, r));
        }
        // A later step's token cosine confirms an end no layer has gone back on.
        if fresh_tc.is_some()
            && let Some(end) = self.phase_end.filter(|&end| obs.step > end)
        {
            self.end_early_phase(end);
        }
        let c = &self.config;
        let state = self.layers.entry(obs.layer).or_default();
        if let Some(tc) = fresh_tc {
            state.record_token_cosine(c, obs.step, tc);
        }
        self.advance_phase(obs.step, fresh_tc.is_some());
        let c = &self.config;
        // A rank's batch may bring steps from before the early phase ended, after another's
        // ended it: those are still early.
        let late_from = self.late_from.filter(|&from| obs.step >= from);
        let late = late_from.is_some();
        let state = self.layers.entry(obs.layer).or_default();
        if let Some(tc) = fresh_tc
            && self
                .late_from
                .or(self.phase_end)
                .is_some_and(|from| obs.step >= from)
        {
            let spread = 1.0 - tc;
            state.widest_spread = Some(state.widest_spread.map_or(spread, |w| w.max(spread)));
        }
        if let Some(r) = fresh_ratio {
            state.ratio = Some(r);
            // Early-phase probes count for nothing: neither the baseline nor the trend (one
            // held while the phase was undecided joined the window when it ended).
            if late && !undecided && r.is_finite() && r > 0.0 {
                state.ratio_reference = state
                    .log_ratios
                    .update_keeping(obs.step, r.ln(), c.ratio_window_steps, 2, c.window_floor())
                    .map(f64::exp);
            }
        }
        let fresh_rank = obs.effective_rank.filter(|e| e.is_finite() && *e > 0.0);
        if let Some(e) = fresh_rank {
            state.effective_rank_reference = state.effective_ranks.update_keeping(
                obs.step,
                e,
                c.effective_rank_window,
                2,
                c.window_floor(),
            );
            state.effective_rank = Some(e);
        }
        if fresh_ratio.is_none() && fresh_tc.is_none() && fresh_rank.is_none() {
            return vec![];
        }
        let fresh = Fresh {
            ratio: fresh_ratio.is_some(),
            token_cosine: fresh_tc.is_some(),
            effective_rank: fresh_rank.is_some(),
        };
        let since = self.trackers.breach_started(&obs.layer).unwrap_or(obs.step);
        let (signal, calm) = c.signal(obs.layer, state, fresh, since, obs.step, late_from);
        state.calm = calm;
        self.trackers.observe(
            &obs.layer,
            obs.step,
            obs.time_ms,
            signal,
            &self.config.lifecycle,
        )
    }

    fn open_alerts(&self) -> Vec<Alert> {
        self.trackers.open()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The fit as it was written before the sums shared passes: one collected pass per sum.
    fn fitted_trend_one_sum_a_pass(points: &[(u64, f64)]) -> Option<(f64, f64, f64)> {
        let n = points.len() as f64;
        if points.len() < MIN_PROBES {
            return None;
        }
        let last = points.last()?.0;
        let xs: Vec<f64> = points
            .iter()
            .map(|&(s, _)| s as f64 - last as f64)
            .collect();
        let x_mean = xs.iter().sum::<f64>() / n;
        let y_mean = points.iter().map(|&(_, y)| y).sum::<f64>() / n;
        let sxx: f64 = xs.iter().map(|x| (x - x_mean).powi(2)).sum();
        if sxx <= 0.0 {
            return None;
        }
        let sxy: f64 = xs
            .iter()
            .zip(points)
            .map(|(x, &(_, y))| (x - x_mean) * (y - y_mean))
            .sum();
        let slope = sxy / sxx;
        let intercept = y_mean - slope * x_mean;
        let sse: f64 = xs
            .iter()
            .zip(points)
            .map(|(x, &(_, y))| (y - intercept - slope * x).powi(2))
            .sum();
        let se = (sse / (n - 2.0) / sxx).sqrt();
        let t = if se > 0.0 {
            slope / se
        } else if slope == 0.0 {
            0.0
        } else {
            f64::INFINITY.copysign(slope)
        };
        Some((slope, t, intercept))
    }

    proptest! {
        /// Fitting straight from the window gives the same bits as the one-pass-per-sum fit,
        /// flat, signed-zero and repeated-step windows included.
        #[test]
        fn the_fused_fit_is_bit_for_bit_the_plain_one(
            points in prop::collection::vec(
                (0..50u64, prop_oneof![4 => -3.0..3.0f64, 1 => Just(0.0), 1 => Just(-0.0)]),
                0..300,
            ),
        ) {
            let mut step = 0;
            let points: Vec<(u64, f64)> = points
                .into_iter()
                .map(|(gap, y)| {
                    step += gap;
                    (step, y)
                })
                .collect();
            let bits = |fit: Option<(f64, f64, f64)>| fit.map(|(a, b, c)| (a.to_bits(), b.to_bits(), c.to_bits()));
            prop_assert_eq!(
                bits(fitted_trend(points.iter().copied())),
                bits(fitted_trend_one_sum_a_pass(&points))
            );
        }
    }
}
