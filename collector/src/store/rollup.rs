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
//! width 2^k is exactly the union of the level-min(k, 16) windows inside it; the planner
//! (`query::plan`) reads those, raw rows where a window is cut by the range's ends and the
//! part has rows beyond them, raw rows for parts without a rollup (written before rollups
//! existed, until compaction adds one) and for the hot buffer. The rows are sorted (level,
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
//! How: per series, the finest windows (2 steps) are built from its rows (steps ascend within
//! a series in a sorted part); the pooled windows of a (metric, layer, site) merge its series'
//! finest windows. Once a metric's series are all read, its first levels are known, and each
//! kept level is built from the one below (the first straight from the finest windows). Work
//! and memory are proportional to the part's rows.
//!
//! Cost: with a row per step, the per-rank levels hold 1/8 + 1/16 + … ≈ 1/4 as many rows as
//! the part, and the pooled levels about 1/ranks as many again. In bytes the pooled rows
//! weigh more than their count says: each carries every rank's value at its window's last step
//! (the exact mean needs them all), and the finest pooled windows are 2 steps wide. On the
//! dashboard bench's run (53.8 M samples, 64 layers × 8 ranks, mostly one per-layer metric) the
//! rollups take 609 MB beside 317 MB of samples; the pooled levels 1 and 2 hold 38 M of those
//! last values. A small part (a flush of a few steps per series) has about one row per level
//! per series until compaction merges it.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;
use std::sync::{Arc, LazyLock};

use arrow_array::builder::{Float64Builder, ListBuilder, UInt64Builder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, UInt32Type, UInt64Type};
use arrow_array::{Array, ArrayRef, BooleanArray, RecordBatch, UInt8Array, UInt32Array};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use serde::{Deserialize, Serialize};

use super::files;
use crate::error::{Error, Result};
use crate::summary::{Windows, coarsen, pool, windows_of};

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

/// The output rows of one (level, pooled), in order.
#[derive(Debug)]
struct Out {
    /// A row of the input whose key columns the output row takes.
    keys: Vec<u32>,
    start: UInt64Builder,
    count: UInt64Builder,
    nonfinite: UInt64Builder,
    min: Float64Builder,
    max: Float64Builder,
    last_step: UInt64Builder,
    last: ListBuilder<Float64Builder>,
}

impl Default for Out {
    fn default() -> Self {
        Out {
            keys: Vec::new(),
            start: UInt64Builder::new(),
            count: UInt64Builder::new(),
            nonfinite: UInt64Builder::new(),
            min: Float64Builder::new(),
            max: Float64Builder::new(),
            last_step: UInt64Builder::new(),
            last: ListBuilder::new(Float64Builder::new())
                .with_field(Arc::new(Field::new_list_field(DataType::Float64, false))),
        }
    }
}

impl Out {
    fn push(&mut self, key_row: u32, windows: &Windows) {
        for (start, cell) in windows {
            self.keys.push(key_row);
            self.start.append_value(*start);
            self.count.append_value(cell.count);
            self.nonfinite.append_value(cell.nonfinite);
            self.min.append_option(cell.min);
            self.max.append_option(cell.max);
            self.last_step.append_value(cell.last_step);
            cell.with_last_values(|values| self.last.values().append_slice(values));
            self.last.append(true);
        }
    }

    fn finish(mut self, level: u32, pooled: bool, keys: &[ArrayRef; 4]) -> Result<RecordBatch> {
        let rows = UInt32Array::from(std::mem::take(&mut self.keys));
        let n = rows.len();
        let take = |a: &ArrayRef| arrow_select::take::take(a, &rows, None).map_err(Error::Arrow);
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
            Arc::new(self.start.finish()),
            Arc::new(self.count.finish()),
            Arc::new(self.nonfinite.finish()),
            Arc::new(self.min.finish()),
            Arc::new(self.max.finish()),
            Arc::new(self.last_step.finish()),
            Arc::new(self.last.finish()),
        ];
        RecordBatch::try_new(schema(), columns).map_err(Error::Arrow)
    }
}

/// The windows `fine` (of level `fine_level`) makes at each level of `levels`: the first
/// straight from `fine` (merging is exact, so skipping the levels between changes nothing),
/// each coarser one merged from the one below.
fn levels_of(fine: Windows, fine_level: u32, levels: RangeInclusive<u32>) -> Vec<(u32, Windows)> {
    let mut levels = levels;
    let Some(first) = levels.next() else {
        return Vec::new();
    };
    let mut out = vec![(
        first,
        if first == fine_level {
            fine
        } else {
            coarsen(&fine, first)
        },
    )];
    for level in levels {
        let coarser = coarsen(&out[out.len() - 1].1, level);
        out.push((level, coarser));
    }
    out
}

/// Adds to `counts[level]` how many windows of each of `levels` `fine` (finer) makes, without
/// building them.
fn count_windows(fine: &Windows, levels: &RangeInclusive<u32>, counts: &mut [usize; 17]) {
    for level in levels.clone() {
        let mut last = None;
        for (start, _) in fine {
            let window = Some(start >> level);
            if window != last {
                counts[level as usize] += 1;
                last = window;
            }
        }
    }
}

/// The finest level a metric's rows in one rollup part are summarised from, per rank and with
/// every rank pooled; `None` where it has no rows of that kind at all. A metric a part does not
/// list has every level ([`Summary::sparse`]).
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

/// A level is written for a metric when its windows hold at least this many of its rows on
/// average: a window of one row costs more to build, write and read than the row itself.
pub const MIN_ROWS_PER_WINDOW: usize = 2;

/// One metric's finest windows per series and pooled group, with how many windows each level
/// would have, until its last series is read and its first level known; only the levels kept
/// are then built.
#[derive(Debug, Default)]
struct Staged {
    /// (a row of the series, its finest windows) per series, then per pooled group.
    rank: Vec<(u32, Windows)>,
    pooled: Vec<(u32, Windows)>,
    rank_windows: [usize; 17],
    pooled_windows: [usize; 17],
    rows: usize,
    pooled_rows: usize,
}

impl Staged {
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

    /// Builds the kept levels into `out`; the metric's entry for [`Summary::sparse`] if it
    /// starts coarser than the first level anywhere.
    fn finish(
        self,
        fine_level: u32,
        out: &mut BTreeMap<(u32, bool), Out>,
        min_rows: usize,
    ) -> Option<Finest> {
        let rank = Self::finest(&self.rank_windows, self.rows, &LEVELS, min_rows);
        let pooled = Self::finest(
            &self.pooled_windows,
            self.pooled_rows,
            &POOLED_LEVELS,
            min_rows,
        );
        for (is_pooled, series, finest, levels) in [
            (false, self.rank, rank, LEVELS),
            (true, self.pooled, pooled, POOLED_LEVELS),
        ] {
            let Some(finest) = finest else { continue };
            for (row, fine) in series {
                for (level, windows) in levels_of(fine, fine_level, finest..=*levels.end()) {
                    out.entry((level, is_pooled))
                        .or_default()
                        .push(row, &windows);
                }
            }
        }
        // Listed when either kind it has rows of starts later than its first level.
        let sparse = rank != Some(*LEVELS.start())
            || (self.pooled_rows > 0 && pooled != Some(*POOLED_LEVELS.start()));
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
    let site = keys[2].as_string::<i32>();
    let rank = keys[3].as_primitive::<UInt32Type>();
    let steps = column("step")?;
    let values = column("value")?;
    let step = steps.as_primitive::<UInt64Type>();
    let value = values.as_primitive::<Float64Type>();
    // Keys compared as values: what a null slot's buffer holds is no part of the key.
    let key = |i: usize| {
        (
            metric.value(i),
            layer.is_valid(i).then(|| layer.value(i)),
            site.is_valid(i).then(|| site.value(i)),
        )
    };
    let rank_of = |i: usize| rank.is_valid(i).then(|| rank.value(i));
    let n = samples.num_rows();
    // Where each series starts (the part is sorted by series, then step), and the end.
    let mut bounds: Vec<usize> = (0..n)
        .filter(|&i| i == 0 || key(i - 1) != key(i) || rank_of(i - 1) != rank_of(i))
        .collect();
    let series = bounds.len();
    // An empty part has nothing to summarise (and a file needs at least one batch).
    if n == 0 || n < series * MIN_ROWS_PER_SERIES {
        return Ok(None);
    }
    bounds.push(n);
    let finest = *POOLED_LEVELS.start();
    let mut out: BTreeMap<(u32, bool), Out> = BTreeMap::new();
    let mut sparse = BTreeMap::new();
    // The metric being read, until its first levels are known.
    let mut staged = Staged::default();
    // Where the (metric, layer, site) group being read starts in `staged.rank`, its first row,
    // and how many rows it has (per-layer metrics only).
    let (mut group_start, mut group_row, mut group_rows) = (None::<usize>, 0u32, 0usize);
    for pair in bounds.windows(2) {
        let (first, end) = (pair[0], pair[1]);
        // One series, steps ascending.
        let fine = windows_of(
            (first..end).map(|i| (step.value(i), value.value(i))),
            finest,
        );
        staged.rows += end - first;
        count_windows(&fine, &LEVELS, &mut staged.rank_windows);
        if layer.is_valid(first) {
            if group_start.is_none() {
                (group_start, group_row) = (Some(staged.rank.len()), first as u32);
            }
            group_rows += end - first;
        }
        staged.rank.push((first as u32, fine));
        if (end == n || key(first) != key(end))
            && let Some(start) = group_start.take()
        {
            let pooled = pool(staged.rank[start..].iter().map(|(_, w)| w));
            staged.pooled_rows += std::mem::take(&mut group_rows);
            count_windows(&pooled, &POOLED_LEVELS, &mut staged.pooled_windows);
            staged.pooled.push((group_row, pooled));
        }
        if (end == n || metric.value(first) != metric.value(end))
            && let Some(f) =
                std::mem::take(&mut staged).finish(finest, &mut out, min_rows_per_window)
        {
            sparse.insert(metric.value(first).to_owned(), f);
        }
    }
    if out.is_empty() {
        return Ok(None);
    }
    let mut batches = Vec::with_capacity(out.len());
    for ((level, pooled), rows) in out {
        batches.push(rows.finish(level, pooled, &keys)?);
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
        assert_eq!(
            per_rank,
            [0, 0, 50, 26, 14, 8, 4, 2, 2, 2, 2, 2, 2, 2, 2, 2]
        );
        let pooled_rows: Vec<usize> = (1..=16).map(|l| rows_of(l, true)).collect();
        assert_eq!(
            pooled_rows,
            [100, 50, 25, 13, 7, 4, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1]
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
        let i = find(16, false, Some(1), 0);
        assert_eq!((count.value(i), max.value(i)), (201, 119.0));
        // Pooled: both ranks; step 19 holds rank 0's two values and rank 1's one.
        let i = find(1, true, None, 18);
        assert_eq!((count.value(i), max.value(i)), (5, 119.0));
        let l = last.value(i);
        assert_eq!(
            l.as_primitive::<Float64Type>().values(),
            &[7.0, 19.0, 119.0]
        );
        let i = find(16, true, None, 0);
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
}
