//! The agent's default report (`bench/agent_mix.json`, captured by `bench/agent_mix.py` from a
//! real training job), replayed at any number of ranks exactly as the Python benches replay
//! it: rank `r` sends what rank `r mod world` of the capture sent at `step mod period`, and
//! the rank-less layer rows (the spectral probe's) are sent by rank `layer mod ranks`.

use std::path::Path;

use anyhow::{Context, bail};
use rankwatch_agent::{Metric, Point};
use rankwatch_analytics::Site;
use serde::Deserialize;

/// A captured row: (has a rank, metric, layer, site, value).
type Captured = (bool, String, Option<u32>, Option<String>, f64);

#[derive(Deserialize)]
struct File {
    world: usize,
    period: Vec<FileStep>,
}

#[derive(Deserialize)]
struct FileStep {
    ranks: Vec<Vec<Captured>>,
    sketches: Vec<usize>,
}

/// One row of the period, validated once.
#[derive(Clone)]
struct Row {
    ranked: bool,
    metric: Metric,
    layer: Option<u32>,
    site: Option<Site>,
    value: f64,
}

struct Step {
    /// By captured rank.
    ranks: Vec<Vec<Row>>,
    /// Captured ranks that sent a gradient sketch at this step.
    sketches: Vec<usize>,
}

/// The captured period.
pub(crate) struct Mix {
    world: usize,
    period: Vec<Step>,
}

/// What one rank sends at one step.
pub(crate) struct Report {
    pub(crate) points: Vec<Point>,
    pub(crate) sketch: bool,
}

impl Mix {
    pub(crate) fn load(path: &Path) -> anyhow::Result<Mix> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let file: File =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if file.world == 0 || file.period.is_empty() {
            bail!("{}: no world or no period", path.display());
        }
        let row = |c: &Captured| -> anyhow::Result<Row> {
            let site = match &c.3 {
                Some(s) => Some(s.parse::<Site>().map_err(|e| anyhow::anyhow!("{e}"))?),
                None => None,
            };
            Ok(Row {
                ranked: c.0,
                metric: Metric::new(&c.1)?,
                layer: c.2,
                site,
                value: c.4,
            })
        };
        let mut period = Vec::with_capacity(file.period.len());
        for step in &file.period {
            if step.ranks.len() != file.world {
                bail!(
                    "{}: a step with {} ranks in a world of {}",
                    path.display(),
                    step.ranks.len(),
                    file.world
                );
            }
            let ranks = step
                .ranks
                .iter()
                .map(|rows| rows.iter().map(row).collect::<anyhow::Result<Vec<_>>>())
                .collect::<anyhow::Result<Vec<_>>>()?;
            period.push(Step {
                ranks,
                sketches: step.sketches.clone(),
            });
        }
        Ok(Mix {
            world: file.world,
            period,
        })
    }

    /// What rank `rank` of a `ranks`-rank job sends at `step`.
    pub(crate) fn report(&self, rank: u32, step: u64, ranks: u32) -> Report {
        let entry = &self.period[(step % self.period.len() as u64) as usize];
        let own = rank as usize % self.world;
        let point = |r: &Row, rank: Option<u32>| Point {
            metric: r.metric.clone(),
            rank,
            layer: r.layer,
            site: r.site,
            value: r.value,
        };
        let mut points: Vec<Point> = entry.ranks[own]
            .iter()
            .filter(|r| r.ranked)
            .map(|r| point(r, Some(rank)))
            .collect();
        points.extend(
            entry
                .ranks
                .iter()
                .flatten()
                .filter(|r| !r.ranked && r.layer.is_some_and(|l| l % ranks == rank))
                .map(|r| point(r, None)),
        );
        Report {
            points,
            sketch: entry.sketches.contains(&own),
        }
    }

    /// Mean rows a rank sends a step, over the period (at the captured world size).
    pub(crate) fn rows_per_rank_step(&self) -> f64 {
        let rows: usize = self
            .period
            .iter()
            .flat_map(|s| &s.ranks)
            .map(Vec::len)
            .sum();
        rows as f64 / self.period.len() as f64 / self.world as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix() -> Mix {
        Mix::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../agent_mix.json")).unwrap()
    }

    #[test]
    fn at_the_captured_world_size_the_replay_is_the_capture() {
        let mix = mix();
        let world = mix.world as u32;
        let sent: usize = (0..mix.period.len() as u64)
            .flat_map(|step| (0..world).map(move |rank| (rank, step)))
            .map(|(rank, step)| mix.report(rank, step, world).points.len())
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
                let report = mix.report(rank, step, ranks);
                for p in &report.points {
                    match p.rank {
                        Some(r) => assert_eq!(r, rank),
                        None => {
                            assert_eq!(p.layer.map(|l| l % ranks), Some(rank));
                            layer_rows += 1;
                        }
                    }
                }
                let own = &mix.period[step as usize].ranks[rank as usize % mix.world];
                let ranked = report.points.iter().filter(|p| p.rank.is_some()).count();
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
