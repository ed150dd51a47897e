//! The agent's default report as it was captured from a real training job
//! (`bench/agent_mix.json`, written by `bench/agent_mix.py capture`), replayed at any number of
//! ranks for the benchmarks that stand in for many agents: the alert engine's
//! (`collector/benches/engine.rs`) and the operator's load generator (`bench/loadgen`). The
//! replay rule is the Python benches' (`agent_mix.report`): rank `r` sends what rank
//! `r mod world` of the capture sent at `step mod period`, and the rank-less layer rows (the
//! spectral probe's) are sent by rank `layer mod ranks`.
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
    row: R,
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

    /// What rank `rank` of a `ranks`-rank job sends at `step`: each row with the rank it carries
    /// (`None` for a layer row of the spectral probe), and whether a gradient sketch goes with
    /// it.
    pub fn report(&self, rank: u32, step: u64, ranks: u32) -> (Vec<(Option<u32>, &R)>, bool) {
        let entry = &self.period[(step % self.period.len() as u64) as usize];
        let own = rank % self.world;
        let mut rows: Vec<(Option<u32>, &R)> = entry.ranks[own as usize]
            .iter()
            .filter(|r| r.ranked)
            .map(|r| (Some(rank), &r.row))
            .collect();
        rows.extend(
            entry
                .ranks
                .iter()
                .flatten()
                .filter(|r| !r.ranked && r.layer.is_some_and(|l| l % ranks == rank))
                .map(|r| (None, &r.row)),
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
            .map(|(rank, row)| Sample {
                run: run.clone(),
                rank,
                step,
                time_ms,
                metric: row.metric.clone(),
                layer: row.layer,
                site: row.site,
                value: row.value,
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
                for (r, row) in &rows {
                    match r {
                        Some(r) => assert_eq!(*r, rank),
                        None => {
                            assert_eq!(row.layer.map(|l| l % ranks), Some(rank));
                            layer_rows += 1;
                        }
                    }
                }
                let own = &mix.period[step as usize].ranks[(rank % mix.world) as usize];
                let ranked = rows.iter().filter(|(r, _)| r.is_some()).count();
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
}
