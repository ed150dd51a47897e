//! Rollups: per-window summaries of the samples, written beside every samples part.
//!
//! # Design
//!
//! An overview (a heatmap over a whole run, a chart of 100,000 steps) asks for buckets of
//! hundreds of steps; reading every raw row for it costs as much as the run is long. So each
//! samples part gets a sibling part in `table=rollups`, with the same part number, listed in
//! the same manifest commit: for every series (metric, layer, site, rank) and every aligned
//! window of 2^k steps (k in [`LEVELS`]) that holds rows, one row with the window's summary
//! ([`crate::summary::Cell`]: count, non-finite count, finite min and max, the values at its
//! greatest step). Per-layer metrics also get rows with every rank pooled (k in
//! [`POOLED_LEVELS`], `pooled` true, `rank` null), which is what a heatmap cell is: a 64-layer
//! heatmap over 8 ranks then reads one row per layer and window instead of eight. This is the
//! idea of Prometheus' recording rules, VictoriaMetrics' downsampling and map tiles, with one
//! difference: nothing is approximated. Every field merges exactly, so a bucket built from
//! rollups equals the bucket built from the raw rows, bit for bit.
//!
//! Dashboard buckets are aligned powers of two (`rankwatch_api::BucketRange`), so a bucket of
//! width 2^k is exactly the union of the level-L windows inside it for any L ≤ k. A part has no
//! level above its top ([`top_level`]: there each series has one window, which every level
//! above would repeat); the planner (`query::plan`) reads level min(k, 16, the part's top)
//! windows, raw rows where a window is cut by the range's ends and the part has rows beyond
//! them, raw rows for parts without a rollup (written before rollups existed, until
//! compaction adds one) and for the hot buffer. The rows are sorted (level,
//! pooled, metric, layer, site, rank, start), so page statistics skip every other level and
//! metric.
//!
//! A metric sampled sparsely (the spectral probe every 50 steps, activations every 25) would
//! get a row per sample at each fine level: windows narrower than its spacing hold one row
//! each. So each metric starts at the first level whose windows hold at least
//! [`MIN_ROWS_PER_WINDOW`] of its rows on average, per rank and pooled apart; the part's
//! manifest entry lists those that start later than the first level ([`Summary::sparse`]), and
//! the planner reads raw rows of that part for their narrower buckets. On the agent's default
//! report (64 ranks, 400 steps in one part) this halves the rollup rows: 0.87 a sample to 0.43.
//! Each level's windows are counted before any is built, and only the levels kept are built,
//! the first straight from the finest windows (`cargo xtask bench flush` measures it).
//!
//! Windows of one series can appear in several parts (ranks report late, a window straddles a
//! flush); each part's row covers only that part's rows, and the merge makes them one.
//!
//! How: where the series, (metric, layer, site) groups and metrics change is found once for
//! the part (Arrow's `distinct` kernel on neighbouring rows). Per series, its 8-step windows
//! (the first of [`LEVELS`]) are built from its rows (steps ascend within a series in a sorted
//! part); per group, the 2-step pooled windows straight from the rows of all its ranks
//! (`windows`: a window is a few numbers and a range of one buffer of last values, no heap of
//! its own). Once a metric's series are all read, its first levels are known, and each kept
//! level is built from the one below (the first straight from the finest windows). Work and
//! memory are proportional to the part's rows; `summaries_equal_cells_built_row_by_row`
//! holds every output row to a [`crate::summary::Cell`] built row by row.
//!
//! Cost: with a row per step, the per-rank levels hold 1/8 + 1/16 + … ≈ 1/4 as many rows as
//! the part, and the pooled levels about 1/ranks as many again. In bytes the pooled rows
//! weigh more than their count says: each carries every rank's value at its window's last step
//! (the exact mean needs them all), and the finest pooled windows are 2 steps wide. On the
//! dashboard bench's run (53.8 M samples, 64 layers × 8 ranks, mostly one per-layer metric) the
//! rollups take 609 MB beside 317 MB of samples; the pooled levels 1 and 2 hold 38 M of those
//! last values. A small part (a flush of a few steps per series) has about one row per level
//! per series, up to its top, until compaction merges it.

use std::collections::BTreeMap;
use std::ops::{Range, RangeInclusive};
use std::sync::{Arc, LazyLock};

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, UInt32Type, UInt64Type};
use arrow_array::{
    Array, ArrayRef, BooleanArray, Float64Array, ListArray, RecordBatch, UInt8Array, UInt32Array,
    UInt64Array,
};
use arrow_buffer::{BooleanBuffer, NullBuffer, OffsetBuffer};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use serde::{Deserialize, Serialize};

use super::files;
use crate::error::{Error, Result};
use windows::{Window, Windows};

mod windows;

/// The table name in the Hive layout (`table=rollups`).
pub const TABLE: &str = "rollups";

/// log2 of the window widths summarised per series: 8 to 65,536 steps. Narrower buckets of
/// one series read raw rows (a zoom that fine spans few steps); wider ones merge 65,536-step
/// windows.
pub const LEVELS: RangeInclusive<u32> = 3..=16;

/// log2 of the window widths summarised with every rank pooled, for per-layer metrics (the
/// heatmap's cells): from 2 steps, since a pooled row replaces a row per rank and step.
pub const POOLED_LEVELS: RangeInclusive<u32> = 1..=16;

/// A rollup part's layout: sorted (level, pooled, metric, layer, site, rank, start), window
/// starts and last steps delta-encoded (they step by the window width). Smaller pages (1 k
/// rows) and LZ4 instead of zstd were tried for point reads: no faster measurably (DataFusion's
/// per-query planning dominates), and the parts doubled.
pub const LAYOUT: files::Layout = files::Layout {
    sorted_by: &[
        "level", "pooled", "metric", "layer", "site", "rank", "start",
    ],
    delta_columns: &["start", "last_step"],
};

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    Arc::new(Schema::new(vec![
        Field::new("level", DataType::UInt8, false),
        // Every rank of (metric, layer, site) together; `rank` is then null.
        Field::new("pooled", DataType::Boolean, false),
        Field::new("metric", DataType::Utf8, false),
        Field::new("layer", DataType::UInt32, true),
        Field::new("site", DataType::Utf8, true),
        Field::new("rank", DataType::UInt32, true),
        Field::new("start", DataType::UInt64, false),
        Field::new("count", DataType::UInt64, false),
        Field::new("nonfinite", DataType::UInt64, false),
        Field::new("min", DataType::Float64, true),
        Field::new("max", DataType::Float64, true),
        Field::new("last_step", DataType::UInt64, false),
        Field::new(
            "last",
            DataType::List(Arc::new(Field::new_list_field(DataType::Float64, false))),
            false,
        ),
    ]))
});

/// The schema of a rollup part.
pub fn schema() -> SchemaRef {
    SCHEMA.clone()
}

/// The output rows of one (level, pooled), in order, as the columns they become.
#[derive(Debug, Default)]
struct Out {
    /// A row of the input whose key columns the output row takes.
    keys: Vec<u32>,
    start: Vec<u64>,
    count: Vec<u64>,
    nonfinite: Vec<u64>,
    min: Vec<f64>,
    max: Vec<f64>,
    /// Whether the window has a finite value (else `min` and `max` are null).
    finite: Vec<bool>,
    last_step: Vec<u64>,
    /// Where each row's last values start in `last_values`, and the end.
    last_offsets: Vec<i32>,
    last_values: Vec<f64>,
}

impl Out {
    fn push(&mut self, key_row: u32, windows: &[Window], all: &Windows) {
        if self.last_offsets.is_empty() {
            self.last_offsets.push(0);
        }
        for window in windows {
            self.keys.push(key_row);
            self.start.push(window.start);
            self.count.push(window.count);
            self.nonfinite.push(window.nonfinite);
            let extremes = window.extremes();
            let (min, max) = extremes.unwrap_or_default();
            self.min.push(min);
            self.max.push(max);
            self.finite.push(extremes.is_some());
            self.last_step.push(window.last_step);
            self.last_values.extend_from_slice(all.last_of(window));
            self.last_offsets.push(self.last_values.len() as i32);
        }
    }

    fn finish(self, level: u32, pooled: bool, keys: &[ArrayRef; 4]) -> Result<RecordBatch> {
        let rows = UInt32Array::from(self.keys);
        let n = rows.len();
        let take = |a: &ArrayRef| arrow_select::take::take(a, &rows, None).map_err(Error::Arrow);
        let nulls = Some(NullBuffer::from(self.finite)).filter(|n| n.null_count() > 0);
        let float = |values: Vec<f64>| -> ArrayRef {
            Arc::new(Float64Array::new(values.into(), nulls.clone()))
        };
        let last = ListArray::try_new(
            Arc::new(Field::new_list_field(DataType::Float64, false)),
            OffsetBuffer::new(self.last_offsets.into()),
            Arc::new(Float64Array::from(self.last_values)),
            None,
        )
        .map_err(Error::Arrow)?;
        let columns: Vec<ArrayRef> = vec![
            Arc::new(UInt8Array::from(vec![level as u8; n])),
            Arc::new(BooleanArray::from(vec![pooled; n])),
            take(&keys[0])?,
            take(&keys[1])?,
            take(&keys[2])?,
            if pooled {
                arrow_array::new_null_array(&DataType::UInt32, n)
            } else {
                take(&keys[3])?
            },
            Arc::new(UInt64Array::from(self.start)),
            Arc::new(UInt64Array::from(self.count)),
            Arc::new(UInt64Array::from(self.nonfinite)),
            float(self.min),
            float(self.max),
            Arc::new(UInt64Array::from(self.last_step)),
            Arc::new(last),
        ];
        RecordBatch::try_new(schema(), columns).map_err(Error::Arrow)
    }
}

/// Where the rows of (`level`, `pooled`) go among a summary's outputs: in the part's order.
fn slot(level: u32, pooled: bool) -> usize {
    level as usize * 2 + usize::from(pooled)
}

/// Pushes into `out` the windows that `fine` (of level `fine_level`, one series or pooled
/// group, whose key columns are row `row`'s) makes at each level of `levels`: the first straight
/// from `fine` (merging is exact, so skipping the levels between changes nothing), each coarser
/// one merged from the one below, in the two `scratch` lists by turns.
fn emit(
    fine: &[Window],
    fine_level: u32,
    levels: RangeInclusive<u32>,
    (row, pooled): (u32, bool),
    all: &Windows,
    out: &mut [Out],
    scratch: &mut (Vec<Window>, Vec<Window>),
) {
    let (below, next) = (&mut scratch.0, &mut scratch.1);
    let mut from_fine = true;
    for level in levels {
        if level == fine_level {
            out[slot(level, pooled)].push(row, fine, all);
            continue;
        }
        let source: &[Window] = if from_fine { fine } else { below };
        next.clear();
        windows::coarsen(source, level, next);
        out[slot(level, pooled)].push(row, next, all);
        std::mem::swap(below, next);
        from_fine = false;
    }
}

/// The finest level a metric's rows in one rollup part are summarised from, per rank and with
/// every rank pooled; `None` where it has no rows of that kind at all. A metric a part does not
/// list has every level up to the part's top ([`Summary::sparse`], [`top_level`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finest {
    pub rank: Option<u8>,
    pub pooled: Option<u8>,
}

impl Finest {
    /// Whether windows of `level` (per rank, or `pooled`) are in the part.
    pub fn has(&self, level: u32, pooled: bool) -> bool {
        let finest = if pooled { self.pooled } else { self.rank };
        finest.is_some_and(|f| level >= u32::from(f))
    }
}

/// A rollup part's batches, in order, and its sparse metrics.
#[derive(Debug)]
pub struct Summary {
    pub batches: Vec<RecordBatch>,
    /// The metrics whose finest windows would hold fewer than [`MIN_ROWS_PER_WINDOW`] rows
    /// each on average (a probe every 25 steps, in 8-step windows: one): they start at a
    /// coarser level, and the planner reads raw rows for narrower buckets.
    pub sparse: BTreeMap<String, Finest>,
}

/// The coarsest level a part whose steps span `lo..=hi` has rows of: the first at which its
/// steps share one window, so every series and group has one. Each level above would repeat
/// that window (on the agent's report for 64 ranks × 400 steps, 18.5 % of the rollup rows), so
/// none is written, and the planner reads this level for wider buckets: aligned windows nest,
/// so each lies inside one bucket. From the part's step range alone, which its manifest entry
/// holds; a part written when every level was kept has this one too.
pub fn top_level(lo: u64, hi: u64) -> u32 {
    (0..*LEVELS.end())
        .find(|&l| lo >> l == hi >> l)
        .unwrap_or(*LEVELS.end())
}

/// A level is written for a metric when its windows hold at least this many of its rows on
/// average: a window of one row costs more to build, write and read than the row itself.
pub const MIN_ROWS_PER_WINDOW: usize = 2;

/// One metric's finest windows per series and pooled group, with how many windows each level
/// would have, until its last series is read and its first level known; only the levels kept
/// are then built.
#[derive(Debug, Default)]
struct Staged {
    /// (a row of the series, its windows in `rank_windows`) per series, at the first of
    /// [`LEVELS`]; then the same per pooled group, at the first of [`POOLED_LEVELS`].
    rank: Vec<(u32, Range<usize>)>,
    rank_windows: Vec<Window>,
    pooled: Vec<(u32, Range<usize>)>,
    pooled_windows: Vec<Window>,
    rank_counts: [usize; 17],
    pooled_counts: [usize; 17],
    rows: usize,
    pooled_rows: usize,
}

impl Staged {
    /// Reads one series (`rows` of the part's steps and values).
    fn series(&mut self, all: &mut Windows, part: (&[u64], &[f64]), rows: Range<usize>) {
        let from = self.rank_windows.len();
        let (steps, values) = (&part.0[rows.clone()], &part.1[rows.clone()]);
        all.of_series(steps, values, *LEVELS.start(), &mut self.rank_windows);
        windows::count(&self.rank_windows[from..], LEVELS, &mut self.rank_counts);
        self.rank
            .push((rows.start as u32, from..self.rank_windows.len()));
        self.rows += rows.len();
    }

    /// Reads one pooled group (`rows` of the part: every rank of a (metric, layer, site)).
    fn group(&mut self, all: &mut Windows, part: (&[u64], &[f64]), rows: Range<usize>) {
        let from = self.pooled_windows.len();
        let (steps, values) = (&part.0[rows.clone()], &part.1[rows.clone()]);
        all.of_group(
            steps,
            values,
            *POOLED_LEVELS.start(),
            &mut self.pooled_windows,
        );
        windows::count(
            &self.pooled_windows[from..],
            POOLED_LEVELS,
            &mut self.pooled_counts,
        );
        self.pooled
            .push((rows.start as u32, from..self.pooled_windows.len()));
        self.pooled_rows += rows.len();
    }

    /// The finest of `levels` whose windows hold at least `min_rows` of `rows` on average
    /// ([`MIN_ROWS_PER_WINDOW`]).
    fn finest(
        counts: &[usize; 17],
        rows: usize,
        levels: &RangeInclusive<u32>,
        min_rows: usize,
    ) -> Option<u32> {
        levels.clone().find(|&level| {
            let windows = counts[level as usize];
            windows > 0 && rows >= min_rows * windows
        })
    }

    /// Builds the kept levels into `out` and empties itself for the next metric; the metric's
    /// entry for [`Summary::sparse`] if it starts coarser than the first level anywhere.
    fn finish(
        &mut self,
        all: &Windows,
        out: &mut [Out],
        (min_rows, top): (usize, u32),
        scratch: &mut (Vec<Window>, Vec<Window>),
    ) -> Option<Finest> {
        let rank = Self::finest(&self.rank_counts, self.rows, &LEVELS, min_rows);
        let pooled = Self::finest(
            &self.pooled_counts,
            self.pooled_rows,
            &POOLED_LEVELS,
            min_rows,
        );
        for (is_pooled, series, windows, finest, levels) in [
            (false, &self.rank, &self.rank_windows, rank, LEVELS),
            (
                true,
                &self.pooled,
                &self.pooled_windows,
                pooled,
                POOLED_LEVELS,
            ),
        ] {
            // Nothing above `top`: a part whose steps share one 8-step window has no per-rank
            // rows (they read raw), and a metric too sparse at `top` is too sparse above it.
            let Some(finest) = finest.filter(|&f| f <= top) else {
                continue;
            };
            for (row, range) in series {
                emit(
                    &windows[range.clone()],
                    *levels.start(),
                    finest..=top,
                    (*row, is_pooled),
                    all,
                    out,
                    scratch,
                );
            }
        }
        // Listed when either kind it has rows of starts later than its first level.
        let sparse = rank != Some(*LEVELS.start())
            || (self.pooled_rows > 0 && pooled != Some(*POOLED_LEVELS.start()));
        self.rank.clear();
        self.rank_windows.clear();
        self.pooled.clear();
        self.pooled_windows.clear();
        self.rank_counts = [0; 17];
        self.pooled_counts = [0; 17];
        (self.rows, self.pooled_rows) = (0, 0);
        sparse.then(|| Finest {
            rank: rank.map(|l| l as u8),
            pooled: pooled.map(|l| l as u8),
        })
    }
}

/// Below this many rows per series a part gets no rollup: its windows would be nearly as many
/// rows as it has (a series of 16 steps has 15 windows over the levels), and reading a few
/// raw rows per series is cheap. A flush of many short series (1,024 ranks × 200 user metrics,
/// a few steps each) is such a part; compaction merges them into parts long enough.
pub const MIN_ROWS_PER_SERIES: usize = 64;

/// The most rows a part summarised may have: a metric's last values (at most two a row: its
/// series' and its group's windows) are ranges of 32-bit offsets, and a level's list column
/// has 32-bit offsets. Compaction writes parts of `--compact-max-rows` (4 M by default).
pub const MAX_ROWS: usize = i32::MAX as usize / 2;

/// The rollup part of a samples part (file schema, sorted by metric, layer, site, rank, step)
/// as batches to write in order (one per level and pooling; concatenating them copied every
/// rollup row once more) with its sparse metrics, or `None` when its series are too short to
/// be worth one ([`MIN_ROWS_PER_SERIES`]) or no window would hold enough rows.
pub fn summarise(samples: &RecordBatch) -> Result<Option<Summary>> {
    summarise_with(samples, MIN_ROWS_PER_WINDOW)
}

/// [`summarise`] with another least average of rows a window (0: every level, as before
/// [`MIN_ROWS_PER_WINDOW`] existed), for the flush bench's side-by-side.
pub fn summarise_with(
    samples: &RecordBatch,
    min_rows_per_window: usize,
) -> Result<Option<Summary>> {
    let column = |name: &str| {
        samples
            .column_by_name(name)
            .cloned()
            .ok_or_else(|| Error::Corrupt {
                what: "a samples part".into(),
                reason: format!("it has no `{name}` column"),
            })
    };
    let keys = [
        column("metric")?,
        column("layer")?,
        column("site")?,
        column("rank")?,
    ];
    let metric = keys[0].as_string::<i32>();
    let layer = keys[1].as_primitive::<UInt32Type>();
    let steps = column("step")?;
    let values = column("value")?;
    let part = (
        steps.as_primitive::<UInt64Type>().values().as_ref(),
        values.as_primitive::<Float64Type>().values().as_ref(),
    );
    let n = samples.num_rows();
    if n == 0 {
        // An empty part has nothing to summarise (and a file needs at least one batch).
        return Ok(None);
    }
    if n > MAX_ROWS {
        return Err(Error::TooManyRows {
            rows: n,
            limit: MAX_ROWS,
        });
    }
    // Bit i set where row i + 1 starts another metric, (metric, layer, site) group, series
    // (the part is sorted by series, then step). Keys compared as values, nulls equal: what
    // a null slot's buffer holds is no part of the key.
    let changes = |column: &ArrayRef| -> Result<BooleanBuffer> {
        let differ = arrow_ord::cmp::distinct(&column.slice(0, n - 1), &column.slice(1, n - 1))
            .map_err(Error::Arrow)?;
        Ok(differ.values().clone())
    };
    let metric_changes = changes(&keys[0])?;
    let group_changes = &(&metric_changes | &changes(&keys[1])?) | &changes(&keys[2])?;
    let series_changes = &group_changes | &changes(&keys[3])?;
    let ends = |changes: &BooleanBuffer, end: usize| end == n || changes.value(end - 1);
    let mut bounds: Vec<usize> = std::iter::once(0)
        .chain(series_changes.set_indices().map(|i| i + 1))
        .collect();
    if n < bounds.len() * MIN_ROWS_PER_SERIES {
        return Ok(None);
    }
    bounds.push(n);
    // From the step range the part's manifest entry records, as the planner reads it.
    let (lowest, highest) = files::step_range(samples);
    let top = top_level(lowest.unwrap_or(0), highest.unwrap_or(0));
    let mut all = Windows::default();
    let mut out: Vec<Out> = (0..slot(16, true) + 1).map(|_| Out::default()).collect();
    let mut scratch = Default::default();
    let mut sparse = BTreeMap::new();
    // The metric being read, until its first levels are known.
    let mut staged = Staged::default();
    // Where the per-layer (metric, layer, site) group being read starts.
    let mut group_start = None::<usize>;
    for pair in bounds.windows(2) {
        let (first, end) = (pair[0], pair[1]);
        staged.series(&mut all, part, first..end);
        if layer.is_valid(first) {
            group_start.get_or_insert(first);
        }
        if ends(&group_changes, end)
            && let Some(start) = group_start.take()
        {
            staged.group(&mut all, part, start..end);
        }
        if ends(&metric_changes, end) {
            if let Some(f) = staged.finish(&all, &mut out, (min_rows_per_window, top), &mut scratch)
            {
                sparse.insert(metric.value(first).to_owned(), f);
            }
            // `out` holds copies: the next metric's ranges start again from 0.
            all.clear();
        }
    }
    let mut batches = Vec::new();
    for (i, rows) in out.into_iter().enumerate() {
        if !rows.keys.is_empty() {
            batches.push(rows.finish((i / 2) as u32, i % 2 == 1, &keys)?);
        }
    }
    if batches.is_empty() {
        return Ok(None);
    }
    Ok(Some(Summary { batches, sparse }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rankwatch_analytics::schema::samples;
    use rankwatch_analytics::{MetricName, RunId, Sample, Site};

    fn sample(rank: u32, step: u64, value: f64) -> Sample {
        Sample {
            run: RunId::new("r").unwrap(),
            rank: Some(rank),
            step,
            time_ms: 0,
            metric: MetricName::new("spectral.ratio").unwrap(),
            layer: Some(1),
            site: Some(Site::Up),
            value,
        }
    }

    #[test]
    fn each_level_holds_one_row_per_window_and_series_with_exact_fields() {
        let mut rows = Vec::new();
        for rank in 0..2 {
            for step in 0..20 {
                rows.push(sample(rank, step, step as f64 + f64::from(rank) * 100.0));
            }
        }
        rows.push(sample(0, 19, 7.0));
        rows.push(sample(1, 5, f64::NAN));
        let batch = files::without_run(&samples::to_batch(&rows).unwrap()).unwrap();
        let sorted = files::sorted(crate::entry::Table::Samples, &[batch]).unwrap();
        assert!(
            summarise(&sorted).unwrap().is_none(),
            "20 steps per series: too short"
        );
        assert!(
            summarise(&sorted.slice(0, 0)).unwrap().is_none(),
            "an empty part has no rollup (a file needs a batch)"
        );
        for rank in 0..2 {
            for step in 20..200 {
                rows.push(sample(rank, step, 1.0));
            }
        }
        let batch = files::without_run(&samples::to_batch(&rows).unwrap()).unwrap();
        let sorted = files::sorted(crate::entry::Table::Samples, &[batch]).unwrap();
        let summary = summarise(&sorted).unwrap().expect("200 steps per series");
        assert!(summary.sparse.is_empty(), "a row a step: every level");
        let r = arrow_select::concat::concat_batches(&schema(), &summary.batches).unwrap();
        let level = r.column(0).as_primitive::<arrow_array::types::UInt8Type>();
        let pooled = r.column(1).as_boolean();
        let rank = r.column(5).as_primitive::<UInt32Type>();
        let start = r.column(6).as_primitive::<UInt64Type>();
        let count = r.column(7).as_primitive::<UInt64Type>();
        let nonfinite = r.column(8).as_primitive::<UInt64Type>();
        let max = r.column(10).as_primitive::<Float64Type>();
        let last = r.column(12).as_list::<i32>();
        // Steps 0..=199 of two ranks: 25 windows of 8 steps per rank, 13 of 16, 7 of 32, 4 of
        // 64, 2 of 128, then one; pooled rows from level 1 (2 steps), one per window.
        let rows_of = |l: u8, p: bool| {
            (0..r.num_rows())
                .filter(|&i| level.value(i) == l && pooled.value(i) == p)
                .count()
        };
        let per_rank: Vec<usize> = (1..=16).map(|l| rows_of(l, false)).collect();
        // Steps 0..=199 share one window from level 8 (256 steps): nothing above it.
        assert_eq!(
            per_rank,
            [0, 0, 50, 26, 14, 8, 4, 2, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        let pooled_rows: Vec<usize> = (1..=16).map(|l| rows_of(l, true)).collect();
        assert_eq!(
            pooled_rows,
            [100, 50, 25, 13, 7, 4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0]
        );
        let find = |l: u8, p: bool, rk: Option<u32>, s: u64| {
            (0..r.num_rows())
                .find(|&i| {
                    level.value(i) == l
                        && pooled.value(i) == p
                        && rank.is_valid(i) == rk.is_some()
                        && rk.is_none_or(|rk| rank.value(i) == rk)
                        && start.value(i) == s
                })
                .unwrap()
        };
        let i = find(3, false, Some(0), 16);
        assert_eq!((count.value(i), max.value(i)), (9, 19.0));
        assert_eq!(last.value(i).as_primitive::<Float64Type>().values(), &[1.0]);
        let i = find(3, false, Some(1), 0);
        assert_eq!((count.value(i), nonfinite.value(i)), (9, 1));
        let i = find(8, false, Some(1), 0);
        assert_eq!((count.value(i), max.value(i)), (201, 119.0));
        // Pooled: both ranks; step 19 holds rank 0's two values and rank 1's one.
        let i = find(1, true, None, 18);
        assert_eq!((count.value(i), max.value(i)), (5, 119.0));
        let l = last.value(i);
        assert_eq!(
            l.as_primitive::<Float64Type>().values(),
            &[7.0, 19.0, 119.0]
        );
        let i = find(8, true, None, 0);
        assert_eq!(
            (count.value(i), nonfinite.value(i), max.value(i)),
            (402, 1, 119.0)
        );
    }

    #[test]
    fn a_sparse_metric_starts_at_the_first_level_whose_windows_hold_two_rows() {
        let row = |metric: &str, layer: Option<u32>, rank: u32, step: u64| Sample {
            metric: MetricName::new(metric).unwrap(),
            layer,
            site: None,
            ..sample(rank, step, step as f64)
        };
        let mut rows = Vec::new();
        for rank in 0..2 {
            for step in 0..2000 {
                rows.push(row("loss", None, rank, step));
                if step % 25 == 0 {
                    rows.push(row("spectral.ratio", Some(0), rank, step));
                }
            }
        }
        let batch = files::without_run(&samples::to_batch(&rows).unwrap()).unwrap();
        let sorted = files::sorted(crate::entry::Table::Samples, &[batch]).unwrap();
        let summary = summarise(&sorted).unwrap().expect("long series");
        // Every 25 steps: 80 rows a rank; 8-, 16- and 32-step windows hold about one each
        // (80, 80, 62 windows), 64-step ones 2.6. Pooled, both ranks share each step: 2 a
        // 2-step window.
        let finest = Finest {
            rank: Some(6),
            pooled: Some(1),
        };
        assert_eq!(
            summary.sparse,
            BTreeMap::from([("spectral.ratio".to_owned(), finest)])
        );
        assert!(finest.has(6, false) && !finest.has(5, false) && finest.has(1, true));
        let none = Finest {
            rank: None,
            pooled: Some(2),
        };
        assert!(!none.has(16, false) && !none.has(1, true) && none.has(2, true));
        let r = arrow_select::concat::concat_batches(&schema(), &summary.batches).unwrap();
        let level = r.column(0).as_primitive::<arrow_array::types::UInt8Type>();
        let pooled = r.column(1).as_boolean();
        let metric = r.column(2).as_string::<i32>();
        let rows_of = |m: &str, l: u8, p: bool| {
            (0..r.num_rows())
                .filter(|&i| metric.value(i) == m && level.value(i) == l && pooled.value(i) == p)
                .count()
        };
        for l in 3..=5 {
            assert_eq!(
                rows_of("spectral.ratio", l, false),
                0,
                "level {l} is not written"
            );
            assert_eq!(
                rows_of("loss", l, false),
                2 * 2000usize.div_ceil(1 << l),
                "a dense metric keeps level {l}"
            );
        }
        assert_eq!(rows_of("spectral.ratio", 6, false), 2 * 31);
        assert_eq!(rows_of("spectral.ratio", 1, true), 80);
    }

    /// A rollup row's key: (level, pooled, metric, layer, site, rank, start).
    type Key = (
        u32,
        bool,
        String,
        Option<u32>,
        Option<String>,
        Option<u32>,
        u64,
    );
    /// Its fields as bits: (count, non-finite, min, max, last step, last values).
    type Fields = (u64, u64, Option<u64>, Option<u64>, u64, Vec<u64>);
    /// A rollup's rows in order and its sparse metrics.
    type Rollup = (Vec<(Key, Fields)>, BTreeMap<String, Finest>);

    /// What a part's rollup must hold, built the plain way: a [`crate::summary::Cell`] per
    /// (key, window), every row added at every level, the levels each metric starts at
    /// counted afterwards. `None` where the part gets no rollup.
    fn reference(part: &RecordBatch, min_rows: usize) -> Option<Rollup> {
        let metric = part.column_by_name("metric").unwrap().as_string::<i32>();
        let layer = part
            .column_by_name("layer")
            .unwrap()
            .as_primitive::<UInt32Type>();
        let site = part.column_by_name("site").unwrap().as_string::<i32>();
        let rank = part
            .column_by_name("rank")
            .unwrap()
            .as_primitive::<UInt32Type>();
        let step = part
            .column_by_name("step")
            .unwrap()
            .as_primitive::<UInt64Type>();
        let value = part
            .column_by_name("value")
            .unwrap()
            .as_primitive::<Float64Type>();
        let n = part.num_rows();
        let key = |i: usize| {
            (
                metric.value(i).to_owned(),
                layer.is_valid(i).then(|| layer.value(i)),
                site.is_valid(i).then(|| site.value(i).to_owned()),
                rank.is_valid(i).then(|| rank.value(i)),
            )
        };
        let series: std::collections::BTreeSet<_> = (0..n).map(key).collect();
        if n == 0 || n < series.len() * MIN_ROWS_PER_SERIES {
            return None;
        }
        let mut cells: BTreeMap<Key, crate::summary::Cell> = BTreeMap::new();
        // Per metric: (rows, rows of a layer).
        let mut rows: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        for i in 0..n {
            let (m, l, s, r) = key(i);
            let (step, value) = (step.value(i), value.value(i));
            let counted = rows.entry(m.clone()).or_default();
            counted.0 += 1;
            for level in LEVELS {
                let k = (
                    level,
                    false,
                    m.clone(),
                    l,
                    s.clone(),
                    r,
                    step >> level << level,
                );
                cells.entry(k).or_default().add(step, value);
            }
            if l.is_some() {
                counted.1 += 1;
                for level in POOLED_LEVELS {
                    let k = (
                        level,
                        true,
                        m.clone(),
                        l,
                        s.clone(),
                        None,
                        step >> level << level,
                    );
                    cells.entry(k).or_default().add(step, value);
                }
            }
        }
        let mut windows: BTreeMap<(String, bool, u32), usize> = BTreeMap::new();
        for k in cells.keys() {
            *windows.entry((k.2.clone(), k.1, k.0)).or_default() += 1;
        }
        let first_level = |m: &str, pooled: bool, rows: usize| {
            let levels = if pooled { POOLED_LEVELS } else { LEVELS };
            levels.into_iter().find(|&level| {
                let w = windows
                    .get(&(m.to_owned(), pooled, level))
                    .copied()
                    .unwrap_or(0);
                w > 0 && rows >= min_rows * w
            })
        };
        let mut sparse = BTreeMap::new();
        let mut first = BTreeMap::new();
        for (m, &(all, of_layers)) in &rows {
            let f = Finest {
                rank: first_level(m, false, all).map(|l| l as u8),
                pooled: first_level(m, true, of_layers).map(|l| l as u8),
            };
            if f.rank != Some(3) || (of_layers > 0 && f.pooled != Some(1)) {
                sparse.insert(m.clone(), f);
            }
            first.insert(m.clone(), f);
        }
        let (lowest, highest) = files::step_range(part);
        let top = top_level(lowest.unwrap(), highest.unwrap());
        let kept: Vec<(Key, Fields)> = cells
            .into_iter()
            .filter(|(k, _)| first[&k.2].has(k.0, k.1) && k.0 <= top)
            .map(|(k, c)| {
                let last = c.last_values().iter().map(|v| v.to_bits()).collect();
                let fields = (
                    c.count,
                    c.nonfinite,
                    c.min.map(f64::to_bits),
                    c.max.map(f64::to_bits),
                    c.last_step,
                    last,
                );
                (k, fields)
            })
            .collect();
        (!kept.is_empty()).then_some((kept, sparse))
    }

    /// A summary's rows as (key, fields), in the order written.
    fn rows_of(summary: &Summary) -> Vec<(Key, Fields)> {
        let r = arrow_select::concat::concat_batches(&schema(), &summary.batches).unwrap();
        let level = r.column(0).as_primitive::<arrow_array::types::UInt8Type>();
        let pooled = r.column(1).as_boolean();
        let metric = r.column(2).as_string::<i32>();
        let layer = r.column(3).as_primitive::<UInt32Type>();
        let site = r.column(4).as_string::<i32>();
        let rank = r.column(5).as_primitive::<UInt32Type>();
        let u64s = |c: usize| r.column(c).as_primitive::<UInt64Type>().clone();
        let (start, count, nonfinite, last_step) = (u64s(6), u64s(7), u64s(8), u64s(11));
        let min = r.column(9).as_primitive::<Float64Type>();
        let max = r.column(10).as_primitive::<Float64Type>();
        let last = r.column(12).as_list::<i32>();
        (0..r.num_rows())
            .map(|i| {
                let key = (
                    u32::from(level.value(i)),
                    pooled.value(i),
                    metric.value(i).to_owned(),
                    layer.is_valid(i).then(|| layer.value(i)),
                    site.is_valid(i).then(|| site.value(i).to_owned()),
                    rank.is_valid(i).then(|| rank.value(i)),
                    start.value(i),
                );
                let values = last.value(i);
                let fields = (
                    count.value(i),
                    nonfinite.value(i),
                    min.is_valid(i).then(|| min.value(i).to_bits()),
                    max.is_valid(i).then(|| max.value(i).to_bits()),
                    last_step.value(i),
                    values
                        .as_primitive::<Float64Type>()
                        .values()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect(),
                );
                (key, fields)
            })
            .collect()
    }

    /// Groups of series as a job reports them, from a seed: a few (metric, layer, site)
    /// groups of one to four ranks, or 17 to 24 (more last values than a pooled window sorts
    /// on the stack), now and then a rank-less series among them; each rank a row every
    /// `stride` steps from the group's start (now and then its own), some steps skipped, some
    /// twice, now and then a jump (a resume); steps from 0, from 2^40 or just below `u64::MAX`
    /// (top levels with several windows); values with NaNs of both signs, infinities and both
    /// zeros among them; and a few stray rows under the groups' keys.
    fn part_from(seed: u64, groups: usize) -> RecordBatch {
        let mut state = seed | 1;
        let mut next = move |below: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % below
        };
        const VALUES: [f64; 8] = [
            0.0,
            -0.0,
            f64::NAN,
            -f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1.5,
            -2.25,
        ];
        let metrics = ["loss", "spectral.ratio", "act_max"];
        let base = [0, 1 << 40, u64::MAX - (1 << 32)][next(3) as usize];
        let mut rows = Vec::new();
        let mut push = |metric: &str, layer, site, rank, step, value| {
            rows.push(Sample {
                run: RunId::new("r").unwrap(),
                rank,
                step,
                time_ms: 0,
                metric: MetricName::new(metric).unwrap(),
                layer,
                site,
                value,
            })
        };
        let mut keys = Vec::new();
        for _ in 0..groups {
            let metric = metrics[next(3) as usize];
            let layer = (next(4) != 0).then(|| next(3) as u32);
            let site = [None, Some(Site::Q), Some(Site::Up)][next(3) as usize];
            let stride = [1, 1, 2, 3, 25, 50][next(6) as usize];
            let (ranks, len) = if next(4) == 0 {
                (17 + next(8), 40 + next(60))
            } else {
                (1 + next(4), 40 + next(260))
            };
            keys.push((metric, layer, site));
            // Ranks mostly report the same steps, as a job's do.
            let first = base + next(200);
            for r in 0..ranks {
                let rank = (next(6) != 0).then_some(r as u32);
                let mut step = if next(4) == 0 {
                    base + next(200)
                } else {
                    first
                };
                for _ in 0..len {
                    step += if next(200) == 0 {
                        1 + next(1 << 20)
                    } else {
                        stride
                    };
                    if next(10) == 0 {
                        continue;
                    }
                    for _ in 0..1 + u64::from(next(20) == 0) {
                        let value = if next(3) == 0 {
                            VALUES[next(8) as usize]
                        } else {
                            next(2000) as f64 / 7.0 - 100.0
                        };
                        push(metric, layer, site, rank, step, value);
                    }
                }
            }
        }
        for _ in 0..next(20) {
            let (metric, layer, site) = keys[next(keys.len() as u64) as usize];
            let value = next(100) as f64;
            let step = base + next(1 << 21);
            push(metric, layer, site, Some(next(4) as u32), step, value);
        }
        let batch = files::without_run(&samples::to_batch(&rows).unwrap()).unwrap();
        files::sorted(crate::entry::Table::Samples, &[batch]).unwrap()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
        /// Every rollup row, its order and the sparse metrics equal the plain build's, bit for
        /// bit, at both least averages of rows a window.
        #[test]
        fn summaries_equal_cells_built_row_by_row(
            seed in proptest::prelude::any::<u64>(),
            groups in 1usize..6,
            min_rows in proptest::sample::select(vec![0usize, MIN_ROWS_PER_WINDOW]),
        ) {
            let part = part_from(seed, groups);
            let got = summarise_with(&part, min_rows).unwrap();
            let want = reference(&part, min_rows);
            match (got, want) {
                (None, None) => {}
                (Some(summary), Some((rows, sparse))) => {
                    proptest::prop_assert_eq!(&summary.sparse, &sparse);
                    let got = rows_of(&summary);
                    proptest::prop_assert_eq!(got.len(), rows.len());
                    for (g, w) in got.iter().zip(&rows) {
                        proptest::prop_assert_eq!(g, w);
                    }
                }
                (got, want) => proptest::prop_assert!(
                    false,
                    "summarise gave a rollup: {}, the reference: {}",
                    got.is_some(),
                    want.is_some()
                ),
            }
        }
    }
}
