//! Detector behaviour on synthetic sequences: each rule fires when it should, stays silent on
//! healthy noise, names the right rank or layer, and resolves.

use rankwatch_analytics::alert::{Alert, AlertState, Rule, Severity};
use rankwatch_analytics::detect::*;
use rankwatch_analytics::math::step::RankValues;
use rankwatch_analytics::simulate::{DataParallelSim, Fault, Noise};
use rankwatch_analytics::{RunId, Site};

fn run() -> RunId {
    RunId::new("synthetic").unwrap()
}

fn fired(events: &[Alert]) -> Vec<&Alert> {
    events
        .iter()
        .filter(|a| a.state == AlertState::Firing)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// rank_collapse

fn collapse_obs(step: u64, layer: u32, ratio: f64, tc: f64) -> CollapseObservation {
    CollapseObservation {
        step,
        time_ms: step as i64 * 1000,
        layer,
        ratio: Some(ratio),
        token_cosine: Some(tc),
        effective_rank: None,
    }
}

/// The "1:1 rule" band 0.5–2, off by default, set as a user calibrating it would.
fn published_band() -> RankCollapseConfig {
    RankCollapseConfig {
        band_low: Some(0.5),
        band_high: Some(2.0),
        ..Default::default()
    }
}

/// The published band, judged from the first step (no warm-up).
fn band_from_step_0() -> RankCollapseConfig {
    RankCollapseConfig {
        warmup_steps: 0,
        ..published_band()
    }
}

#[test]
fn rank_collapse_default_ignores_the_warm_up_and_judges_drift_from_the_layer_s_recent_median() {
    // Shaped like the real runs of docs/detection.md: the ratio starts near 0.3 (init), settles
    // at 3 (outside the 0.5–2 band, and healthy), then layer 1 is pushed down 5% per probe.
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let mut noise = Noise::new(7);
    let mut events: Vec<(u64, Alert)> = vec![];
    for i in 0..60u64 {
        let step = i * 5;
        for layer in 0..2 {
            let settled = if i < 6 { 0.3 + 0.45 * i as f64 } else { 3.0 };
            let pushed = if layer == 1 && i >= 20 {
                (-0.05 * (i - 20) as f64).exp()
            } else {
                1.0
            };
            let ratio = settled * pushed * (0.03 * noise.next_value()).exp();
            events.extend(
                d.observe(&collapse_obs(step, layer, ratio, 0.05))
                    .into_iter()
                    .map(|a| (step, a)),
            );
        }
    }
    let firing: Vec<_> = events
        .iter()
        .filter(|(_, a)| a.state == AlertState::Firing)
        .collect();
    assert_eq!(firing.len(), 1, "{firing:#?}");
    let (step, a) = firing[0];
    assert_eq!((a.layer, a.severity), (Some(1), Severity::Warning));
    // Falling 5 % a probe (10 % per 10 steps, as fast as healthy post-LN layers rose in the
    // collapse benchmark's twins, docs/detection.md § 2e), it is named by its trend once that
    // projects it out of ×4 of its trailing median within 50 steps: 35 probes in.
    assert!(
        *step > 100 && *step < 300,
        "fired at {step}: {}",
        a.explanation
    );
    assert!(
        a.explanation
            .starts_with("layer 1: MLP/attention spectral ratio"),
        "{}",
        a.explanation
    );
    assert!(a.explanation.contains("trending down"), "{}", a.explanation);
    // An abrupt fall is named against the recent median.
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let drop: Vec<Alert> = (10..25u64)
        .flat_map(|i| {
            d.observe(&collapse_obs(
                i * 5,
                0,
                if i < 18 { 3.0 } else { 0.5 },
                0.05,
            ))
        })
        .collect();
    assert_eq!(
        fired(&drop)[0].explanation,
        "layer 0: MLP/attention spectral ratio 0.5 6× below its median 3 over the last 200 steps for 10 steps; token cosine 0.05"
    );
}

#[test]
fn rank_collapse_token_cosine_judges_convergence_against_the_layers_own_spread() {
    let tc_run = |tcs: &[(u64, f64)]| {
        let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
        tcs.iter()
            .flat_map(|&(step, tc)| {
                d.observe(&CollapseObservation {
                    step,
                    time_ms: 0,
                    layer: 4,
                    ratio: None,
                    token_cosine: Some(tc),
                    effective_rank: None,
                })
            })
            .collect::<Vec<Alert>>()
    };
    // The early transient of real-text training (0.92 at step 25, falling after) is not judged,
    // however high: the warm-up is not a baseline.
    assert!(
        fired(&tc_run(&[
            (5, 0.95),
            (10, 0.97),
            (15, 0.99),
            (20, 0.92),
            (25, 0.92)
        ]))
        .is_empty()
    );
    // The same transient measured from initialisation (0.03 → 0.92: a 12-fold contraction) is
    // not a collapse.
    assert!(
        fired(&tc_run(&[
            (0, 0.03),
            (25, 0.918),
            (30, 0.92),
            (35, 0.91),
            (40, 0.9)
        ]))
        .is_empty()
    );
    // Nor is a far stronger one that passes within 50 steps: healthy pre-LN GPTs on real text
    // at lr 3e-3 go 0.02 → 0.99 (a 100-fold contraction) at step 10 and are out of it by 30.
    let transient: Vec<(u64, f64)> = [(0, 0.02), (5, 0.6), (10, 0.99), (15, 0.995), (20, 0.98)]
        .into_iter()
        .chain((5..20).map(|i| (i * 5, 0.3)))
        .collect();
    assert!(fired(&tc_run(&transient)).is_empty());
    // A collapse that stays is critical once it has outlasted a healthy early plateau, 300
    // steps (0.97 at step 5, 25-fold narrower than at step 0, enters it; dips to 0.85 do not
    // leave it, only a fall below 0.8 would).
    let stays: Vec<(u64, f64)> = [(0, 0.02), (5, 0.97)]
        .into_iter()
        .chain((2..100).map(|i| (i * 5, if i % 7 == 0 { 0.85 } else { 0.999 })))
        .collect();
    let hot = tc_run(&stays);
    assert_eq!(fired(&hot)[0].severity, Severity::Critical);
    // Breaching from step 305 (300 steps after 5), firing on its third breaching probe.
    assert_eq!(fired(&hot)[0].first_step, 305, "{hot:#?}");
    assert!(
        fired(&hot)[0]
            .explanation
            .contains("at or above 0.8 for 310 steps since step 5 (when it reached 0.9"),
        "{}",
        fired(&hot)[0].explanation
    );
    // Up to then nothing breached: the plateau is no alert while a healthy one could last
    // that long.
    let shorter: Vec<(u64, f64)> = stays.iter().copied().filter(|&(s, _)| s < 300).collect();
    assert!(tc_run(&shorter).is_empty(), "{:#?}", tc_run(&shorter));
    // A fall below 0.8 leaves the plateau and ends the early phase: a return to 0.999 is then
    // judged against the layer's spread since, and is critical at once.
    let left: Vec<(u64, f64)> = stays
        .iter()
        .map(|&(s, tc)| (s, if s == 200 { 0.7 } else { tc }))
        .collect();
    let back = tc_run(&left);
    assert_eq!(fired(&back)[0].first_step, 205, "{back:#?}");
    assert!(
        fired(&back)[0]
            .explanation
            .contains("narrower than at its widest since step 200"),
        "{}",
        fired(&back)[0].explanation
    );
    // A layer that collapsed during the warm-up and stays collapsed after it stays critical.
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    for (step, tc) in [(0, 0.02), (3, 0.97), (4, 0.999), (5, 0.999)]
        .into_iter()
        .chain((2..20).map(|i| (i * 25, 0.999)))
    {
        d.observe(&CollapseObservation {
            step,
            time_ms: 0,
            layer: 4,
            ratio: None,
            token_cosine: Some(tc),
            effective_rank: None,
        });
    }
    let open = d.open_alerts();
    assert_eq!(open.len(), 1, "{open:#?}");
    assert_eq!(
        (open[0].state, open[0].severity),
        (AlertState::Firing, Severity::Critical)
    );
    // Nor is a layer still coming down from it after the warm-up: its spread only widens.
    let falling: Vec<(u64, f64)> = (0..40)
        .map(|i| (50 + 25 * i, 0.91 - 0.018 * i as f64))
        .collect();
    assert!(fired(&tc_run(&falling)).is_empty());
    // A layer that settled at 0.2 and converges to 0.65 (spread 0.8 → 0.35): a warning.
    let mut rising: Vec<(u64, f64)> = (0..10).map(|i| (50 + 25 * i, 0.2)).collect();
    rising.extend((10..13).map(|i| (50 + 25 * i, 0.65)));
    let warned = tc_run(&rising);
    assert_eq!(fired(&warned)[0].severity, Severity::Warning);
    assert!(
        fired(&warned)[0].explanation.contains(
            "token cosine 0.65 ≥ 0.5, its spread 2.286× narrower than at its widest since step 50"
        ),
        "{}",
        fired(&warned)[0].explanation
    );
    // On to 0.95: critical.
    rising.extend((13..16).map(|i| (50 + 25 * i, 0.95)));
    let critical = tc_run(&rising);
    assert_eq!(
        fired(&critical).last().unwrap().severity,
        Severity::Critical
    );
    // An anisotropic layer (a pretrained model's uncentred cosine) settled at 0.95 is healthy;
    // it collapses when its spread shrinks too: 0.99 is critical, 0.96 is not.
    let mut aniso: Vec<(u64, f64)> = (0..10).map(|i| (50 + 25 * i, 0.95)).collect();
    aniso.extend((10..13).map(|i| (50 + 25 * i, 0.96)));
    assert!(fired(&tc_run(&aniso)).is_empty());
    aniso.extend((13..16).map(|i| (50 + 25 * i, 0.99)));
    assert_eq!(fired(&tc_run(&aniso))[0].severity, Severity::Critical);
}

#[test]
fn rank_collapse_silent_on_healthy_layers() {
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let mut noise = Noise::new(1);
    let mut events = vec![];
    for i in 0..500u64 {
        for layer in 0..8 {
            let ratio = (0.1 * noise.next_value()).exp() * (0.7 + 0.1 * f64::from(layer));
            events.extend(d.observe(&collapse_obs(
                i * 50,
                layer,
                ratio,
                0.3 + 0.02 * noise.next_value(),
            )));
        }
    }
    assert!(fired(&events).is_empty(), "{:#?}", fired(&events));
}

#[test]
fn rank_collapse_trend_fires_before_the_band_is_crossed_then_escalates_and_resolves() {
    // Probes every 50 steps drifting 3 % each: a 500-step horizon (ten probes) sees the band
    // edge coming; the default 100 steps would see two probes ahead.
    let config = RankCollapseConfig {
        trend_horizon_steps: 500.0,
        ..published_band()
    };
    let mut d = RankCollapse::new(run(), config).unwrap();
    let mut noise = Noise::new(2);
    let mut events: Vec<(u64, Alert)> = vec![];
    let mut crossed_at = None;
    for i in 0..80u64 {
        let step = i * 50;
        for layer in 0..4 {
            let (ratio, tc) = if layer == 3 && i < 60 {
                // Drifting: +3% per probe; token cosine follows with a lag.
                let ratio = (0.03 * i as f64 + 0.01 * noise.next_value()).exp();
                (ratio, (0.3 + 0.012 * i as f64).min(0.97))
            } else {
                ((0.05 * noise.next_value()).exp(), 0.3)
            };
            if layer == 3 && ratio > 2.0 && crossed_at.is_none() {
                crossed_at = Some(step);
            }
            events.extend(
                d.observe(&collapse_obs(step, layer, ratio, tc))
                    .into_iter()
                    .map(|a| (step, a)),
            );
        }
    }
    assert!(
        events.iter().all(|(_, a)| a.layer == Some(3)),
        "only layer 3 alerts"
    );
    let first_fire = events
        .iter()
        .find(|(_, a)| a.state == AlertState::Firing)
        .expect("fires");
    let crossed_at = crossed_at.unwrap();
    println!(
        "trend alert fired at step {}, ratio crossed 2.0 at step {crossed_at}: {}",
        first_fire.0, first_fire.1.explanation
    );
    assert!(
        first_fire.0 < crossed_at,
        "the trend fires before the band edge is crossed"
    );
    assert!(
        first_fire
            .1
            .explanation
            .contains("layer 3: MLP/attention spectral ratio")
            && first_fire.1.explanation.contains("trending up")
    );
    assert_eq!(first_fire.1.severity, Severity::Warning);
    let critical = events
        .iter()
        .find(|(_, a)| a.severity == Severity::Critical)
        .expect("escalates");
    assert!(
        critical.1.explanation.contains("token cosine"),
        "{}",
        critical.1.explanation
    );
    assert_eq!(
        critical.1.id, first_fire.1.id,
        "the same alert escalates; no duplicate"
    );
    let resolved = events
        .iter()
        .find(|(_, a)| a.state == AlertState::Resolved)
        .expect("resolves");
    assert!(resolved.0 >= 60 * 50 && resolved.1.has_fired());
    assert!(d.open_alerts().is_empty());
}

#[test]
fn rank_collapse_out_of_band_explains_itself_and_the_band_is_configurable() {
    let run_with = |config: RankCollapseConfig| {
        let mut d = RankCollapse::new(run(), config).unwrap();
        let mut out = vec![];
        for i in 0..50u64 {
            let tc = 0.5 + 0.005 * i as f64;
            out.extend(d.observe(&collapse_obs(i * 10, 17, 2.7, tc)));
        }
        out
    };
    let tc_calm = RankCollapseConfig {
        token_cosine_warning: 0.9,
        warmup_steps: 0,
        ..published_band()
    };
    let events = run_with(tc_calm);
    let a = fired(&events)[0];
    assert_eq!((a.value, a.threshold, a.first_step), (2.7, 2.0, 0));
    assert_eq!(
        a.explanation,
        "layer 17: MLP/attention spectral ratio 2.7 above band 0.5–2 for 20 steps; token cosine 0.51 and rising"
    );
    let wide = RankCollapseConfig {
        band_low: Some(0.25),
        band_high: Some(4.0),
        ..tc_calm
    };
    assert!(run_with(wide).is_empty(), "2.7 is healthy in a 0.25–4 band");
    // By default there is no band: a ratio that stays where it settled is healthy.
    let settled = RankCollapseConfig {
        token_cosine_warning: 0.9,
        ..Default::default()
    };
    assert!(run_with(settled).is_empty());
    for bad in [
        RankCollapseConfig {
            band_low: Some(2.0),
            band_high: Some(1.0),
            ..Default::default()
        },
        RankCollapseConfig {
            band_low: Some(0.5),
            ..Default::default()
        },
        RankCollapseConfig {
            token_cosine_warning: 0.95,
            ..Default::default()
        },
        RankCollapseConfig {
            drift_factor: 1.0,
            ..Default::default()
        },
    ] {
        assert!(RankCollapse::new(run(), bad).is_err(), "{bad:?}");
    }
}

#[test]
fn rank_collapse_counts_each_probe_once_across_cadences() {
    // Spectral probes every 100 steps, token cosine every 10: one out-of-band probe followed by
    // token-cosine observations must not meet `pending_for = 3` on its own.
    let mut d = RankCollapse::new(run(), band_from_step_0()).unwrap();
    let mut events = vec![];
    for step in (0..300u64).step_by(10) {
        let ratio = (step % 100 == 0).then_some(if step == 100 { 3.0 } else { 1.0 });
        let obs = CollapseObservation {
            step,
            time_ms: step as i64,
            layer: 0,
            ratio,
            token_cosine: Some(0.3),
            effective_rank: None,
        };
        events.extend(d.observe(&obs));
    }
    assert!(fired(&events).is_empty(), "{events:#?}");
    // Three out-of-band probes in a row do fire, whatever arrives between them.
    let mut d = RankCollapse::new(run(), band_from_step_0()).unwrap();
    let events: Vec<Alert> = (0..40u64)
        .flat_map(|i| {
            let ratio = (i % 10 == 0).then_some(3.0);
            d.observe(&CollapseObservation {
                step: i * 10,
                time_ms: 0,
                layer: 0,
                ratio,
                token_cosine: Some(0.3),
                effective_rank: None,
            })
        })
        .collect();
    assert_eq!(fired(&events)[0].first_step, 0);
    assert_eq!(fired(&events)[0].last_step, 200);
}

#[test]
fn rank_collapse_zero_and_infinite_ratios_breach_and_token_cosine_alone_resolves() {
    let mut d = RankCollapse::new(run(), band_from_step_0()).unwrap();
    let inf: Vec<Alert> = (0..3u64)
        .flat_map(|s| d.observe(&collapse_obs(s, 1, f64::INFINITY, 0.3)))
        .collect();
    assert_eq!(
        fired(&inf).len(),
        1,
        "σ_attn = 0 gives an infinite ratio: out of band"
    );
    let nan: Vec<Alert> = (3..10u64)
        .flat_map(|s| d.observe(&collapse_obs(s, 1, f64::NAN, 0.3)))
        .collect();
    assert!(
        nan.is_empty(),
        "a NaN ratio neither breaches nor clears: {nan:#?}"
    );
    // A layer probed only for token cosine, settled at 0.2: critical at 0.95, then resolved
    // once it falls.
    let mut d = RankCollapse::new(run(), band_from_step_0()).unwrap();
    let events: Vec<Alert> = (0..25u64)
        .flat_map(|s| {
            let tc = match s {
                0..5 => 0.2,
                5..10 => 0.95,
                _ => 0.3,
            };
            d.observe(&CollapseObservation {
                step: s,
                time_ms: 0,
                layer: 2,
                ratio: None,
                token_cosine: Some(tc),
                effective_rank: None,
            })
        })
        .collect();
    let states: Vec<(AlertState, Severity)> =
        events.iter().map(|a| (a.state, a.severity)).collect();
    assert_eq!(
        states,
        vec![
            (AlertState::Pending, Severity::Critical),
            (AlertState::Firing, Severity::Critical),
            (AlertState::Resolved, Severity::Critical),
        ]
    );
}

// ---------------------------------------------------------------------------------------------
// silent_inconsistency

fn run_dp(
    world: u32,
    steps: u64,
    fault_window: std::ops::Range<u64>,
    fault: Fault,
    seed: u32,
) -> Vec<(u64, Alert)> {
    let injected = |step| {
        if fault_window.contains(&step) {
            fault
        } else {
            Fault::None
        }
    };
    run_dp_edited(world, steps, seed, injected, |_, _| {})
}

/// `silent_inconsistency` with its defaults over a simulated job: `fault(step)` is injected by
/// the simulator, then `edit(step, observation)` changes what the detector is shown.
fn run_dp_edited(
    world: u32,
    steps: u64,
    seed: u32,
    fault: impl Fn(u64) -> Fault,
    edit: impl FnMut(u64, &mut StepObservation),
) -> Vec<(u64, Alert)> {
    let config = SilentInconsistencyConfig::default();
    run_dp_logged(config, world, steps, 1, seed, fault, edit)
}

/// `silent_inconsistency` with `config` over a simulated job whose steps are logged every
/// `every` steps (the simulator still steps through all of them).
fn run_dp_logged(
    config: SilentInconsistencyConfig,
    world: u32,
    steps: u64,
    every: u64,
    seed: u32,
    fault: impl Fn(u64) -> Fault,
    mut edit: impl FnMut(u64, &mut StepObservation),
) -> Vec<(u64, Alert)> {
    let mut d = SilentInconsistency::new(run(), config).unwrap();
    let mut sim = DataParallelSim::new(world, 1024, seed);
    let mut events = vec![];
    for step in 0..steps {
        let mut obs = sim.step(step, fault(step));
        if step % every == 0 {
            edit(step, &mut obs);
            events.extend(d.observe(&obs).into_iter().map(|a| (step, a)));
        }
    }
    events
}

/// The first alert that fired, with the step it fired at.
fn first_firing(events: &[(u64, Alert)]) -> &(u64, Alert) {
    events
        .iter()
        .find(|(_, a)| a.state == AlertState::Firing)
        .expect("fires")
}

/// The first alert that fired, which must have fired at a step within `steps`.
fn fired_within(events: &[(u64, Alert)], steps: std::ops::RangeInclusive<u64>) -> &Alert {
    let (step, a) = first_firing(events);
    assert!(
        steps.contains(step),
        "fired at {step}, not in {steps:?}: {}",
        a.explanation
    );
    a
}

#[test]
fn silent_inconsistency_is_silent_on_healthy_workers() {
    for seed in [3, 4, 5] {
        let events = run_dp(8, 400, 0..0, Fault::None, seed);
        assert!(
            events.iter().all(|(_, a)| a.state != AlertState::Firing),
            "seed {seed}: {events:#?}"
        );
    }
}

#[test]
fn silent_inconsistency_absorbs_slowly_growing_gradient_noise() {
    // Over 3,000 steps the noise grows from 1× to 3× the true gradient: C_w falls from about
    // 0.5 to 0.1 with no fault at all. A baseline frozen after warm-up would fire; the rolling
    // baseline follows.
    let mut d = SilentInconsistency::new(run(), SilentInconsistencyConfig::default()).unwrap();
    let mut sim = DataParallelSim::new(8, 1024, 12);
    let mut events = vec![];
    for step in 0..3000u64 {
        sim.noise_level = 1.0 + 2.0 * step as f64 / 3000.0;
        events.extend(d.observe(&sim.step(step, Fault::None)));
    }
    assert!(fired(&events).is_empty(), "{events:#?}");
    // The same drift does not hide a fault that arrives late.
    let (step, a) = {
        let mut found = None;
        for step in 3000..3100u64 {
            let fault = if step >= 3050 {
                Fault::FlipGradient(4)
            } else {
                Fault::None
            };
            if let Some(a) = d
                .observe(&sim.step(step, fault))
                .into_iter()
                .find(|a| a.state == AlertState::Firing)
            {
                found = Some((step, a));
                break;
            }
        }
        found.expect("fires")
    };
    assert!((3050..=3055).contains(&step), "fired at {step}");
    assert_eq!(a.outlier_ranks.first(), Some(&4));
}

#[test]
fn silent_inconsistency_does_not_latch_after_a_level_shift() {
    // A legitimate step change (learning-rate decay, a resume): the gradient noise jumps to
    // 2.5× at step 600 and stays. It may alert; it must not fire for the rest of the run, as a
    // baseline fed only clear steps did (no step was clear again, so it never moved).
    let mut d = SilentInconsistency::new(run(), SilentInconsistencyConfig::default()).unwrap();
    let mut sim = DataParallelSim::new(8, 1024, 21);
    let mut events = vec![];
    for step in 0..1200u64 {
        sim.noise_level = if step < 600 { 1.0 } else { 2.5 };
        events.extend(
            d.observe(&sim.step(step, Fault::None))
                .into_iter()
                .map(|a| (step, a)),
        );
    }
    let shifted = events
        .iter()
        .filter(|(_, a)| a.state == AlertState::Firing)
        .count();
    assert!(
        shifted > 0,
        "the shift itself is scored against the old level: {events:#?}"
    );
    assert!(
        d.open_alerts().is_empty(),
        "still open at step 1,200: {:#?}",
        d.open_alerts()
    );
    let resolved = events
        .iter()
        .find(|(_, a)| a.state == AlertState::Resolved)
        .map(|(s, _)| *s)
        .expect("resolves");
    assert!(resolved < 800, "resolved at {resolved}");
}

#[test]
fn silent_inconsistency_sees_a_rank_inconsistent_from_step_0_without_a_baseline() {
    // Rank 3 reads off-task data from the first step: its loss is 2.8 against the others' 2.0.
    // The run-level baseline would learn it as normal; its peers do not.
    // Noted at each of 12 steps in a row, it breaches at step 12 and fires 2 steps later
    // (before: at step 41, when 40 of the window's steps were in).
    let events = run_dp(4, 200, 0..200, Fault::LossOffset(3, 0.8), 31);
    let a = fired_within(&events, 14..=14);
    assert_eq!(a.outlier_ranks, vec![3]);
    // A run's breach shows the run against `peer_run`, not a share of the window.
    assert_eq!((a.value, a.threshold), (14.0, 12.0), "{a:?}");
    assert!(
        a.explanation.contains(
            "rank 3 stood out from the other 3 ranks at each of the last 14 steps (loss 1.42× theirs)"
        ),
        "{}",
        a.explanation
    );
    // With the run test off, the window's share alone judges, once 40 steps are in.
    let config = SilentInconsistencyConfig {
        peer_run: 0,
        ..SilentInconsistencyConfig::default()
    };
    let off_task = |_| Fault::LossOffset(3, 0.8);
    let events = run_dp_logged(config, 4, 200, 1, 31, off_task, |_, _| {});
    let a = fired_within(&events, 41..=47);
    assert!(
        a.explanation.contains(
            "rank 3 stood out from the other 3 ranks at 42 of the last 42 steps (loss 1.4× theirs)"
        ),
        "{}",
        a.explanation
    );
    // A rank whose loss is persistently 10% above its peers' (a harder contiguous shard) is
    // healthy: under the effect floor, nothing fires.
    let events = run_dp(4, 400, 0..400, Fault::LossOffset(1, 0.2), 32);
    assert!(
        fired(&events.iter().map(|(_, a)| a.clone()).collect::<Vec<_>>()).is_empty(),
        "{events:#?}"
    );
}

#[test]
fn silent_inconsistency_leaves_a_rank_with_a_non_finite_gradient_to_nonfinite() {
    // Rank 1's gradient norm overflows from step 300 (a flipped exponent bit) and training
    // stalls: the finite ranks drift apart, rank 0 the most. That is the overflow's doing, not
    // rank 0's; `nonfinite` names rank 1. Once rank 1 is finite again at step 400, rank 0 still
    // standing out ×3 is judged, and named.
    let stalled = |step: u64, obs: &mut StepObservation| {
        if step >= 300 {
            for r in &mut obs.ranks {
                match r.rank {
                    0 => r.grad_norm = r.grad_norm.map(|g| 3.0 * g),
                    1 if step < 400 => r.grad_norm = Some(f64::INFINITY),
                    _ => {}
                }
            }
        }
    };
    let events = run_dp_edited(4, 500, 8, |_| Fault::None, stalled);
    let (step, a) = first_firing(&events);
    assert!(
        *step >= 400,
        "fired at {step} while rank 1 was not finite: {}",
        a.explanation
    );
    assert_eq!(a.outlier_ranks, vec![0], "{}", a.explanation);
}

fn identical_ranks(step: u64, values: [(f64, f64); 4]) -> StepObservation {
    StepObservation {
        step,
        time_ms: step as i64,
        world_size: 4,
        ranks: values
            .iter()
            .enumerate()
            .map(|(r, &(loss, grad))| RankValues {
                rank: r as u32,
                loss: Some(loss),
                tokens: None,
                grad_norm: Some(grad),
                grad_norm_mean: None,
                cos_to_mean: None,
            })
            .collect(),
    }
}

#[test]
fn silent_inconsistency_names_ranks_fed_identical_batches() {
    // The seed experiment's "rank 0 alone different": ranks 1-3 share a data seed, so they
    // compute the same loss and gradient norm to the bit; rank 0 does not.
    let mut d = SilentInconsistency::new(run(), SilentInconsistencyConfig::default()).unwrap();
    let mut noise = Noise::new(41);
    let mut events = vec![];
    for step in 0..40u64 {
        let shared = (
            2.0 + 0.05 * noise.next_value(),
            1.0 + 0.1 * noise.next_value(),
        );
        let own = (
            2.0 + 0.05 * noise.next_value(),
            1.0 + 0.1 * noise.next_value(),
        );
        events.extend(
            d.observe(&identical_ranks(step, [own, shared, shared, shared]))
                .into_iter()
                .map(|a| (step, a)),
        );
    }
    let (step, a) = first_firing(&events);
    // 10 identical steps to breach (step 9), 3 breaching steps to fire.
    assert_eq!(*step, 11, "{}", a.explanation);
    // The ranks sharing batches are named: which of them is the copy cannot be told.
    assert_eq!(a.outlier_ranks, vec![1, 2, 3]);
    assert!(
        a.explanation.contains(
            "ranks 1, 2, 3 computed the same loss and gradient norm, to the bit, for 12 steps"
        ) && a.explanation.contains("rank 0 alone differs"),
        "{}",
        a.explanation
    );
    // Every rank on one seed: every rank shares its batches.
    let mut d = SilentInconsistency::new(run(), SilentInconsistencyConfig::default()).unwrap();
    let firing: Vec<Alert> = (0..40u64)
        .flat_map(|step| {
            let v = (2.0 + 0.01 * step as f64, 1.0);
            d.observe(&identical_ranks(step, [v; 4]))
        })
        .filter(|a| a.state == AlertState::Firing)
        .collect();
    assert_eq!(firing[0].outlier_ranks, vec![0, 1, 2, 3]);
    // Seeded by local rank on two nodes: ranks 0 and 2 share batches, and 1 and 3. Two groups,
    // no odd rank; the partition must hold, whichever group sorts first.
    let mut d = SilentInconsistency::new(run(), SilentInconsistencyConfig::default()).unwrap();
    let mut noise = Noise::new(43);
    let paired: Vec<Alert> = (0..40u64)
        .flat_map(|step| {
            let a = (
                2.0 + 0.05 * noise.next_value(),
                1.0 + 0.1 * noise.next_value(),
            );
            let b = (
                2.0 + 0.05 * noise.next_value(),
                1.0 + 0.1 * noise.next_value(),
            );
            d.observe(&identical_ranks(step, [a, b, a, b]))
        })
        .filter(|a| a.state == AlertState::Firing)
        .collect();
    assert!(!paired.is_empty());
    assert_eq!(paired[0].outlier_ranks, vec![0, 1, 2, 3]);
    assert!(
        paired[0]
            .explanation
            .contains("2 groups of ranks (0, 2; 1, 3) computed the same loss"),
        "{}",
        paired[0].explanation
    );
    assert!(
        firing[0]
            .explanation
            .contains("all 4 ranks computed the same loss"),
        "{}",
        firing[0].explanation
    );
}

#[test]
fn silent_inconsistency_names_a_rank_whose_loss_rose_a_few_per_cent() {
    // What 10 % noisy labels do to one rank: its loss ×1.06 against its peers', under the
    // stand-out floor (1.25×) and inside one step's spread; the shift test finds it by where
    // the rank sits among its peers, step after step.
    for world in [2u32, 4] {
        let events = run_dp_edited(
            world,
            700,
            7,
            |_| Fault::None,
            |step, obs| {
                if step >= 300 {
                    for r in obs.ranks.iter_mut().filter(|r| r.rank == 1) {
                        r.loss = r.loss.map(|l| l * 1.06);
                    }
                }
            },
        );
        let a = fired_within(&events, 300..=420);
        assert_eq!(a.outlier_ranks, vec![1], "{world} ranks: {}", a.explanation);
        assert!(
            a.explanation.starts_with(
                "workers are inconsistent: rank 1's loss rose against the other ranks'"
            ),
            "{}",
            a.explanation
        );
    }
}

#[test]
fn silent_inconsistency_names_a_rank_with_a_scaled_gradient() {
    let events = run_dp(8, 500, 350..420, Fault::ScaleGradient(5, 3.0), 6);
    let (step, a) = first_firing(&events);
    println!(
        "scaled gradient on rank 5 from step 350: fired at {step}: {}",
        a.explanation
    );
    assert!(
        (350..=355).contains(step),
        "within a few steps of the fault, got {step}"
    );
    assert_eq!(a.outlier_ranks, vec![5]);
    assert!(
        a.explanation.contains("gradient-norm CV") && a.explanation.contains("outlier rank 5"),
        "{}",
        a.explanation
    );
    let (resolved_at, _) = events
        .iter()
        .find(|(_, a)| a.state == AlertState::Resolved)
        .expect("resolves");
    assert!(
        // The peers hold while rank 5 was noted at 20 or more of the last 50 steps (about 30
        // steps after the fault ends), then 10 clear steps.
        (420..=470).contains(resolved_at),
        "resolved at {resolved_at}"
    );
}

#[test]
fn silent_inconsistency_catches_a_flipped_gradient_by_cosine() {
    let events = run_dp(8, 460, 350..460, Fault::FlipGradient(2), 7);
    let a = fired_within(&events, 350..=355);
    assert!(
        a.explanation.contains("worker cosine C_w"),
        "{}",
        a.explanation
    );
    assert_eq!(a.outlier_ranks.first(), Some(&2));
}

#[test]
fn silent_inconsistency_names_a_desynchronised_loss() {
    let events = run_dp(4, 460, 300..460, Fault::LossOffset(0, 0.4), 8);
    // Within a few steps: 3 breaching steps, scored against a baseline of only the 30 steps
    // after `skip_steps`.
    let a = fired_within(&events, 300..=308);
    assert!(a.explanation.contains("loss CV"), "{}", a.explanation);
    assert_eq!(a.outlier_ranks, vec![0]);
}

#[test]
fn two_ranks_name_the_one_whose_own_history_changed() {
    // No rank stands out from "the others" with two; each against its own past does: rank 1's
    // gradient ×4 from step 300 is named by the pair test within a few steps (3 of the 5 recent
    // steps move the median, then 3 breaching steps), long before the run-level test could.
    let events = run_dp(2, 460, 300..460, Fault::ScaleGradient(1, 4.0), 9);
    let (step, a) = first_firing(&events);
    assert!(
        (302..=308).contains(step),
        "fired at {step}: {}",
        a.explanation
    );
    assert_eq!(a.outlier_ranks, vec![1], "{}", a.explanation);
    assert!(
        a.explanation.contains("rank 1's gradient norm moved 3.9"),
        "{}",
        a.explanation
    );
    // The same fault from step 40 (before the run-level test judges anything): named too.
    let early = run_dp(2, 150, 40..150, Fault::ScaleGradient(1, 4.0), 10);
    let (step, a) = first_firing(&early);
    assert!(
        (42..=48).contains(step),
        "fired at {step}: {}",
        a.explanation
    );
    assert_eq!(a.outlier_ranks, vec![1]);
    // Healthy two-rank runs raise nothing.
    for seed in 11..16 {
        let healthy = run_dp(2, 460, 0..0, Fault::None, seed);
        assert!(
            fired(&healthy.iter().map(|(_, a)| a.clone()).collect::<Vec<_>>()).is_empty(),
            "seed {seed}: {healthy:#?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// nonfinite, loss_spike

#[test]
fn nonfinite_fires_critical_at_the_step_and_resolves() {
    let mut d = Nonfinite::new(run(), NonfiniteConfig::default()).unwrap();
    let mut events = vec![];
    for step in 0..130u64 {
        for rank in 0..4u32 {
            let bad = rank == 1 && step == 100;
            let obs = NonfiniteObservation {
                step,
                time_ms: step as i64,
                rank: Some(rank),
                count: if bad { 3 } else { 0 },
                loss: Some(if bad { f64::NAN } else { 2.0 }),
            };
            events.extend(d.observe(&obs));
        }
    }
    assert_eq!(events.len(), 2, "{events:#?}");
    assert_eq!(
        (
            events[0].state,
            events[0].severity,
            events[0].first_step,
            events[0].rank
        ),
        (AlertState::Firing, Severity::Critical, 100, Some(1))
    );
    assert!(
        events[0]
            .explanation
            .starts_with("rank 1: loss is NaN and 3 non-finite values at step 100"),
        "{}",
        events[0].explanation
    );
    assert_eq!(
        (events[1].state, events[1].resolved_at_ms),
        (AlertState::Resolved, Some(110))
    );
}

#[test]
fn loss_spike_fires_on_a_spike_not_on_noise_or_decay() {
    let mut d = LossSpike::new(run(), LossSpikeConfig::default()).unwrap();
    let mut noise = Noise::new(10);
    let mut events = vec![];
    for step in 0..600u64 {
        let base = 3.0 * (-(step as f64) / 300.0).exp() + 1.0 + 0.01 * noise.next_value();
        let loss = if step == 400 { base * 1.5 } else { base };
        events.extend(d.observe(&LossObservation {
            step,
            time_ms: step as i64,
            rank: None,
            loss,
        }));
        // A NaN is the nonfinite rule's business: ignored here.
        d.observe(&LossObservation {
            step,
            time_ms: step as i64,
            rank: Some(0),
            loss: f64::NAN,
        });
    }
    assert_eq!(events.len(), 2, "{events:#?}");
    assert_eq!(
        (events[0].state, events[0].first_step),
        (AlertState::Firing, 400)
    );
    // The median of the last 50 losses lags the decay, so the jump reads a little under 50%.
    assert!(
        events[0]
            .explanation
            .starts_with("all ranks: loss 2.688 spiked above its recent median 1.862 (+44%"),
        "{}",
        events[0].explanation
    );
    assert_eq!(events[1].state, AlertState::Resolved);

    // A nearly noiseless loss with a 1% bump: huge z, but below the relative-jump guard.
    let mut d = LossSpike::new(run(), LossSpikeConfig::default()).unwrap();
    let quiet: Vec<Alert> = (0..100u64)
        .flat_map(|s| {
            d.observe(&LossObservation {
                step: s,
                time_ms: 0,
                rank: Some(2),
                loss: if s == 80 {
                    2.02
                } else {
                    2.0 + 1e-9 * (s % 3) as f64
                },
            })
        })
        .collect();
    assert!(quiet.is_empty(), "{quiet:#?}");
}

/// A loss cycling 2.9, 3.0, 3.1 (median 3, MAD 0.1) with `spikes` replacing some steps; the
/// firing alerts of `loss_spike` with its defaults.
fn loss_spike_fired(spikes: &[(u64, f64)]) -> Vec<Alert> {
    loss_spike_fired_under(LossSpikeConfig::default(), spikes)
}

/// As `loss_spike_fired`, under `config`; a spike at z is 3 + z·1.4826·0.1.
fn loss_spike_fired_under(config: LossSpikeConfig, spikes: &[(u64, f64)]) -> Vec<Alert> {
    let mut d = LossSpike::new(run(), config).unwrap();
    let sigma = 1.4826 * 0.1;
    (0..200u64)
        .flat_map(|step| {
            let z = spikes.iter().find(|(s, _)| *s == step).map(|(_, z)| *z);
            let loss = z.map_or(2.9 + 0.1 * (step % 3) as f64, |z| 3.0 + z * sigma);
            d.observe(&LossObservation {
                step,
                time_ms: step as i64,
                rank: None,
                loss,
            })
        })
        .filter(|a| a.state == AlertState::Firing)
        .collect()
}

#[test]
fn loss_spike_lets_one_hard_batch_pass_but_not_a_loss_that_stays_up_or_a_big_jump() {
    // One batch at z 8, twice in a run: the loss falls back at once, nothing fires.
    assert!(loss_spike_fired(&[(100, 8.0), (150, 8.0)]).is_empty());
    // Two in a row: fires on the second, the alert starting at the first.
    let fired = loss_spike_fired(&[(100, 8.0), (101, 7.0)]);
    assert_eq!(fired.len(), 1, "{fired:#?}");
    assert_eq!((fired[0].first_step, fired[0].last_step), (100, 101));
    // Between the two, a step that is up but under the z_threshold does not clear the breach.
    let fired = loss_spike_fired(&[(100, 8.0), (101, 4.0), (102, 8.0)]);
    assert_eq!(fired.len(), 1, "{fired:#?}");
    assert_eq!(fired[0].last_step, 102);
    // One step at z 12 or more is far outside a batch's noise: it fires on that step.
    let fired = loss_spike_fired(&[(100, 13.0)]);
    assert_eq!(fired.len(), 1, "{fired:#?}");
    assert_eq!((fired[0].first_step, fired[0].last_step), (100, 100));
    assert!(
        fired[0].explanation.contains("z=13.0"),
        "{}",
        fired[0].explanation
    );
}

#[test]
fn loss_spike_immediate_z_at_or_below_the_threshold_fires_every_breach_at_once() {
    // A rules file that raises z_threshold past the default immediate_z still loads, and then
    // every breach fires on its first step, as the rule did before it asked for a repeat.
    let config: DetectorsConfig = toml::from_str("[loss_spike]\nz_threshold = 15.0\n").unwrap();
    let fired = loss_spike_fired_under(config.loss_spike, &[(100, 16.0)]);
    assert_eq!(fired.len(), 1, "{fired:#?}");
    assert_eq!(fired[0].first_step, 100);
    let bad = LossSpikeConfig {
        immediate_z: 0.0,
        ..LossSpikeConfig::default()
    };
    let err = LossSpike::new(run(), bad).unwrap_err().to_string();
    assert!(err.contains("immediate_z > 0"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// activation_outlier

fn act(step: u64, layer: u32, value: f64) -> ActivationObservation {
    ActivationObservation {
        step,
        time_ms: step as i64,
        layer: Some(layer),
        site: Site::Residual,
        rank: Some(0),
        value,
    }
}

#[test]
fn activation_outlier_growth_absolute_and_nonfinite() {
    let mut d = ActivationOutlier::new(run(), ActivationOutlierConfig::default()).unwrap();
    let mut noise = Noise::new(11);
    let mut events = vec![];
    for i in 0..120u64 {
        for layer in 0..3 {
            let healthy = 5.0 + 0.2 * noise.next_value();
            let value = match (layer, i) {
                (1, 40..=49) => 60.0,  // 12× its baseline
                (1, 50..=59) => 500.0, // past FP8 E4M3
                (1, 60) => f64::INFINITY,
                _ => healthy,
            };
            events.extend(
                d.observe(&act(i * 10, layer, value))
                    .into_iter()
                    .map(|a| (i, a)),
            );
        }
    }
    assert!(
        events
            .iter()
            .all(|(_, a)| a.layer == Some(1) && a.site == Some(Site::Residual))
    );
    let states: Vec<(u64, AlertState, Severity)> = events
        .iter()
        .map(|(i, a)| (*i, a.state, a.severity))
        .collect();
    assert_eq!(
        states,
        vec![
            (40, AlertState::Pending, Severity::Warning),
            (41, AlertState::Firing, Severity::Warning),
            (60, AlertState::Firing, Severity::Critical),
            (63, AlertState::Resolved, Severity::Critical),
        ]
    );
    assert!(
        events[1]
            .1
            .explanation
            .contains("grew 11.9× over its baseline 5.045 on rank 0"),
        "{}",
        events[1].1.explanation
    );

    // Healthy growth from the initial scale during the warm-up is not an outlier: 0.1 at
    // init growing to 1.5 by step 50 (as real GPTs' block outputs do), then steady.
    let mut d = ActivationOutlier::new(run(), ActivationOutlierConfig::default()).unwrap();
    let events: Vec<Alert> = (0..60u64)
        .flat_map(|i| d.observe(&act(i * 5, 0, (0.1 + 0.14 * i as f64).min(1.5))))
        .collect();
    assert!(events.is_empty(), "{events:#?}");

    // With the growth test off and the FP8 limit set, 60 is fine and 500 breaches it.
    let config = ActivationOutlierConfig {
        growth_factor: None,
        absolute_limit: Some(activation_outlier::FP8_E4M3_MAX),
        ..Default::default()
    };
    let mut d = ActivationOutlier::new(run(), config).unwrap();
    let events: Vec<Alert> = (0..20u64)
        .flat_map(|i| d.observe(&act(i, 0, if i < 10 { 60.0 } else { 500.0 })))
        .collect();
    assert_eq!(fired(&events).len(), 1);
    assert!(
        fired(&events)[0]
            .explanation
            .contains("above the absolute limit 448")
    );
}

#[test]
fn activation_outlier_follows_healthy_growth_after_the_warm_up_and_still_sees_a_jump() {
    // Measured on the detection benchmark's 4-layer GPT (attention output, probed every 25
    // steps): 0.09 from step 50 to 150, then growing to 1.0 by step 475 and 1.5 by 2,000. A
    // baseline learned once at steps 50-150 called that an 11× outlier; the trailing median
    // follows it.
    let value = |step: u64| match step {
        0..150 => 0.09,
        150..475 => 0.09 * (1.0f64 / 0.09).powf((step - 150) as f64 / 325.0),
        _ => 1.0 + 0.5 * (step - 475) as f64 / 1525.0,
    };
    let mut d = ActivationOutlier::new(run(), ActivationOutlierConfig::default()).unwrap();
    let healthy: Vec<Alert> = (2..80u64)
        .flat_map(|i| d.observe(&act(i * 25, 1, value(i * 25))))
        .collect();
    assert!(fired(&healthy).is_empty(), "{healthy:#?}");
    // A hundredfold jump at step 2,000 fires within two probes.
    let jump: Vec<Alert> = (80..84u64)
        .flat_map(|i| d.observe(&act(i * 25, 1, 100.0 * value(i * 25))))
        .collect();
    assert_eq!(fired(&jump)[0].first_step, 2000, "{jump:#?}");
}

// ---------------------------------------------------------------------------------------------
// stale_rank

#[test]
fn stale_rank_fires_within_the_timeout_and_resolves() {
    // Step lag off: this test is about silence (the lag test is below).
    let config = StaleRankConfig {
        max_step_lag: None,
        ..Default::default()
    };
    let mut d = StaleRank::new(run(), config).unwrap();
    let mut last: Vec<Option<(u64, i64)>> = vec![None; 4];
    let mut events = vec![];
    for t in 0..260i64 {
        let now = t * 1000;
        for (rank, seen) in last.iter_mut().enumerate() {
            let stopped = (rank == 2 && (100..170).contains(&t)) || t >= 200;
            if !stopped {
                *seen = Some((t as u64 * 10, now));
            }
        }
        events.extend(
            d.observe(&RankActivity {
                now_ms: now,
                run_started_ms: 0,
                last_seen: last.clone(),
            })
            .into_iter()
            .map(|a| (t, a)),
        );
    }
    let times: Vec<(i64, AlertState, Option<u32>)> =
        events.iter().map(|(t, a)| (*t, a.state, a.rank)).collect();
    // Silent since t=99: stale once silent for more than 60 s; back at t=170; nothing once the
    // whole run went quiet at t=200.
    assert_eq!(
        times,
        vec![
            (160, AlertState::Firing, Some(2)),
            (170, AlertState::Resolved, Some(2))
        ]
    );
    assert!(
        events[0]
            .1
            .explanation
            .starts_with("rank 2 silent for 61 s (last step 990, others at 1600)"),
        "{}",
        events[0].1.explanation
    );
}

#[test]
fn stale_rank_counts_silence_from_a_restart_not_from_before_it() {
    // Four ranks at step 1,199 at t = 0; the job restarts from a checkpoint and nothing is
    // heard for 90 s; rank 1 reports step 1,200 at t = 90 s, ranks 0 and 2 a few seconds
    // later, rank 3 never. Only rank 3 is stale, 60 s after the run came back.
    let mut d = StaleRank::new(run(), StaleRankConfig::default()).unwrap();
    let mut last: Vec<Option<(u64, i64)>> = vec![Some((1199, 0)); 4];
    let mut events = vec![];
    for t in 1..200i64 {
        let now = t * 1000;
        for (rank, back_at) in [(1usize, 90i64), (0, 93), (2, 95)] {
            if t >= back_at {
                last[rank] = Some((1200 + (t - back_at) as u64, now));
            }
        }
        events.extend(d.observe(&RankActivity {
            now_ms: now,
            run_started_ms: 0,
            last_seen: last.clone(),
        }));
    }
    let fired: Vec<(Option<u32>, i64)> = events
        .iter()
        .filter(|a| a.state == AlertState::Firing)
        .map(|a| (a.rank, a.updated_at_ms))
        .collect();
    assert_eq!(fired, vec![(Some(3), 151_000)], "{events:#?}");
}

/// The collector's looks at a run's ranks, one call each: (now, each rank's last report).
fn looks(
    mut d: StaleRank,
) -> impl FnMut(i64, Vec<Option<(u64, i64)>>) -> Vec<rankwatch_analytics::Alert> {
    move |now_ms, last_seen| {
        d.observe(&RankActivity {
            now_ms,
            run_started_ms: 0,
            last_seen,
        })
    }
}

#[test]
fn stale_rank_measures_a_rank_silent_since_the_start_from_the_start() {
    // The collector looks at the ranks once a second: its first look came before any rank had
    // reported. That is not a silence the run came back from, so rank 1, silent since the
    // start, is stale 61 s in, although rank 0 was first seen at the next look, 59 s later.
    let mut look = looks(StaleRank::new(run(), StaleRankConfig::default()).unwrap());
    assert!(look(0, vec![None, None]).is_empty());
    assert!(look(59_000, vec![Some((2, 59_000)), Some((1, 0))]).is_empty());
    let events = look(61_000, vec![Some((3, 61_000)), Some((1, 0))]);
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0].rank, Some(1));
    assert!(
        events[0].explanation.starts_with("rank 1 silent for 61 s"),
        "{}",
        events[0].explanation
    );
}

#[test]
fn stale_rank_counts_from_the_first_rank_back_when_looks_are_sparse() {
    // Every rank silent at the look at 100 s; by the next look, at 130 s, rank 0 came back at
    // 101 s and rank 1 at 129 s. The run came back at 101 s: rank 2 is stale after 161 s, not
    // after 189 s (the freshest report's time, which a look made seconds later would give).
    let mut look = looks(StaleRank::new(run(), StaleRankConfig::default()).unwrap());
    let before = vec![Some((10, 30_000)); 3];
    assert!(look(100_000, before).is_empty());
    let back = |t0, t1| vec![Some((11, t0)), Some((11, t1)), Some((10, 30_000))];
    assert!(look(130_000, back(101_000, 129_000)).is_empty());
    assert!(look(160_000, back(159_000, 159_000)).is_empty());
    let events = look(162_000, back(161_000, 161_000));
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0].rank, Some(2));
    assert!(
        events[0].explanation.starts_with("rank 2 silent for 61 s"),
        "{}",
        events[0].explanation
    );
}

#[test]
fn stale_rank_by_step_lag_and_never_seen() {
    let mut d = StaleRank::new(run(), StaleRankConfig::default()).unwrap();
    let activity = RankActivity {
        now_ms: 70_000,
        run_started_ms: 0,
        last_seen: vec![Some((1000, 69_000)), Some((700, 69_500)), None],
    };
    let events = d.observe(&activity);
    let by_rank: Vec<(Option<u32>, &str)> = events
        .iter()
        .map(|a| (a.rank, a.explanation.as_str()))
        .collect();
    assert_eq!(
        by_rank,
        vec![
            (
                Some(1),
                "rank 1 is 300 steps behind the leading rank (step 1000)"
            ),
            (Some(2), "rank 2 silent for 70 s (never reported)"),
        ]
    );
}

#[test]
fn stale_rank_judges_a_rank_not_heard_from_by_its_silence_not_a_step_lag() {
    // A run resumed at step 1,200 and watched afresh: rank 2's first reports arrive while the
    // other ranks' are still on their way. They are not "1,219 steps behind"; they are silent
    // for 5 s, under the timeout.
    let mut d = StaleRank::new(run(), StaleRankConfig::default()).unwrap();
    let events = d.observe(&RankActivity {
        now_ms: 5_000,
        run_started_ms: 0,
        last_seen: vec![None, None, Some((1219, 4_900)), None],
    });
    assert!(events.is_empty(), "{events:#?}");
    // Still silent past the timeout: stale, as never reported.
    let events = d.observe(&RankActivity {
        now_ms: 61_000,
        run_started_ms: 0,
        last_seen: vec![
            Some((1500, 60_900)),
            Some((1500, 60_950)),
            Some((1500, 60_990)),
            None,
        ],
    });
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(
        events[0].explanation,
        "rank 3 silent for 61 s (never reported)"
    );
}

// ---------------------------------------------------------------------------------------------
// configuration

#[test]
fn rules_file_overrides_only_what_it_names() {
    let text = r#"
        [rank_collapse]
        band_low = 0.25
        band_high = 4.0
        drift_factor = 3.0
        lifecycle = { pending_for = 5, resolve_after = 2 }

        [stale_rank]
        timeout_ms = 30000
    "#;
    let c: DetectorsConfig = toml::from_str(text).unwrap();
    c.validate().unwrap();
    assert_eq!(
        (c.rank_collapse.band_low, c.rank_collapse.band_high),
        (Some(0.25), Some(4.0))
    );
    assert_eq!(c.rank_collapse.drift_factor, 3.0);
    assert_eq!(c.rank_collapse.lifecycle.pending_for, 5);
    assert_eq!(
        c.rank_collapse.ratio_window_steps,
        RankCollapseConfig::default().ratio_window_steps
    );
    assert_eq!(c.stale_rank.timeout_ms, 30_000);
    assert_eq!(c.loss_spike, LossSpikeConfig::default());

    let err = toml::from_str::<DetectorsConfig>("[rank_collapse]\nband_hi = 3.0\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("band_hi"), "{err}");
    let c: DetectorsConfig = toml::from_str("[loss_spike]\nz_exit = 9.0\n").unwrap();
    assert!(
        c.validate()
            .unwrap_err()
            .to_string()
            .starts_with("invalid configuration: loss_spike")
    );
    // Every rule of the vocabulary has a section.
    let defaults = toml::to_string(&DetectorsConfig::default()).unwrap();
    for rule in Rule::ALL {
        assert!(
            defaults.contains(&format!("[{rule}")),
            "{rule} missing from\n{defaults}"
        );
    }
}

/// The spectral probe's view of one layer: the ratio and the effective rank at one step.
fn rank_obs(step: u64, effective_rank: f64) -> CollapseObservation {
    CollapseObservation {
        step,
        time_ms: step as i64 * 100,
        layer: 3,
        ratio: Some(3.0),
        token_cosine: None,
        effective_rank: Some(effective_rank),
    }
}

#[test]
fn rank_collapse_fires_on_a_fall_of_the_effective_rank_and_absorbs_a_new_level() {
    // Shaped like docs/detection.md § 2c, probes every 10 steps, the test switched on as for a
    // post-LN model: a 7-fold early fall (before step 200, not judged), a slow healthy decline
    // 50 → 40, then the LR ramp's collapse from step 310 to 2 % of the trailing median, then a
    // long stay at the new level.
    let config = RankCollapseConfig {
        effective_rank_drop: 4.0,
        ..Default::default()
    };
    let mut d = RankCollapse::new(run(), config).unwrap();
    let value = |step: u64| match step {
        0..50 => 60.0,
        50..200 => 9.0,
        200..310 => 50.0 - (step - 200) as f64 / 11.0,
        310..340 => [20.0, 6.0, 2.0][((step - 310) / 10) as usize],
        _ => 1.0,
    };
    let events: Vec<Alert> = (0..60u64)
        .flat_map(|i| d.observe(&rank_obs(i * 10, value(i * 10))))
        .collect();
    let firing = fired(&events);
    assert_eq!(firing.len(), 1, "{events:#?}");
    let alert = firing[0];
    // 20 is 2.3× below the trailing median (not yet 4×); 6, 2 and 1 are the three breaches.
    assert_eq!(
        (alert.first_step, alert.last_step),
        (320, 340),
        "{alert:#?}"
    );
    assert_eq!(alert.severity, Severity::Warning);
    assert_eq!(alert.layer, Some(3));
    assert!(
        alert
            .explanation
            .contains("effective rank 1 of its linearised map")
            && alert.explanation.contains("the block keeps fewer"),
        "{}",
        alert.explanation
    );
    // The trailing window absorbs the new level: the alert resolves within the window.
    let resolved: Vec<&Alert> = events
        .iter()
        .filter(|a| a.state == AlertState::Resolved)
        .collect();
    assert_eq!(resolved.len(), 1, "{events:#?}");
    assert!(resolved[0].last_step <= 340 + 100, "{:#?}", resolved[0]);
}

#[test]
fn rank_collapse_effective_rank_test_is_off_by_default_and_rejects_an_incoherent_drop() {
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let events: Vec<Alert> = (20..40u64)
        .flat_map(|i| d.observe(&rank_obs(i * 10, if i < 30 { 50.0 } else { 1.0 })))
        .collect();
    assert!(events.is_empty(), "{events:#?}");
    let incoherent = RankCollapseConfig {
        effective_rank_drop: 1.0,
        ..Default::default()
    };
    let error = RankCollapse::new(run(), incoherent)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("effective_rank_drop 0 or > 1 + exit_margin"),
        "{error}"
    );
}

#[test]
fn rank_collapse_a_lasting_ratio_shift_fires_at_the_default_spectral_cadence() {
    // A probe every 50 steps (the SDK's default) puts 4 probes in the 200-step window: the
    // window keeps the last 7 instead, so a ×6 step stays out of the median for the 3
    // breaching probes that fire it — and the window absorbs it later, resolving the alert.
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let events: Vec<Alert> = (1..40u64)
        .flat_map(|i| {
            let step = i * 50;
            let ratio = if step < 1000 { 3.0 } else { 18.0 };
            d.observe(&CollapseObservation {
                step,
                time_ms: step as i64,
                layer: 0,
                ratio: Some(ratio),
                token_cosine: Some(0.2),
                effective_rank: None,
            })
        })
        .collect();
    let firing = fired(&events);
    assert_eq!(firing.len(), 1, "{events:#?}");
    assert_eq!((firing[0].first_step, firing[0].last_step), (1000, 1100));
    assert!(
        firing[0].explanation.contains("6× above its median 3"),
        "{}",
        firing[0].explanation
    );
    assert!(
        events.iter().any(|a| a.state == AlertState::Resolved),
        "{events:#?}"
    );
}

// ---------------------------------------------------------------------------------------------
// replica_divergence

fn starts_with(a: &Alert, prefix: &str) {
    assert!(a.explanation.starts_with(prefix), "{}", a.explanation);
}

/// `ranks` replicas of a 6-block model; `differ` gives (rank, blocks whose digest it changes,
/// whether the change lies outside the blocks).
fn replicas(step: u64, ranks: u32, differ: &[(u32, &[u32], bool)]) -> ReplicaObservation {
    ReplicaObservation {
        step,
        time_ms: step as i64 * 1000,
        world_size: ranks,
        ranks: (0..ranks)
            .map(|rank| {
                let change = differ.iter().find(|(r, _, _)| *r == rank);
                let layers = (0..6u32)
                    .map(|layer| {
                        let hit = change.is_some_and(|(_, blocks, _)| blocks.contains(&layer));
                        (
                            layer,
                            f64::from(1000 + layer) + if hit { f64::from(rank) + 0.5 } else { 0.0 },
                        )
                    })
                    .collect();
                let model = 7.0 + change.map_or(0.0, |_| f64::from(rank) + 0.25);
                RankFingerprint {
                    rank,
                    model,
                    locator: None,
                    layers,
                    optimizer: None,
                    optimizer_locator: None,
                    replica_set: None,
                }
            })
            .collect(),
        tensors: Vec::new(),
    }
}

/// Digest and locator of per-tensor sums as they travel (f64s).
fn digests_of(sums: &[i64]) -> (f64, f64) {
    let (d, l) = rankwatch_analytics::math::locator::digests(sums);
    (d as f64, l as f64)
}

/// Four replicas of a 5-tensor model with names; rank `rank`'s tensor `tensor` changed by `delta`
/// in its parameters or, with `optimizer`, in the state tensor at that position.
fn located_replicas(rank: u32, tensor: usize, delta: i64, optimizer: bool) -> ReplicaObservation {
    let sums: Vec<i64> = vec![-12, 1 << 30, 77, -(1 << 20), 5];
    let state: Vec<i64> = (0..5 * 8).map(|i| i * 31 - 400).collect();
    let names = [
        "wte.weight",
        "h.0.attn.weight",
        "h.0.mlp.weight",
        "h.1.mlp.weight",
        "ln_f.weight",
    ];
    ReplicaObservation {
        step: 30,
        time_ms: 30_000,
        world_size: 4,
        ranks: (0..4)
            .map(|r| {
                let (mut params, mut moments) = (sums.clone(), state.clone());
                if r == rank && optimizer {
                    moments[8 * tensor + 1] += delta; // its second state tensor (exp_avg_sq)
                } else if r == rank {
                    params[tensor] += delta;
                }
                let (model, locator) = digests_of(&params);
                let (state_digest, state_locator) = digests_of(&moments);
                RankFingerprint {
                    rank: r,
                    model,
                    locator: Some(locator),
                    layers: Vec::new(),
                    optimizer: Some(state_digest),
                    optimizer_locator: Some(state_locator),
                    replica_set: None,
                }
            })
            .collect(),
        tensors: names.iter().map(|n| n.to_string()).collect(),
    }
}

#[test]
fn replica_divergence_names_the_tensor_that_differs() {
    // A flip of bit 17 in one word of h.0.mlp.weight on rank 3.
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let obs = located_replicas(3, 2, 1 << 17, false);
    assert!(obs.disagree());
    let a = d.observe(&obs).into_iter().next().unwrap();
    assert_eq!(a.outlier_ranks, vec![3]);
    starts_with(
        &a,
        "rank 3's parameters differ from ranks 0, 1, 2 at step 30 in tensor h.0.mlp.weight: ",
    );
    // A flip that wraps the sum (bit 31 of a 32-bit word): still that tensor.
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let a = d
        .observe(&located_replicas(0, 4, -(1i64 << 31), false))
        .into_iter()
        .next()
        .unwrap();
    starts_with(
        &a,
        "rank 0's parameters differ from ranks 1, 2, 3 at step 30 in tensor ln_f.weight: ",
    );
    // Without the names the position is given.
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let mut obs = located_replicas(1, 3, -8, false);
    obs.tensors.clear();
    let a = d.observe(&obs).into_iter().next().unwrap();
    assert!(
        a.explanation
            .contains("in tensor #3 (the run sent no tensor names)"),
        "{}",
        a.explanation
    );
}

#[test]
fn replica_divergence_under_hsdp_compares_each_replica_set_alone() {
    // A 2 × 2 mesh: ranks 0 and 2 hold shard 0, ranks 1 and 3 shard 1. Different shards give
    // different digests, by design: no alert.
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let hsdp = |changed: Option<(u32, i64)>| {
        let mut obs = located_replicas(0, 0, 0, false);
        for r in &mut obs.ranks {
            let set = r.rank % 2;
            r.replica_set = Some(set);
            let mut sums: Vec<i64> = vec![-12, 1 << 30, 77, -(1 << 20), 5 + i64::from(set) * 1000];
            if let Some((_, delta)) = changed.filter(|(rank, _)| *rank == r.rank) {
                sums[1] += delta;
            }
            let (model, locator) = digests_of(&sums);
            (r.model, r.locator) = (model, Some(locator));
        }
        obs
    };
    assert!(d.observe(&hsdp(None)).is_empty(), "each set agrees within");
    let a = d
        .observe(&hsdp(Some((3, 1 << 4))))
        .into_iter()
        .next()
        .unwrap();
    assert_eq!(
        a.outlier_ranks,
        vec![1, 3],
        "both ranks of set 1: two replicas cannot tell"
    );
    starts_with(
        &a,
        "in replica set 1, the parameters of ranks 1, 3 differ at step 30 in tensor h.0.attn.weight; with two replicas",
    );
    // Without the declared sets, the same digests would read as a 2-2 split of the world.
    let mut undeclared = hsdp(None);
    for r in &mut undeclared.ranks {
        r.replica_set = None;
    }
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    assert_eq!(d.observe(&undeclared).len(), 1);
}

#[test]
fn replica_divergence_names_the_parameter_whose_optimizer_state_differs() {
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let a = d
        .observe(&located_replicas(2, 1, 1 << 9, true))
        .into_iter()
        .next()
        .unwrap();
    assert_eq!(a.outlier_ranks, vec![2]);
    starts_with(
        &a,
        "rank 2's optimizer state differs from ranks 0, 1, 3 at step 30 in the optimizer state of tensor h.0.attn.weight: ",
    );
}

#[test]
fn replica_divergence_in_several_tensors_falls_back_to_blocks() {
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let mut obs = located_replicas(2, 1, 1 << 9, false);
    // A second tensor of rank 2 changed too (a skipped step changes them all).
    let mut sums: Vec<i64> = vec![-12, (1 << 30) + (1 << 9), 77, -(1 << 20) - 3, 5];
    sums[0] += 1;
    let (model, locator) = digests_of(&sums);
    obs.ranks[2].model = model;
    obs.ranks[2].locator = Some(locator);
    obs.ranks[2].layers = vec![(0, 1.0), (1, 2.0)];
    for r in [0, 1, 3] {
        obs.ranks[r].layers = vec![(0, 1.0), (1, 3.0)];
    }
    let a = d.observe(&obs).into_iter().next().unwrap();
    starts_with(
        &a,
        "rank 2's parameters differ from ranks 0, 1, 3 at step 30 in block 1: ",
    );
}

#[test]
fn replica_divergence_names_the_minority_rank_and_its_blocks_at_the_first_step() {
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    assert!(
        d.observe(&replicas(10, 4, &[])).is_empty(),
        "agreeing replicas"
    );
    let events = d.observe(&replicas(20, 4, &[(2, &[1, 3, 4, 5], false)]));
    let firing = fired(&events);
    assert_eq!(firing.len(), 1, "{events:#?}");
    let a = firing[0];
    assert_eq!(
        (a.rule, a.severity, a.first_step, a.outlier_ranks.clone()),
        (Rule::ReplicaDivergence, Severity::Critical, 20, vec![2])
    );
    starts_with(
        a,
        "rank 2's parameters differ from ranks 0, 1, 3 at step 20 in blocks 1, 3, 4 and 1 more: ",
    );
    assert!(a.explanation.contains("likely silent data corruption"));
    // Still different: no new event; agreeing again (a restart from a good checkpoint): resolved.
    assert!(d.observe(&replicas(30, 4, &[(2, &[1], false)])).is_empty());
    let resolved = d.observe(&replicas(40, 4, &[]));
    assert_eq!(resolved.len(), 1);
    assert_eq!(resolved[0].state, AlertState::Resolved);
}

#[test]
fn replica_divergence_with_two_replicas_names_both_and_says_why() {
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let events = d.observe(&replicas(0, 2, &[(1, &[], true)]));
    let a = fired(&events)[0];
    assert_eq!(a.outlier_ranks, vec![0, 1]);
    starts_with(
        a,
        "the parameters of ranks 0, 1 differ at step 0 outside the blocks (embeddings, head or norms); with two replicas, which one changed cannot be told",
    );
}

#[test]
fn replica_divergence_without_a_majority_names_every_rank_outside_the_largest_group() {
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    // 0 and 1 agree, 2 and 3 each hold a digest of their own: no group above half.
    let events = d.observe(&replicas(5, 4, &[(2, &[0], false), (3, &[0], false)]));
    let a = fired(&events)[0];
    assert_eq!(a.outlier_ranks, vec![2, 3]);
    starts_with(
        a,
        "the replicas disagree with no majority at step 5 in block 0 ([0, 1] vs [2] vs [3])",
    );
    // Two against two: which pair changed cannot be told, every rank is named.
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let mut obs = replicas(5, 4, &[]);
    obs.ranks[2].model = 9.0;
    obs.ranks[3].model = 9.0;
    let a = d.observe(&obs).into_iter().next().unwrap();
    assert_eq!(a.outlier_ranks, vec![0, 1, 2, 3]);
    assert!(
        a.explanation.contains("([0, 1] vs [2, 3])"),
        "{}",
        a.explanation
    );
}

#[test]
fn replica_divergence_stays_silent_with_one_rank_or_equal_digests() {
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let mut one = replicas(3, 1, &[]);
    one.ranks[0].model = 12345.0;
    assert!(
        d.observe(&one).is_empty(),
        "one replica: nothing to compare"
    );
    for step in 0..100 {
        assert!(d.observe(&replicas(step, 8, &[])).is_empty());
    }
    assert!(d.open_alerts().is_empty());
}

proptest::proptest! {
    /// Any minority (fewer than half the replicas, each with digests of its own or shared) is
    /// named exactly, whatever the world size.
    #[test]
    fn replica_divergence_names_exactly_any_minority(
        world in 3u32..17,
        picks in proptest::collection::vec(0u32..16, 1..8),
        shared in proptest::bool::ANY,
    ) {
        let mut minority: Vec<u32> = picks.into_iter().map(|r| r % world).collect();
        minority.sort_unstable();
        minority.dedup();
        proptest::prop_assume!(minority.len() * 2 < world as usize);
        let mut obs = replicas(7, world, &[]);
        for r in &minority {
            obs.ranks[*r as usize].model = if shared { 99.0 } else { 100.0 + f64::from(*r) };
        }
        let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
        let events = d.observe(&obs);
        proptest::prop_assert_eq!(events.len(), 1);
        proptest::prop_assert_eq!(&events[0].outlier_ranks, &minority);
        proptest::prop_assert_eq!(events[0].severity, Severity::Critical);
    }
}

#[test]
fn replica_divergence_in_the_optimizer_state_alone_is_named_too() {
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let mut obs = replicas(100, 4, &[]);
    for r in &mut obs.ranks {
        r.optimizer = Some(if r.rank == 1 { 5.0 } else { 4.0 });
    }
    let a = d.observe(&obs).into_iter().next().unwrap();
    assert_eq!(a.outlier_ranks, vec![1]);
    starts_with(
        &a,
        "rank 1's optimizer state differs from ranks 0, 2, 3 at step 100 (the parameters still agree",
    );
    // The next fingerprint carries no optimizer digests (a tenth of the cadence): the
    // parameters agreeing there does not clear what the optimizer state showed.
    let mut without = replicas(110, 4, &[]);
    assert!(d.observe(&without).is_empty(), "held open");
    assert_eq!(d.open_alerts().len(), 1);
    // Agreeing optimizer digests do.
    without.step = 200;
    for r in &mut without.ranks {
        r.optimizer = Some(4.0);
    }
    let resolved = d.observe(&without);
    assert_eq!(resolved.len(), 1);
    assert_eq!(resolved[0].state, AlertState::Resolved);
}

#[test]
fn replica_divergence_judges_a_step_only_when_every_replica_sent_its_digest() {
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    assert_eq!(d.observe(&replicas(10, 4, &[(2, &[0], false)])).len(), 1);
    // Step 20 closed on its timeout without rank 2: the three that came agree, but that says
    // nothing about rank 2.
    let mut partial = replicas(20, 4, &[]);
    partial.ranks.remove(2);
    assert!(d.observe(&partial).is_empty(), "not judged");
    assert_eq!(d.open_alerts().len(), 1, "still open");
    // Three replicas of which one is missing are not two replicas.
    let mut d = ReplicaDivergence::new(run(), ReplicaDivergenceConfig::default()).unwrap();
    let mut three = replicas(30, 3, &[(2, &[0], false)]);
    three.ranks.remove(0);
    assert!(d.observe(&three).is_empty());
}

#[test]
fn the_stand_out_window_is_bounded_in_steps_and_sparse_logging_is_not_judged() {
    // Rank 3 off-task from step 0, its peers judged alone (the run-level test never starts).
    // Logged every step, the 50-step window judges once 40 steps are in; logged every 2nd or
    // 10th step, it never holds 40 observations, so it judges nothing — before, its 50
    // observations stretched over 100 or 500 steps. (The run of noted steps is off here; it
    // is bounded by the same window, below.)
    let config = SilentInconsistencyConfig {
        skip_steps: u64::MAX,
        peer_run: 0,
        ..SilentInconsistencyConfig::default()
    };
    let off_task = |_| Fault::LossOffset(3, 0.8);
    for (every, fires) in [(1u64, true), (2, false), (10, false)] {
        let events = run_dp_logged(config, 4, 1000, every, 41, off_task, |_, _| {});
        let first = events.iter().find(|(_, a)| a.state == AlertState::Firing);
        match (fires, first) {
            (true, Some((step, a))) => {
                assert!((41..=47).contains(step), "every {every}: fired at {step}");
                assert_eq!(a.outlier_ranks, vec![3]);
            }
            (false, None) => {}
            _ => panic!("logged every {every} step(s): {first:?}"),
        }
    }
    // Twelve noted steps in a row: logged every 2nd step they span 24 steps, inside the
    // window; logged every 10th, the window holds at most 5, so the run never reaches 12.
    let config = SilentInconsistencyConfig {
        skip_steps: u64::MAX,
        ..SilentInconsistencyConfig::default()
    };
    for (every, fired_at) in [(1u64, Some(14)), (2, Some(28)), (10, None)] {
        let events = run_dp_logged(config, 4, 1000, every, 41, off_task, |_, _| {});
        let first = events.iter().find(|(_, a)| a.state == AlertState::Firing);
        if let Some((_, a)) = first {
            assert_eq!(a.outlier_ranks, vec![3], "every {every}");
        }
        assert_eq!(
            first.map(|(step, _)| *step),
            fired_at,
            "logged every {every} step(s)"
        );
    }
}

#[test]
fn a_run_of_stand_outs_longer_than_the_window_or_of_one_step_is_refused() {
    // A run longer than the window could never breach; a run of one would breach on a single
    // chance note. Off (0) and the default pass.
    for (peer_run, ok) in [
        (0usize, true),
        (12, true),
        (50, true),
        (1, false),
        (51, false),
    ] {
        let config = SilentInconsistencyConfig {
            peer_run,
            ..SilentInconsistencyConfig::default()
        };
        match (config.validate(), ok) {
            (Ok(()), true) => {}
            (Err(e), false) => assert!(e.to_string().contains("peer_run"), "{e}"),
            (got, _) => panic!("peer_run {peer_run}: {got:?}"),
        }
    }
}

/// The early plateau of a healthy post-LN GPT (docs/detection.md § 2d, the shapes of the
/// regenerated twins): token states of the deep layers collapse near step 40 and stay at 0.999
/// until step 240, while a shallow layer sits at 0.85–0.95 outside the plateau and its
/// MLP/attention ratio falls 8 % every 10 steps. None of it is judged while a layer is still
/// in its plateau; once every layer is out, a later collapse (the learning-rate ramp's) is
/// critical against the spread the layer had since, and the ratio is judged from then on.
#[test]
fn rank_collapse_waits_out_a_healthy_early_plateau_and_judges_what_comes_after() {
    let deep_tc = |step: u64| match step {
        0..40 => 0.03 + step as f64 * 0.02,
        40..240 => 0.999,
        240..320 => 0.999 - (step - 240) as f64 * 0.0075,
        _ => 0.4,
    };
    let shallow_tc = |step: u64| match step {
        0..60 => 0.05 + step as f64 * 0.012,
        60..160 => 0.9 + 0.05 * ((step / 5) % 2) as f64 - 0.025,
        _ => 0.35,
    };
    let shallow_ratio = |step: u64| 2.0 * 0.92f64.powf(step.min(200) as f64 / 10.0);
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let mut events = Vec::new();
    let observe = |d: &mut RankCollapse, step: u64, collapse_from: Option<u64>| {
        let deep = match collapse_from {
            Some(from) if step >= from => 0.995,
            _ => deep_tc(step),
        };
        let mut out = d.observe(&collapse_obs(
            step,
            0,
            shallow_ratio(step),
            shallow_tc(step),
        ));
        out.extend(d.observe(&collapse_obs(step, 3, 1.5, deep)));
        out
    };
    for step in (0..=600).step_by(5) {
        events.extend(observe(&mut d, step, None));
    }
    assert!(fired(&events).is_empty(), "{:#?}", fired(&events));

    // The same run whose deep layer collapses at step 400, after the early phase ended (step
    // 270: the first probe with no layer at 0.8 or above since entering its plateau).
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let mut events = Vec::new();
    for step in (0..=500).step_by(5) {
        events.extend(observe(&mut d, step, Some(400)));
    }
    let hot = fired(&events);
    assert_eq!(hot.len(), 1, "{hot:#?}");
    assert_eq!(
        (hot[0].layer, hot[0].severity),
        (Some(3), Severity::Critical)
    );
    assert_eq!(hot[0].first_step, 400);
    assert!(
        hot[0]
            .explanation
            .contains("narrower than at its widest since step 270"),
        "{}",
        hot[0].explanation
    );
}

/// A step's layers arrive one by one: the first layer of the step the deep ones enter their
/// plateau cannot end the early phase for them (set 2's post-LN decoders, token cosine every
/// 25 steps: layer 0 at 0.6 arrived first at step 50, layers 2–4 entered at 0.99 after it).
#[test]
fn rank_collapse_early_phase_waits_for_every_layer_of_the_step() {
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let mut events = Vec::new();
    for step in (0..=400).step_by(25) {
        let (shallow, deep) = match step {
            0 => (0.02, 0.02),
            25 => (0.3, 0.3),
            50..=175 => (0.6 + 0.3 * ((step / 25) % 2) as f64, 0.999),
            _ => (0.3, 0.3),
        };
        // The shallow layer's ratio halves every 50 steps while the deep ones sit in their
        // plateau: a drift and a trend, were it judged.
        let ratio = 2.0 * 0.5f64.powf(step.min(200) as f64 / 50.0);
        events.extend(d.observe(&collapse_obs(step, 0, ratio, shallow)));
        for layer in 2..5 {
            events.extend(d.observe(&collapse_obs(step, layer, 1.0, deep)));
        }
    }
    assert!(fired(&events).is_empty(), "{:#?}", fired(&events));
}

/// Probes of one step arrive late and out of order (each rank's batch, the spectral probe
/// after the activations one): a ratio from before the early phase ended, arriving after it
/// ended, is neither judged nor kept in the layer's window.
#[test]
fn rank_collapse_late_probes_from_the_early_phase_stay_early() {
    let obs = |step: u64, ratio: Option<f64>, tc: Option<f64>| CollapseObservation {
        step,
        time_ms: step as i64,
        layer: 0,
        ratio,
        token_cosine: tc,
        effective_rank: None,
    };
    // The ratio triples every 10 steps up to step 45, then holds.
    let ratio = |step: u64| 3f64.powf(step.min(45) as f64 / 10.0);
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let mut events = Vec::new();
    for step in (0..=60).step_by(5) {
        events.extend(d.observe(&obs(step, None, Some(0.2))));
    }
    for step in (0..=60).step_by(5) {
        events.extend(d.observe(&obs(step, Some(ratio(step)), None)));
    }
    for step in (65..=300).step_by(5) {
        events.extend(d.observe(&obs(step, Some(ratio(step)), Some(0.2))));
    }
    assert!(fired(&events).is_empty(), "{:#?}", fired(&events));
}

/// Another rank's batch brings its layers' ratios for steps 50 and 75 before the rank that
/// measures token cosine has sent step 50, where the deep layers enter their plateau: ratios
/// do not end the early phase, so the shallow layer's falling ratio and rising cosine inside
/// it are not judged.
#[test]
fn rank_collapse_ratios_running_ahead_do_not_end_the_early_phase() {
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let ratio_only = |step: u64, layer: u32, ratio: f64| CollapseObservation {
        step,
        time_ms: step as i64,
        layer,
        ratio: Some(ratio),
        token_cosine: None,
        effective_rank: None,
    };
    let tc_only = |step: u64, layer: u32, tc: f64| CollapseObservation {
        step,
        time_ms: step as i64,
        layer,
        ratio: None,
        token_cosine: Some(tc),
        effective_rank: None,
    };
    let mut events = Vec::new();
    for layer in 0..3 {
        events.extend(d.observe(&tc_only(0, layer, 0.02)));
        events.extend(d.observe(&tc_only(25, layer, 0.3)));
    }
    // The ratio halves every 25 steps on layer 0 from step 50 on, and arrives a step ahead.
    let ratio = |step: u64| 2.0 * 0.5f64.powf(step.saturating_sub(50).min(150) as f64 / 25.0);
    for step in (50..=200).step_by(25) {
        events.extend(d.observe(&ratio_only(step, 0, ratio(step))));
        events.extend(d.observe(&ratio_only(step + 25, 0, ratio(step + 25))));
        let (shallow, deep) = if step <= 175 {
            (0.6, 0.999)
        } else {
            (0.3, 0.3)
        };
        events.extend(d.observe(&tc_only(step, 0, shallow)));
        for layer in 1..3 {
            events.extend(d.observe(&tc_only(step, layer, deep)));
        }
    }
    assert!(fired(&events).is_empty(), "{:#?}", fired(&events));
}

/// A layer whose token cosine stops coming in its plateau (its probe turned off) cannot keep
/// the run early for good: once its last probe is older than the plateau's persistence, the
/// phase ends and the other layers are judged again.
#[test]
fn rank_collapse_a_layer_that_stops_reporting_does_not_hold_the_early_phase() {
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let mut events = Vec::new();
    for step in (0..=1000).step_by(25) {
        // Layer 1 enters its plateau at step 25 and is last probed at step 100.
        if step <= 100 {
            let tc = if step == 0 { 0.02 } else { 0.999 };
            events.extend(d.observe(&collapse_obs(step, 1, 1.0, tc)));
        }
        // Layer 0 is healthy, until its ratio jumps ×10 at step 700.
        let ratio = if step >= 700 { 20.0 } else { 2.0 };
        events.extend(d.observe(&collapse_obs(step, 0, ratio, 0.2)));
    }
    let hot = fired(&events);
    assert!(!hot.is_empty(), "{events:#?}");
    assert_eq!(hot[0].layer, Some(0), "{hot:#?}");
    assert!(hot[0].first_step >= 700, "{hot:#?}");
}

/// A post-LN GPT with a long learning-rate warm-up (set 3's 6 × 48, 200 steps, token cosine
/// every 25 steps; tuning evidence since its table): at step 50, the first probe after the
/// warm-up, its layers are still climbing (0.29–0.80, from 0.05–0.07) and enter their plateau
/// at step 75. A layer whose spread narrowed twice within the last 25 steps keeps the run
/// early like a plateau, so nothing fires; with the climb test off, every layer did.
#[test]
fn rank_collapse_a_layer_climbing_toward_its_plateau_keeps_the_run_early() {
    let shapes: [&[f64]; 3] = [
        // Steps 0, 25, …, 400: layers 0, 3 and 5 of seed 3000.
        &[
            0.02, 0.05, 0.29, 0.71, 0.78, 0.81, 0.76, 0.76, 0.68, 0.67, 0.58, 0.52, 0.45, 0.45,
            0.44, 0.39, 0.39,
        ],
        &[
            0.02, 0.06, 0.61, 0.99, 0.98, 0.98, 0.92, 0.83, 0.62, 0.50, 0.39, 0.31, 0.28, 0.26,
            0.23, 0.21, 0.21,
        ],
        &[
            0.02, 0.07, 0.80, 1.00, 0.98, 1.00, 0.98, 0.91, 0.73, 0.61, 0.52, 0.47, 0.46, 0.45,
            0.43, 0.40, 0.42,
        ],
    ];
    // Probed every 25 steps, and every 50 (a climb then measured since the previous probe).
    for every in [1, 2] {
        let run_with = |config: RankCollapseConfig| {
            let mut d = RankCollapse::new(run(), config).unwrap();
            let mut events = Vec::new();
            for i in (0..shapes[0].len()).step_by(every) {
                for (layer, shape) in shapes.iter().enumerate() {
                    let step = i as u64 * 25;
                    events.extend(d.observe(&collapse_obs(step, layer as u32, 1.0, shape[i])));
                }
            }
            events
        };
        let events = run_with(RankCollapseConfig::default());
        let cadence = 25 * every;
        assert!(
            fired(&events).is_empty(),
            "every {cadence}: {:#?}",
            fired(&events)
        );
        let without = run_with(RankCollapseConfig {
            token_cosine_climb: 0.0,
            ..Default::default()
        });
        assert!(
            !fired(&without).is_empty(),
            "every {cadence}: the climb test does nothing"
        );
    }
}

#[test]
fn rank_collapse_waits_out_the_learning_rate_s_warm_up_and_only_its_first_rise() {
    // Steps 0, 25, …, 400: layers 0, 3 and 6 of set 4's post-LN 7 × 40 with a 300-step warm-up
    // (seed 4000), whose slow climb outran the token-cosine tests of early training.
    let shapes: [&[f64]; 3] = [
        &[
            0.034, 0.06, 0.176, 0.486, 0.709, 0.779, 0.791, 0.706, 0.654, 0.632, 0.747, 0.548,
            0.576, 0.463, 0.399, 0.418, 0.382,
        ],
        &[
            0.034, 0.065, 0.267, 0.879, 0.981, 0.988, 0.988, 0.894, 0.81, 0.735, 0.743, 0.524,
            0.476, 0.368, 0.319, 0.293, 0.259,
        ],
        &[
            0.034, 0.07, 0.374, 0.982, 0.999, 1.0, 1.0, 0.975, 0.947, 0.891, 0.829, 0.633, 0.577,
            0.494, 0.452, 0.461, 0.433,
        ],
    ];
    // Linear warm-up to step 300, cosine decay over 1,000 steps, and from step 550 a ×100
    // ramp (a mis-set schedule): a rise that is not a warm-up.
    let lr = |step: u64| {
        let s = step as f64;
        let base = if step < 300 {
            1.5e-3 * (s + 1.0) / 300.0
        } else {
            1.5e-3 * 0.5 * (1.0 + (std::f64::consts::PI * (s - 300.0) / 1000.0).cos())
        };
        base * if step >= 550 {
            1.0 + 99.0 * ((s - 550.0) / 100.0).min(1.0)
        } else {
            1.0
        }
    };
    // After the healthy part, layer 2 collapses under the ramp: token cosine to 0.97.
    let collapse = [0.45, 0.6, 0.8, 0.93, 0.96, 0.97, 0.97, 0.97, 0.97];
    let run_with = |config: RankCollapseConfig, report_lr: bool| {
        let mut d = RankCollapse::new(run(), config).unwrap();
        let mut events = Vec::new();
        for step in 0..=800u64 {
            if report_lr {
                // Three ranks, the last one a step behind.
                for rank_step in [step, step, step.saturating_sub(1)] {
                    d.observe_learning_rate(rank_step, lr(rank_step));
                }
            }
            if step % 25 != 0 {
                continue;
            }
            let i = (step / 25) as usize;
            for (layer, shape) in shapes.iter().enumerate() {
                let tc = match shape.get(i) {
                    Some(&tc) => tc,
                    None if layer == 2 && step >= 575 => {
                        collapse[(((step - 575) / 25) as usize).min(8)]
                    }
                    None => shape[shape.len() - 1],
                };
                events.extend(d.observe(&collapse_obs(step, layer as u32, 1.0, tc)));
            }
        }
        events
    };
    let events = run_with(RankCollapseConfig::default(), true);
    let firing = fired(&events);
    assert!(
        firing
            .iter()
            .all(|a| a.first_step >= 575 && a.layer == Some(2)),
        "{firing:#?}"
    );
    assert!(
        firing.iter().any(|a| a.severity == Severity::Critical),
        "the collapse under the ramp is not named: {events:#?}"
    );
    // Without the learning rate, or with the warm-up test off, the early phase ends before
    // the climb and the plateau fires (set 4's held-out false alerts).
    for (config, report_lr) in [
        (RankCollapseConfig::default(), false),
        (
            RankCollapseConfig {
                learning_rate_warmup: false,
                ..Default::default()
            },
            true,
        ),
    ] {
        let events = run_with(config, report_lr);
        assert!(
            fired(&events).iter().any(|a| a.first_step < 300),
            "the learning rate was not what held the phase: {:#?}",
            fired(&events)
        );
    }
}

/// One layer's probe of one step, split as the collector may receive it: the ratio and the
/// token cosine in one observation, or in two.
fn split_probes(
    ratios: &[Vec<f64>],
    cosines: &[Vec<f64>],
    codes: &[u8],
    every: u64,
) -> Vec<CollapseObservation> {
    let layers = ratios.len();
    let obs = |step: u64, layer: usize, ratio: Option<f64>, tc: Option<f64>| CollapseObservation {
        step,
        time_ms: step as i64 * 1000,
        layer: layer as u32,
        ratio,
        token_cosine: tc,
        effective_rank: None,
    };
    let mut out = Vec::new();
    let mut delayed: Vec<Option<(u64, f64)>> = vec![None; layers];
    for i in 0..ratios[0].len() {
        let step = i as u64 * every;
        for layer in 0..layers {
            let (r, t) = (ratios[layer][i], cosines[layer][i]);
            // The spectral probe reads back later than the activations: a ratio held from the
            // step before comes after this step's token cosine, and before this step's ratio.
            let held = delayed[layer].take();
            let code = match codes[i * layers + layer] {
                // Token cosine first while a ratio is held: the ratios stay in step order.
                0 | 2 if held.is_some() => 1,
                code => code,
            };
            match code {
                0 => out.push(obs(step, layer, Some(r), Some(t))),
                2 => {
                    out.push(obs(step, layer, Some(r), None));
                    out.push(obs(step, layer, None, Some(t)));
                }
                code => {
                    out.push(obs(step, layer, None, Some(t)));
                    if let Some((s, hr)) = held {
                        out.push(obs(s, layer, Some(hr), None));
                    }
                    if code == 3 {
                        delayed[layer] = Some((step, r));
                    } else {
                        out.push(obs(step, layer, Some(r), None));
                    }
                }
            }
        }
    }
    for (layer, held) in delayed.into_iter().enumerate() {
        if let Some((s, r)) = held {
            out.push(obs(s, layer, Some(r), None));
        }
    }
    out
}

/// What a run of `rank_collapse` raised: each alert that fired (layer, first step, the
/// gravest severity it reached, when it fired), and the (layer, first step) of those open at
/// the end.
type Verdicts = (
    Vec<(Option<u32>, u64, Severity, Option<i64>)>,
    Vec<(Option<u32>, u64)>,
);

fn collapse_verdicts(observations: &[CollapseObservation]) -> Verdicts {
    let mut d = RankCollapse::new(run(), RankCollapseConfig::default()).unwrap();
    let mut fired = std::collections::BTreeMap::new();
    for a in observations.iter().flat_map(|o| d.observe(o)) {
        if a.state == AlertState::Firing {
            let (severity, at) = fired
                .entry((a.layer, a.first_step))
                .or_insert((a.severity, a.fired_at_ms));
            *severity = (*severity).max(a.severity);
            *at = (*at).min(a.fired_at_ms);
        }
    }
    let fired = fired
        .into_iter()
        .map(|((layer, first), (severity, at))| (layer, first, severity, at))
        .collect();
    let mut open: Vec<_> = d
        .open_alerts()
        .iter()
        .map(|a| (a.layer, a.first_step))
        .collect();
    open.sort();
    (fired, open)
}

proptest::proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: 256, ..Default::default() })]
    /// A step's ratio and token cosine come in different reports: whether the collector sees
    /// them in one observation, token cosine first, ratio first, or the ratio a probe late,
    /// `rank_collapse` raises the same alerts at the same steps (persistence counts steps, a
    /// test clears only what it found, and the early phase's end takes in the ratios that
    /// came before it was known).
    #[test]
    fn rank_collapse_verdicts_do_not_depend_on_how_a_step_s_probes_were_batched(
        walks in proptest::collection::vec(proptest::collection::vec((-0.25..0.25f64, -0.12..0.12f64), 60), 2),
        codes in proptest::collection::vec(0u8..3, 120),
    ) {
        let mut ratios = Vec::new();
        let mut cosines = Vec::new();
        for walk in &walks {
            let (mut log_ratio, mut tc) = (0.0f64, 0.05f64);
            let (mut rs, mut ts) = (Vec::new(), Vec::new());
            for &(dr, dt) in walk {
                log_ratio += dr;
                tc = (tc + dt).clamp(0.0, 0.999);
                rs.push(log_ratio.exp());
                ts.push(tc);
            }
            ratios.push(rs);
            cosines.push(ts);
        }
        let merged = split_probes(&ratios, &cosines, &[0; 120], 5);
        let split = split_probes(&ratios, &cosines, &codes, 5);
        proptest::prop_assert_eq!(collapse_verdicts(&merged), collapse_verdicts(&split));
    }
}
