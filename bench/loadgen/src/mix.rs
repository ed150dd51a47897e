//! The agent's default report (`bench/agent_mix.json`), replayed by the shared rule of
//! `rankwatch_analytics::agent_mix`, its rows held as the agent's validated points' parts so
//! that a replayed row costs a clone, not a validation.

use std::path::Path;

use anyhow::Context;
use rankwatch_agent::{Metric, Point};
use rankwatch_analytics::agent_mix::{AgentMix, CapturedRow};

/// A captured row as the agent would hold it.
pub(crate) type AgentRow = (Metric, CapturedRow);

/// The captured period, loaded from `path`.
pub(crate) fn load(path: &Path) -> anyhow::Result<AgentMix<AgentRow>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mix = AgentMix::parse(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(mix.map_rows(|row| Metric::new(row.metric.as_str()).map(|m| (m, row)))?)
}

/// What rank `rank` of a `ranks`-rank job sends at `step`, as the agent's points, and whether
/// a gradient sketch goes with it.
pub(crate) fn report(
    mix: &AgentMix<AgentRow>,
    rank: u32,
    step: u64,
    ranks: u32,
) -> (Vec<Point>, bool) {
    let (rows, sketch) = mix.report(rank, step, ranks);
    let points = rows
        .into_iter()
        .map(|r| {
            let (metric, row) = r.row;
            Point {
                metric: metric.clone(),
                rank: r.rank,
                layer: row.layer,
                site: row.site,
                value: row.value * r.scale,
            }
        })
        .collect();
    (points, sketch)
}
