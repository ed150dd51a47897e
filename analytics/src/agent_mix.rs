//! The agent's default report as it was captured from a real training job
//! (`bench/agent_mix.json`, written by `bench/agent_mix.py capture`), replayed at any number of
//! ranks for the benchmarks that stand in for many agents: the alert engine's
//! (`collector/benches/engine.rs`) and the operator's load generator (`bench/loadgen`). The
//! replay rule is the Python benches' (`agent_mix.report`): rank `r` sends what rank
//! `r mod world` of the capture sent at `step mod period`, and the rank-less layer rows (the
//! spectral probe's) are sent by rank `layer mod ranks`.
//!
//! Except its loss and gradient norm: replica `g = r div world` of a captured rank sends the
//! values that rank had `g` steps later in the period (see [`AgentMix::report`]). Replayed
//! as captured, groups of ranks would agree to the bit at every step, which healthy ranks never
//! do: the identical-data test would name them at every step and the benches would time an
//! alert no healthy job raises. Read `g` steps on, each replica's values are the captured
//! rank's on other batches of the same flat stretch of training, as different from its peers'
//! as real ranks' are.
//!
//! The load generator keeps the rows in its own form ([`AgentMix::map_rows`]: the agent's
//! validated `Point` parts), converted once at load, not per replayed row; the collector's
//! benches (engine, flush) take each report as samples ([`AgentMix::samples`]) while they
//! build their input, before anything is measured.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::math::sketch::{SketchKind, gaussian_vector};
use crate::{MetricName, RunId, Sample, Site, SketchRecord};

/// A captured row, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct CapturedRow {
    pub metric: MetricName,
    pub layer: Option<u32>,
    pub site: Option<Site>,
    pub value: f64,
}

/// The captured period, its rows in the form `R`.
#[derive(Debug, Clone)]
pub struct AgentMix<R = CapturedRow> {
    world: u32,
    period: Vec<MixStep<R>>,
}

#[derive(Debug, Clone)]
struct MixStep<R> {
    /// By captured rank, its rows.
    ranks: Vec<Vec<MixRow<R>>>,
    /// Captured ranks that sent a gradient sketch at this step.
    sketches: Vec<u32>,
}

/// A row of the period with what the replay needs to know of it.
#[derive(Debug, Clone)]
struct MixRow<R> {
    /// Whether it carries its rank (else it is a layer row of the spectral probe).
    ranked: bool,
    layer: Option<u32>,
    /// Which per-batch value it is, if one a replica takes from a later step.
    batch_value: Option<BatchValue>,
    row: R,
}

/// The values a replica reads from a later step of the period: the ones that come from the
/// rank's own batch and that the identical-data test compares to the bit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BatchValue {
    Loss,
    GradNorm,
}

impl BatchValue {
    fn of(metric: &str) -> Option<BatchValue> {
        match metric {
            "loss" => Some(BatchValue::Loss),
            "grad_norm" => Some(BatchValue::GradNorm),
            _ => None,
        }
    }
}

/// One row of a replayed report.
#[derive(Debug, Clone, Copy)]
pub struct Replayed<'a, R> {
    /// The rank it carries (`None` for a layer row of the spectral probe).
    pub rank: Option<u32>,
    pub row: &'a R,
    /// What the row's value is multiplied by: 1 but for the replicas past `world · period`
    /// ranks, whose loss and gradient norm repeat those of a rank `world · period` before
    /// them and move by `(rank div (world · period)) · 2⁻⁴⁰` of themselves so no two agree
    /// to the bit.
    pub scale: f64,
}

/// (has a rank, metric, layer, site, value), as the file holds it.
type FileRow = (bool, String, Option<u32>, Option<String>, f64);

#[derive(Deserialize)]
struct File {
    world: u32,
    period: Vec<FileStep>,
}

#[derive(Deserialize)]
struct FileStep {
    ranks: Vec<Vec<FileRow>>,
    sketches: Vec<u32>,
}

impl AgentMix {
    /// Reads the capture's JSON; a name, site or shape that is not valid is an error naming it.
    pub fn parse(json: &str) -> Result<AgentMix> {
        let bad = |reason: String| Error::Config(format!("agent mix: {reason}"));
        let file: File = serde_json::from_str(json).map_err(|e| bad(e.to_string()))?;
        if file.world == 0 || file.period.is_empty() {
            return Err(bad("no world or no period".into()));
        }
        let row = |(ranked, metric, layer, site, value): &FileRow| -> Result<MixRow<CapturedRow>> {
            let site = site.as_deref().map(str::parse::<Site>).transpose()?;
            let batch_value = if *ranked {
                BatchValue::of(metric)
            } else {
                None
            };
            let metric = MetricName::new(metric.as_str())?;
            let row = CapturedRow {
                metric,
                layer: *layer,
                site,
                value: *value,
            };
            Ok(MixRow {
                ranked: *ranked,
                layer: *layer,
                batch_value,
                row,
            })
        };
        let mut period = Vec::with_capacity(file.period.len());
        for step in &file.period {
            if step.ranks.len() != file.world as usize {
                return Err(bad(format!(
                    "a step with {} ranks in a world of {}",
                    step.ranks.len(),
                    file.world
                )));
            }
            let ranks = step
                .ranks
                .iter()
                .map(|rows| rows.iter().map(row).collect::<Result<Vec<_>>>())
                .collect::<Result<Vec<_>>>()?;
            period.push(MixStep {
                ranks,
                sketches: step.sketches.clone(),
            });
        }
        Ok(AgentMix {
            world: file.world,
            period,
        })
    }
}

impl<R> AgentMix<R> {
    /// The same mix with every row converted once by `f`.
    pub fn map_rows<S, E>(
        self,
        mut f: impl FnMut(R) -> std::result::Result<S, E>,
    ) -> std::result::Result<AgentMix<S>, E> {
        let mut period = Vec::with_capacity(self.period.len());
        for step in self.period {
            let ranks = step
                .ranks
                .into_iter()
                .map(|rows| {
                    rows.into_iter()
                        .map(|r| {
                            Ok(MixRow {
                                ranked: r.ranked,
                                layer: r.layer,
                                batch_value: r.batch_value,
                                row: f(r.row)?,
                            })
                        })
                        .collect()
                })
                .collect::<std::result::Result<Vec<_>, E>>()?;
            period.push(MixStep {
                ranks,
                sketches: step.sketches,
            });
        }
        Ok(AgentMix {
            world: self.world,
            period,
        })
    }

    /// The captured world size.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// Steps in the captured period.
    pub fn period(&self) -> usize {
        self.period.len()
    }

    /// What rank `rank` of a `ranks`-rank job sends at `step`, and whether a gradient sketch
    /// goes with it. The rows are those captured rank `rank mod world` sent at `step mod
    /// period`, but for the loss and gradient norm of a replica (`g = rank div world` > 0):
    /// those are the captured rank's at step `(step + g) mod period`, scaled as
    /// [`Replayed::scale`] says. Then the layer rows this rank measures.
    pub fn report(&self, rank: u32, step: u64, ranks: u32) -> (Vec<Replayed<'_, R>>, bool) {
        let period = self.period.len() as u64;
        let entry = &self.period[(step % period) as usize];
        let own = rank % self.world;
        let replica = u64::from(rank / self.world);
        let later = &self.period[((step + replica) % period) as usize].ranks[own as usize];
        // Past world · period ranks the values repeat; a shift below the loss's last bits keeps
        // them apart.
        let scale = 1.0 + (replica / period) as f64 * 2f64.powi(-40);
        let mut rows: Vec<Replayed<'_, R>> = entry.ranks[own as usize]
            .iter()
            .filter(|r| r.ranked)
            .map(|r| {
                let moved = r
                    .batch_value
                    .filter(|_| replica > 0)
                    .and_then(|value| later.iter().find(|l| l.batch_value == Some(value)));
                match moved {
                    Some(l) => Replayed {
                        rank: Some(rank),
                        row: &l.row,
                        scale,
                    },
                    None => Replayed {
                        rank: Some(rank),
                        row: &r.row,
                        scale: 1.0,
                    },
                }
            })
            .collect();
        rows.extend(
            entry
                .ranks
                .iter()
                .flatten()
                .filter(|r| !r.ranked && r.layer.is_some_and(|l| l % ranks == rank))
                .map(|r| Replayed {
                    rank: None,
                    row: &r.row,
                    scale: 1.0,
                }),
        );
        (rows, entry.sketches.contains(&own))
    }

    /// Mean rows a rank sends a step, over the period (at the captured world size).
    pub fn rows_per_rank_step(&self) -> f64 {
        let rows: usize = self
            .period
            .iter()
            .flat_map(|s| &s.ranks)
            .map(Vec::len)
            .sum();
        rows as f64 / self.period.len() as f64 / f64::from(self.world)
    }
}

impl AgentMix {
    /// [`AgentMix::report`] as samples of `run` stamped `time_ms` (the collector's benches).
    pub fn samples(
        &self,
        run: &RunId,
        rank: u32,
        step: u64,
        ranks: u32,
        time_ms: i64,
    ) -> (Vec<Sample>, bool) {
        let (rows, sketch) = self.report(rank, step, ranks);
        let samples = rows
            .into_iter()
            .map(|Replayed { rank, row, scale }| Sample {
                run: run.clone(),
                rank,
                step,
                time_ms,
                metric: row.metric.clone(),
                layer: row.layer,
                site: row.site,
                value: row.value * scale,
            })
            .collect();
        (samples, sketch)
    }
}

/// A gradient sketch of `rank` at `step` whose ranks agree as data-parallel replicas do: a
/// direction shared by every rank at the step plus the rank's own, weighted `own`.
pub fn replica_sketch(
    run: &RunId,
    rank: u32,
    step: u64,
    time_ms: i64,
    kind: SketchKind,
    dim: usize,
    own: f64,
) -> SketchRecord {
    let shared = gaussian_vector(step as u32, dim);
    let mine = gaussian_vector(1_000_000 + rank, dim);
    let vector: Vec<f32> = shared
        .iter()
        .zip(&mine)
        .map(|(a, b)| (a + own * b) as f32)
        .collect();
    let norm = vector
        .iter()
        .map(|v| f64::from(*v).powi(2))
        .sum::<f64>()
        .sqrt();
    SketchRecord {
        run: run.clone(),
        rank,
        step,
        time_ms,
        kind,
        seed: 7,
        norm,
        vector,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix() -> AgentMix {
        AgentMix::parse(include_str!("../../bench/agent_mix.json")).unwrap()
    }

    #[test]
    fn at_the_captured_world_size_the_replay_is_the_capture() {
        let mix = mix();
        let world = mix.world;
        let sent: usize = (0..mix.period.len() as u64)
            .flat_map(|step| (0..world).map(move |rank| (rank, step)))
            .map(|(rank, step)| mix.report(rank, step, world).0.len())
            .sum();
        let captured: usize = mix.period.iter().flat_map(|s| &s.ranks).map(Vec::len).sum();
        assert_eq!(sent, captured);
        let per = sent as f64 / (mix.period.len() as f64 * f64::from(world));
        assert!((per - mix.rows_per_rank_step()).abs() < 1e-12, "{per}");
    }

    #[test]
    fn at_more_ranks_each_sends_its_residues_rows_and_the_layer_rows_go_to_one_rank_each() {
        let mix = mix();
        let ranks = 64;
        for step in 0..mix.period.len() as u64 {
            let mut layer_rows = 0;
            for rank in 0..ranks {
                let (rows, _) = mix.report(rank, step, ranks);
                for r in &rows {
                    match r.rank {
                        Some(r) => assert_eq!(r, rank),
                        None => {
                            assert_eq!(r.row.layer.map(|l| l % ranks), Some(rank));
                            layer_rows += 1;
                        }
                    }
                }
                let own = &mix.period[step as usize].ranks[(rank % mix.world) as usize];
                let ranked = rows.iter().filter(|r| r.rank.is_some()).count();
                assert_eq!(ranked, own.iter().filter(|r| r.ranked).count());
            }
            let captured = mix.period[step as usize]
                .ranks
                .iter()
                .flatten()
                .filter(|r| !r.ranked)
                .count();
            assert_eq!(layer_rows, captured, "step {step}");
        }
    }

    #[test]
    fn replicas_send_their_captured_rank_s_values_of_later_steps_and_no_two_agree_to_the_bit() {
        let mix = mix();
        let run = RunId::new("mix").unwrap();
        let period = mix.period.len() as u64;
        // Past world · period ranks the values repeat, scaled.
        let ranks = 1024;
        let captured = |rank: u32, step: u64, metric: &str| {
            mix.period[(step % period) as usize].ranks[(rank % mix.world) as usize]
                .iter()
                .find(|r| r.ranked && r.row.metric.as_str() == metric)
                .map(|r| r.row.value)
        };
        for step in 0..period {
            let mut seen = std::collections::HashMap::new();
            for rank in 0..ranks {
                let (samples, _) = mix.samples(&run, rank, step, ranks, 0);
                let sent = |metric: &str| {
                    samples
                        .iter()
                        .find(|s| s.rank.is_some() && s.metric.as_str() == metric)
                        .map(|s| s.value)
                };
                let replica = u64::from(rank / mix.world);
                for metric in ["loss", "grad_norm"] {
                    let was = captured(rank, step + replica, metric).unwrap();
                    let now = sent(metric).unwrap();
                    if replica < period {
                        assert_eq!(now.to_bits(), was.to_bits(), "{metric} of rank {rank}");
                    } else {
                        assert!(((now - was) / was).abs() <= 1e-10, "{metric} {now} {was}");
                    }
                }
                // Everything else is what the captured rank sent at this very step.
                let (rows, _) = mix.report(rank, step, ranks);
                let own = &mix.period[step as usize].ranks[(rank % mix.world) as usize];
                let others = own
                    .iter()
                    .filter(|r| r.ranked && r.batch_value.is_none())
                    .map(|r| (r.row.metric.as_str(), r.row.value.to_bits()));
                let replayed = rows
                    .iter()
                    .filter(|r| r.rank.is_some() && BatchValue::of(r.row.metric.as_str()).is_none())
                    .map(|r| (r.row.metric.as_str(), (r.row.value * r.scale).to_bits()));
                assert!(others.eq(replayed), "rank {rank} at {step}");
                let key = (
                    sent("loss").unwrap().to_bits(),
                    sent("grad_norm").unwrap().to_bits(),
                );
                assert_eq!(
                    seen.insert(key, rank),
                    None,
                    "rank {rank} repeats at {step}"
                );
            }
        }
    }
}
