//! A simulated 8-rank training run with scripted trouble, fed through every detector; each
//! alert is printed as it changes state. This is what `cargo xtask demo` runs until the
//! collector and the SDK exist; it shows the domain logic alone, with no I/O.
//!
//! Script: rank 5's local gradient is silently scaled ×3 from step 150 to 219; layer 3's
//! MLP/attention spectral ratio drifts up from step 100 and its token cosine follows; rank 2
//! reports NaN at step 300.

use rankwatch_analytics::alert::{Alert, AlertState};
use rankwatch_analytics::detect::*;
use rankwatch_analytics::simulate::{DataParallelSim, Fault, Noise};
use rankwatch_analytics::{Result, RunId};

fn print(step: u64, alert: &Alert) {
    let state = match alert.state {
        AlertState::Resolved if !alert.has_fired() => "withdrawn",
        state => state.as_str(),
    };
    let text = if alert.state == AlertState::Resolved {
        format!(
            "cleared (steps {}–{}); was: {}",
            alert.first_step, alert.last_step, alert.explanation
        )
    } else {
        alert.explanation.clone()
    };
    println!(
        "step {step:>4}  {state:<9} {:<8} {:<20} {text}",
        alert.severity.as_str(),
        alert.rule.as_str(),
    );
}

fn main() -> Result<()> {
    let run = RunId::new("demo-simulated")?;
    let config = DetectorsConfig::default();
    let mut consistency = SilentInconsistency::new(run.clone(), config.silent_inconsistency)?;
    let mut collapse = RankCollapse::new(run.clone(), config.rank_collapse)?;
    let mut nonfinite = Nonfinite::new(run.clone(), config.nonfinite)?;
    let mut sim = DataParallelSim::new(8, 1024, 42);
    let mut noise = Noise::new(7);
    println!("simulating 8 ranks × 400 steps; spectral probes every 10 steps on 4 layers\n");
    for step in 0..400u64 {
        let fault = if (150..220).contains(&step) {
            Fault::ScaleGradient(5, 3.0)
        } else {
            Fault::None
        };
        let obs = sim.step(step, fault);
        let mut changed = consistency.observe(&obs);
        for r in &obs.ranks {
            let nan = r.rank == 2 && step == 300;
            changed.extend(nonfinite.observe(&NonfiniteObservation {
                step,
                time_ms: obs.time_ms,
                rank: Some(r.rank),
                count: u64::from(nan),
                loss: if nan { Some(f64::NAN) } else { r.loss },
            }));
        }
        if step % 10 == 0 {
            for layer in 0..4 {
                let drift = if layer == 3 && step >= 100 {
                    0.03 * (step - 100) as f64 / 10.0
                } else {
                    0.0
                };
                let ratio = (drift + 0.03 * noise.next_value()).exp();
                let token_cosine = 0.3 + 0.6 * (drift / 1.2).min(1.0) + 0.01 * noise.next_value();
                changed.extend(collapse.observe(&CollapseObservation {
                    step,
                    time_ms: obs.time_ms,
                    layer,
                    ratio: Some(ratio),
                    token_cosine: Some(token_cosine),
                    effective_rank: None,
                }));
            }
        }
        for alert in &changed {
            print(step, alert);
        }
    }
    let open = [
        consistency.open_alerts(),
        collapse.open_alerts(),
        nonfinite.open_alerts(),
    ]
    .concat();
    println!("\n{} alert(s) still open at the end of the run", open.len());
    Ok(())
}
