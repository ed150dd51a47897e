//! The shaped answers of the read API: series, heatmap, workers, runs and catalog.

use std::collections::{BTreeMap, BTreeSet};

use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, UInt32Type};
use arrow_array::{Array, RecordBatch};
use datafusion::prelude::{col, lit};
use rankwatch_analytics::math::cosine::{cos_pair_mean, sketch_cosine_matrix};
use rankwatch_analytics::{MetricName, RunId, Site};
use rankwatch_api::{
    Catalog, CatalogMetric, Cosine, CosineMatrix, Heatmap, MetricScope, Num, RunSummary, Runs,
    Series, SeriesAnswer, WorkerMetric, Workers,
};
use serde::Deserialize;

use super::Queries;
use super::downsample::{Buckets, Cell, render};
use super::parts::{Pick, Selector};
use super::plan::{Grid, Read};
use crate::entry::Table;
use crate::error::{Error, Result};

/// Most points a series or heatmap may ask for.
pub const MAX_POINTS: usize = 10_000;
/// Most series one `series` answer may hold.
pub const MAX_SERIES: usize = 512;
/// A rank this many steps behind the newest is left out of "latest step" for workers.
const STALE_STEPS: u64 = 1_000;

/// (layer, site, rank) of one series of a metric.
type SeriesId = (Option<u32>, Option<String>, Option<u32>);
/// (metric, layer, site) of one per-rank series at a step.
type WorkerSeries = (String, Option<u32>, Option<String>);
/// A catalog entry being built: layers, sites, ranks, series count.
type CatalogEntry = (BTreeSet<u32>, BTreeSet<&'static str>, BTreeSet<u32>, usize);

/// Parameters of `GET /runs/{run}/series`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeriesQuery {
    pub metric: String,
    pub layer: Option<u32>,
    pub site: Option<String>,
    pub rank: Option<u32>,
    pub from: Option<u64>,
    pub to: Option<u64>,
    pub points: Option<usize>,
}

/// Parameters of `GET /runs/{run}/heatmap`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeatmapQuery {
    pub metric: String,
    pub site: Option<String>,
    pub rank: Option<u32>,
    pub from: Option<u64>,
    pub to: Option<u64>,
    pub points: Option<usize>,
}

/// Parameters of `GET /runs/{run}/workers`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkersQuery {
    pub step: Option<u64>,
}

fn points(p: Option<usize>) -> Result<usize> {
    let p = p.unwrap_or(1000);
    if p == 0 || p > MAX_POINTS {
        return Err(Error::bad(format!(
            "points must be between 1 and {MAX_POINTS}, got {p}"
        )));
    }
    Ok(p)
}

/// The `site` parameter, parsed.
fn site(s: Option<&str>) -> Result<Option<Site>> {
    Ok(s.map(str::parse::<Site>)
        .transpose()
        .map_err(rankwatch_analytics::Error::from)?)
}

impl Queries {
    pub(crate) fn known_run(&self, run: &str) -> Result<RunId> {
        let run = RunId::new(run)?;
        if self.store().with_runs(|r| r.contains_key(&run)) {
            Ok(run)
        } else {
            Err(Error::UnknownRun(run.to_string()))
        }
    }

    /// Step range to use: the request's, else the run's.
    pub(super) fn range(
        &self,
        run: &RunId,
        from: Option<u64>,
        to: Option<u64>,
    ) -> Result<(u64, u64)> {
        let (first, last) = self
            .store()
            .with_runs(|r| r.get(run).map(|s| (s.first_step, s.last_step)))
            .unwrap_or((None, None));
        let from = from.or(first).unwrap_or(0);
        let to = to.or(last).unwrap_or(from);
        if from > to {
            return Err(Error::bad(format!("from ({from}) is after to ({to})")));
        }
        Ok((from, to))
    }

    /// `GET /runs/{run}/series`.
    pub async fn series(&self, run: &str, q: SeriesQuery) -> Result<SeriesAnswer> {
        let run = self.known_run(run)?;
        let metric = MetricName::new(q.metric)?;
        let site = site(q.site.as_deref())?;
        let points = points(q.points)?;
        let (from, to) = self.range(&run, q.from, q.to)?;
        let select = Selector {
            metric: metric.to_string(),
            layer: q.layer.map_or(Pick::Any, Pick::Is),
            site: site.map_or(Pick::Any, |s| Pick::Is(s.as_str().to_owned())),
            rank: q.rank.map_or(Pick::Any, Pick::Is),
        };
        let buckets = Buckets::new(from, to, points as u64);
        let key = |b: &RecordBatch, i: usize| -> SeriesId {
            let layer = b.column(0).as_primitive::<UInt32Type>();
            let site = b.column(1).as_string::<i32>();
            let rank = b.column(2).as_primitive::<UInt32Type>();
            (
                layer.is_valid(i).then(|| layer.value(i)),
                site.is_valid(i).then(|| site.value(i).to_owned()),
                rank.is_valid(i).then(|| rank.value(i)),
            )
        };
        let mut grid = Grid::new(
            &buckets,
            Some((
                MAX_SERIES,
                format!("more than {MAX_SERIES} series match; narrow with layer, site or rank"),
            )),
        );
        let read = Read {
            select,
            buckets,
            pooled: false,
            key_columns: &["layer", "site", "rank"],
            key: &key,
        };
        self.fill(&run, read, &mut grid).await?;
        let cells = grid.into_rows();
        let series = cells
            .into_iter()
            .map(|((layer, site, rank), cells)| Series {
                layer,
                site,
                rank,
                buckets: render(&buckets, &cells),
            })
            .collect();
        Ok(SeriesAnswer {
            run: run.to_string(),
            metric: metric.to_string(),
            buckets,
            series,
        })
    }

    /// `GET /runs/{run}/heatmap`: a layer × step-bucket grid of one metric (and site). Cells
    /// pool every rank unless `rank` is given; each keeps min, max, last and counts.
    pub async fn heatmap(&self, run: &str, q: HeatmapQuery) -> Result<Heatmap> {
        let run = self.known_run(run)?;
        let metric = MetricName::new(q.metric)?;
        let site = site(q.site.as_deref())?;
        let points = points(q.points)?;
        let (from, to) = self.range(&run, q.from, q.to)?;
        let select = Selector {
            metric: metric.to_string(),
            layer: Pick::NotNull,
            site: site.map_or(Pick::Null, |s| Pick::Is(s.as_str().to_owned())),
            rank: q.rank.map_or(Pick::Any, Pick::Is),
        };
        let buckets = Buckets::new(from, to, points as u64);
        let key = |b: &RecordBatch, i: usize| b.column(0).as_primitive::<UInt32Type>().value(i);
        let mut grid = Grid::new(&buckets, None);
        let read = Read {
            select,
            buckets,
            pooled: q.rank.is_none(),
            key_columns: &["layer"],
            key: &key,
        };
        self.fill(&run, read, &mut grid).await?;
        let grid = grid.into_rows();
        let pick = |f: &dyn Fn(&Cell) -> Option<f64>| -> Vec<Vec<Option<Num>>> {
            grid.values()
                .map(|cells| cells.iter().map(|c| f(c).map(Num)).collect())
                .collect()
        };
        let last = pick(&|c| c.last());
        let min = pick(&|c| c.min);
        let max = pick(&|c| c.max);
        let count: Vec<Vec<u64>> = grid
            .values()
            .map(|c| c.iter().map(|c| c.count).collect())
            .collect();
        let nonfinite: Vec<Vec<u64>> = grid
            .values()
            .map(|c| c.iter().map(|c| c.nonfinite).collect())
            .collect();
        let starts: Vec<u64> = (0..buckets.count as usize)
            .map(|i| buckets.start(i))
            .collect();
        Ok(Heatmap {
            run: run.to_string(),
            metric: metric.to_string(),
            site: site.map(|s| s.as_str().to_owned()),
            buckets,
            steps: starts,
            layers: grid.keys().copied().collect(),
            last,
            min,
            max,
            count,
            nonfinite,
        })
    }

    /// `GET /runs/{run}/workers`: every rank's values at one step and the sketch cosine
    /// matrix.
    pub async fn workers(&self, run: &str, q: WorkersQuery) -> Result<Workers> {
        let run = self.known_run(run)?;
        let step = match q.step {
            Some(s) => Some(s),
            None => self.store().with_runs(|r| {
                r.get(&run).and_then(|s| {
                    let newest = s.rank_steps.values().copied().max()?;
                    s.rank_steps
                        .values()
                        .copied()
                        .filter(|&v| v + STALE_STEPS >= newest)
                        .min()
                })
            }),
        };
        let world = self.store().with_runs(|r| {
            r.get(&run)
                .and_then(|s| s.info.as_ref().map(|i| i.world_size))
        });
        let Some(step) = step else {
            return Ok(Workers {
                run: run.to_string(),
                step: None,
                world_size: world,
                ranks: Vec::new(),
                metrics: Vec::new(),
                cosine: None,
            });
        };
        let at_step = || col("step").eq(lit(step));
        let samples = self
            .scan(
                Table::Samples,
                &run,
                at_step().and(col("rank").is_not_null()),
                &["metric", "layer", "site", "rank", "value"],
            )
            .await?;
        let mut ranks = BTreeSet::new();
        let mut metrics: BTreeMap<WorkerSeries, BTreeMap<u32, f64>> = BTreeMap::new();
        for b in &samples {
            let metric = b.column(0).as_string::<i32>();
            let layer = b.column(1).as_primitive::<UInt32Type>();
            let site = b.column(2).as_string::<i32>();
            let rank = b.column(3).as_primitive::<UInt32Type>();
            let value = b.column(4).as_primitive::<Float64Type>();
            for i in 0..b.num_rows() {
                ranks.insert(rank.value(i));
                metrics
                    .entry((
                        metric.value(i).to_owned(),
                        layer.is_valid(i).then(|| layer.value(i)),
                        site.is_valid(i).then(|| site.value(i).to_owned()),
                    ))
                    .or_default()
                    .insert(rank.value(i), value.value(i));
            }
        }
        let sketches = self
            .scan(
                Table::Sketches,
                &run,
                at_step(),
                &["rank", "kind", "seed", "norm", "vector"],
            )
            .await?;
        let cosine = cosine(&sketches)?;
        let ranks: Vec<u32> = ranks.into_iter().collect();
        let metrics = metrics
            .into_iter()
            .map(|((metric, layer, site), by_rank)| WorkerMetric {
                metric,
                layer,
                site,
                values: ranks
                    .iter()
                    .map(|r| by_rank.get(r).copied().map(Num))
                    .collect(),
            })
            .collect();
        Ok(Workers {
            run: run.to_string(),
            step: Some(step),
            world_size: world,
            ranks,
            metrics,
            cosine,
        })
    }

    /// `GET /runs`.
    pub fn runs(&self) -> Runs {
        let alerts = self.store().alerts(None);
        let bytes: BTreeMap<RunId, u64> = self
            .store()
            .usage()
            .into_iter()
            .map(|u| (u.run, u.bytes))
            .collect();
        let runs = self.store().with_runs(|runs| {
            runs.iter()
                .map(|(run, s)| {
                    let firing = alerts
                        .iter()
                        .filter(|a| {
                            a.run == *run && a.state == rankwatch_analytics::AlertState::Firing
                        })
                        .count() as u64;
                    let last_seen = s.last_time_ms.unwrap_or(0).max(s.last_seen_ms);
                    let info = s.info.as_ref();
                    RunSummary {
                        run: run.to_string(),
                        world_size: info.map(|i| i.world_size),
                        family: info.map(|i| i.layout.family.clone()),
                        layers: info.map(|i| i.layout.layer_count()),
                        started_at_ms: info.map(|i| i.started_at_ms),
                        tags: info.map(|i| i.tags.clone()),
                        agent_version: info
                            .and_then(|i| i.tags.get(rankwatch_api::VERSION_TAG).cloned()),
                        first_step: s.first_step,
                        last_step: s.last_step,
                        last_seen_ms: (last_seen > 0).then_some(last_seen),
                        samples: s.samples,
                        nonfinite: s.nonfinite,
                        sketches: s.sketches,
                        series: s.series.len() as u64,
                        bytes: bytes.get(run).copied().unwrap_or(0),
                        alerts_firing: firing,
                    }
                })
                .collect()
        });
        Runs { runs }
    }

    /// `GET /runs/{run}/catalog`.
    pub fn catalog(&self, run: &str) -> Result<Catalog> {
        let run = self.known_run(run)?;
        let metrics = self.store().with_runs(|runs| {
            let mut by_metric: BTreeMap<&str, CatalogEntry> = BTreeMap::new();
            if let Some(s) = runs.get(&run) {
                for key in &s.series {
                    let e = by_metric.entry(key.metric.as_ref()).or_default();
                    e.0.extend(key.layer);
                    e.1.extend(key.site.map(Site::as_str));
                    e.2.extend(key.rank);
                    e.3 += 1;
                }
            }
            by_metric
                .into_iter()
                .map(|(metric, (layers, sites, ranks, series))| {
                    let known = metric.parse::<rankwatch_analytics::Metric>().ok();
                    CatalogMetric {
                        metric: metric.to_owned(),
                        scope: known.map(|m| wire_scope(m.scope())),
                        user: known.is_none(),
                        layers: layers.into_iter().collect(),
                        sites: sites.into_iter().map(str::to_owned).collect(),
                        ranks: ranks.into_iter().collect(),
                        series: series as u64,
                    }
                })
                .collect::<Vec<_>>()
        });
        Ok(Catalog {
            run: run.to_string(),
            metrics,
        })
    }
}

/// A metric's scope as the API names it.
fn wire_scope(scope: rankwatch_analytics::Scope) -> MetricScope {
    match scope {
        rankwatch_analytics::Scope::Rank => MetricScope::Rank,
        rankwatch_analytics::Scope::Layer => MetricScope::Layer,
        rankwatch_analytics::Scope::AllRanks => MetricScope::AllRanks,
    }
}

/// The sketch cosine matrix of one step, ranks in ascending order.
fn cosine(batches: &[RecordBatch]) -> Result<Option<Cosine>> {
    let mut rows: BTreeMap<u32, (String, u32, f64, Vec<f32>)> = BTreeMap::new();
    for b in batches {
        let rank = b.column(0).as_primitive::<UInt32Type>();
        let kind = b.column(1).as_string::<i32>();
        let seed = b.column(2).as_primitive::<UInt32Type>();
        let norm = b.column(3).as_primitive::<Float64Type>();
        let vector = b.column(4).as_list::<i32>();
        for i in 0..b.num_rows() {
            let v = vector.value(i);
            let v = v.as_primitive::<Float32Type>();
            rows.insert(
                rank.value(i),
                (
                    kind.value(i).to_owned(),
                    seed.value(i),
                    norm.value(i),
                    v.values().to_vec(),
                ),
            );
        }
    }
    if rows.len() < 2 {
        return Ok(None);
    }
    let first = rows.values().next().map(|r| (r.0.clone(), r.1));
    if rows.values().any(|r| Some((r.0.clone(), r.1)) != first) {
        return Ok(Some(Cosine::Error {
            error: "sketches of this step use different kinds or seeds and do not compare".into(),
        }));
    }
    let ranks: Vec<u32> = rows.keys().copied().collect();
    let vectors: Vec<&[f32]> = rows.values().map(|r| r.3.as_slice()).collect();
    let norms: Vec<f64> = rows.values().map(|r| r.2).collect();
    let matrix = match sketch_cosine_matrix(&vectors, &norms) {
        Ok(m) => m,
        Err(e) => {
            return Ok(Some(Cosine::Error {
                error: e.to_string(),
            }));
        }
    };
    let grid: Vec<Vec<Num>> = (0..matrix.nrows())
        .map(|i| (0..matrix.ncols()).map(|j| Num(matrix[(i, j)])).collect())
        .collect();
    Ok(Some(Cosine::Matrix(CosineMatrix {
        ranks,
        matrix: grid,
        pair_mean: cos_pair_mean(&matrix).map(Num),
    })))
}
