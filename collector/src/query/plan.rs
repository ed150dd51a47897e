//! The planner of downsampled reads: which rollup windows and which raw rows fill a grid of
//! buckets.
//!
//! A bucket of width 2^k (the grid is aligned: `rankwatch_api::BucketRange`) is exactly the
//! union of the level-L windows inside it for any L ≤ k. For a part with a rollup the planner
//! reads L = min(k, 16, the part's top level: [`rollup::top_level`], above which its windows
//! would repeat): the level-L rows of the windows inside `from..=to` — and of the two windows
//! the range's ends cut, unless the part has rows beyond that end (then those steps are read
//! raw from the part). Heatmap cells that pool every rank read the rank-pooled rows. Parts
//! without a rollup and the hot buffer are read raw, and so are buckets narrower than the
//! finest level (2 steps pooled, 8 per rank): such a zoom spans few steps. Both kinds of rows
//! merge into the same [`Cell`]s, so the answer is the raw one exactly (the property test in
//! `collector/tests/it/rollups.rs` checks this over random runs, parts and grids).
//!
//! Local parts are read directly through their cached series index ([`super::parts`]: the
//! matching rows' pages only, no query plan); parts in object storage and the hot buffer are
//! scanned by DataFusion, with the filter pushed into Parquet (page statistics on the sorted
//! columns skip other metrics, levels and steps). Either way rows stream batch by batch into
//! the cells: they are never gathered first.

use std::collections::BTreeMap;
use std::path::PathBuf;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, UInt64Type};
use arrow_array::{Array, RecordBatch};
use datafusion::prelude::{DataFrame, Expr, ParquetReadOptions, SessionContext, col, lit};
use futures_util::StreamExt;
use rankwatch_analytics::RunId;
use tokio::runtime::{Handle, RuntimeFlavor};

use super::Queries;
use super::downsample::{Buckets, Cell};
use super::parts::{Deadline, PointRead, Selector};
use crate::entry::Table;
use crate::error::{Error, Result};
use crate::store::backend::Backend;
use crate::store::{files, rollup};

/// Cells per key (a series, a heatmap row), each a row of buckets.
#[derive(Debug)]
pub(crate) struct Grid<K> {
    index: BTreeMap<K, usize>,
    rows: Vec<Vec<Cell>>,
    buckets: usize,
    /// Most keys, and the error one more is.
    limit: Option<(usize, String)>,
}

impl<K: Ord + Clone> Grid<K> {
    /// A grid of `buckets` columns; past `limit.0` keys a read fails with `limit.1`.
    pub(crate) fn new(buckets: &Buckets, limit: Option<(usize, String)>) -> Grid<K> {
        Grid {
            index: BTreeMap::new(),
            rows: Vec::new(),
            buckets: buckets.count as usize,
            limit,
        }
    }

    fn row(&mut self, key: &K) -> Result<usize> {
        if let Some(&i) = self.index.get(key) {
            return Ok(i);
        }
        if let Some((max, message)) = &self.limit
            && self.index.len() >= *max
        {
            return Err(Error::bad(message.clone()));
        }
        self.rows.push(vec![Cell::default(); self.buckets]);
        self.index.insert(key.clone(), self.rows.len() - 1);
        Ok(self.rows.len() - 1)
    }

    /// The rows by key, in key order.
    pub(crate) fn into_rows(self) -> BTreeMap<K, Vec<Cell>> {
        let mut rows: Vec<Option<Vec<Cell>>> = self.rows.into_iter().map(Some).collect();
        self.index
            .into_iter()
            .map(|(k, i)| (k, rows[i].take().unwrap_or_default()))
            .collect()
    }
}

/// What to read: rows of `select` (on the columns samples and rollups share: metric, layer,
/// site, rank), grouped by `key_columns` (read by `key` from the first columns of a batch);
/// `pooled` when the cells pool every rank (a heatmap without `rank`), so the rank-pooled
/// rollups answer.
pub(crate) struct Read<'a, K> {
    pub select: Selector,
    pub buckets: Buckets,
    pub pooled: bool,
    pub key_columns: &'a [&'a str],
    pub key: &'a (dyn Fn(&RecordBatch, usize) -> K + Sync),
}

/// The rollup level for buckets of `shift`, if any.
fn level(shift: u32, pooled: bool) -> Option<u32> {
    let levels = if pooled {
        rollup::POOLED_LEVELS
    } else {
        rollup::LEVELS
    };
    let l = shift.min(*levels.end());
    (l >= *levels.start()).then_some(l)
}

/// The level-`l` windows a part with rows in `lo..=hi` answers for `from..=to` exactly: those
/// inside the range, and those cut by an end beyond which the part has no rows. The first and
/// last window start, if any.
fn windows_for(from: u64, to: u64, (lo, hi): (u64, u64), l: u32) -> Option<(u64, u64)> {
    let width = 1u64 << l;
    let first = if lo >= from {
        from >> l << l
    } else {
        from.checked_next_multiple_of(width)?
    };
    let last = if hi <= to {
        to >> l << l
    } else {
        to.checked_sub(width - 1)? >> l << l
    };
    (first <= last).then_some((first, last))
}

fn in_range(from: u64, to: u64) -> Expr {
    col("step").gt_eq(lit(from)).and(col("step").lt_eq(lit(to)))
}

impl Queries {
    /// Fills a grid from `run`'s rollups and raw rows (see the module docs).
    pub(crate) async fn fill<K: Ord + Clone>(
        &self,
        run: &RunId,
        read: Read<'_, K>,
        grid: &mut Grid<K>,
    ) -> Result<()> {
        self.with_timeout(self.fill_inner(run, read, grid)).await
    }

    async fn fill_inner<K: Ord + Clone>(
        &self,
        run: &RunId,
        read: Read<'_, K>,
        grid: &mut Grid<K>,
    ) -> Result<()> {
        let Buckets { from, to, .. } = read.buckets;
        let started = std::time::Instant::now();
        let view = self.store().samples_view(run);
        let level = if self.rollups {
            level(read.buckets.shift(), read.pooled)
        } else {
            None
        };
        // Rollup parts by the windows they answer; raw parts by the step ranges read raw.
        let mut tiled: BTreeMap<(u32, u64, u64), Vec<PathBuf>> = BTreeMap::new();
        let mut raw: BTreeMap<Vec<(u64, u64)>, Vec<PathBuf>> = BTreeMap::new();
        for part in view.parts {
            let Some(steps) = part.steps else {
                continue; // an empty part
            };
            if steps.1 < from || steps.0 > to {
                continue;
            }
            // Wider buckets than the part's steps span read its top level (one window a series,
            // inside one bucket); a sparse metric's rollup starts at a coarser level: narrower
            // buckets read raw.
            let level = level
                .map(|l| l.min(rollup::top_level(steps.0, steps.1)))
                .and_then(|l| self::level(l, read.pooled))
                .filter(|&l| part.has_windows(&read.select.metric, l, read.pooled));
            let windows = level
                .zip(part.rollup)
                .and_then(|(l, rollup)| windows_for(from, to, steps, l).map(|w| (l, w, rollup)));
            let Some((l, (first, last), rollup)) = windows else {
                raw.entry(vec![(from, to)]).or_default().push(part.samples);
                continue;
            };
            tiled.entry((l, first, last)).or_default().push(rollup);
            let mut edges = Vec::new();
            if first > from {
                edges.push((from, first - 1));
            }
            if let Some(after) = last.checked_add(1 << l).filter(|&a| a <= to) {
                edges.push((after, to));
            }
            if !edges.is_empty() {
                raw.entry(edges).or_default().push(part.samples);
            }
        }
        let ctx = &self.ctx;
        let filter = read.select.expr();
        // Local parts are read directly; the rest (object storage) through DataFusion.
        let local = match self.store().backend() {
            Backend::Local(l) if self.point_reads => Some(l.dir.clone()),
            _ => None,
        };
        let (mut raw_rows, mut rollup_rows) = (0u64, 0u64);
        let mut columns: Vec<&str> = read.key_columns.to_vec();
        columns.extend(["step", "value"]);
        let mut frames = Vec::new();
        let deadline = Deadline {
            at: started + self.timeout,
            after: self.timeout,
        };
        for (ranges, mut parts) in raw {
            if let Some(dir) = &local {
                let point = PointRead {
                    select: &read.select,
                    level: 0,
                    pooled: false,
                    columns: &columns,
                    steps: ("step", &ranges),
                };
                let (rows, rest) = self.point_reads(dir, &parts, &point, deadline, &mut |b| {
                    add_rows(grid, b, &read)
                })?;
                raw_rows += rows;
                if rest.is_empty() {
                    continue;
                }
                parts = rest;
            }
            let steps = ranges
                .iter()
                .map(|&(a, b)| in_range(a, b))
                .reduce(Expr::or)
                .unwrap_or_else(|| lit(false));
            frames.push(
                self.parquet(ctx, &parts, files::file_schema(Table::Samples))
                    .await?
                    .filter(filter.clone().and(steps))?,
            );
        }
        if !view.hot.is_empty() {
            frames.push(
                ctx.read_batches(view.hot)?
                    .filter(filter.clone().and(in_range(from, to)))?,
            );
        }
        let planned = started.elapsed();
        for frame in frames {
            let mut stream = frame.select_columns(&columns)?.execute_stream().await?;
            while let Some(batch) = stream.next().await {
                let batch = batch?;
                raw_rows += batch.num_rows() as u64;
                add_rows(grid, &batch, &read)?;
            }
        }
        let raw_done = started.elapsed();
        if !tiled.is_empty() {
            let mut columns: Vec<&str> = read.key_columns.to_vec();
            columns.extend([
                "start",
                "count",
                "nonfinite",
                "min",
                "max",
                "last_step",
                "last",
            ]);
            for ((l, first, last), mut parts) in tiled {
                if let Some(dir) = &local {
                    let point = PointRead {
                        select: &read.select,
                        level: l as u8,
                        pooled: read.pooled,
                        columns: &columns,
                        steps: ("start", &[(first, last)]),
                    };
                    let (rows, rest) =
                        self.point_reads(dir, &parts, &point, deadline, &mut |b| {
                            add_rollups(grid, b, &read)
                        })?;
                    rollup_rows += rows;
                    if rest.is_empty() {
                        continue;
                    }
                    parts = rest;
                }
                let filter = filter
                    .clone()
                    .and(col("level").eq(lit(l as u8)))
                    .and(col("pooled").eq(lit(read.pooled)))
                    .and(col("start").gt_eq(lit(first)))
                    .and(col("start").lt_eq(lit(last)));
                let mut stream = self
                    .parquet(ctx, &parts, rollup::schema())
                    .await?
                    .filter(filter)?
                    .select_columns(&columns)?
                    .execute_stream()
                    .await?;
                while let Some(batch) = stream.next().await {
                    let batch = batch?;
                    rollup_rows += batch.num_rows() as u64;
                    add_rollups(grid, &batch, &read)?;
                }
            }
        }
        let metrics = self.store().metrics();
        metrics.downsampled_raw_rows.inc_by(raw_rows);
        metrics.downsampled_rollup_rows.inc_by(rollup_rows);
        tracing::debug!(
            %run,
            level,
            raw_rows,
            rollup_rows,
            planned_ms = planned.as_secs_f64() * 1e3,
            raw_ms = (raw_done - planned).as_secs_f64() * 1e3,
            total_ms = started.elapsed().as_secs_f64() * 1e3,
            "downsampled read"
        );
        Ok(())
    }

    /// Point reads of local `parts` (relative to `dir`), each batch handed to `each`: file
    /// reads and decoding, so off the async workers where the runtime allows it. Returns the
    /// rows handed on and the parts that have no index to read them by (DataFusion's to read).
    fn point_reads(
        &self,
        dir: &std::path::Path,
        parts: &[PathBuf],
        read: &PointRead<'_>,
        deadline: Deadline,
        each: &mut dyn FnMut(&RecordBatch) -> Result<()>,
    ) -> Result<(u64, Vec<PathBuf>)> {
        let mut work = || -> Result<(u64, Vec<PathBuf>)> {
            let (mut rows, mut rest) = (0, Vec::new());
            for part in parts {
                deadline.check()?;
                match self.parts.read(&dir.join(part), read, deadline, each)? {
                    Some(n) => rows += n,
                    None => rest.push(part.clone()),
                }
            }
            Ok((rows, rest))
        };
        let (rows, rest) = match Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
            _ => work(),
        }?;
        self.store()
            .metrics()
            .point_read_parts
            .inc_by((parts.len() - rest.len()) as u64);
        Ok((rows, rest))
    }

    async fn parquet(
        &self,
        ctx: &SessionContext,
        parts: &[PathBuf],
        schema: arrow_schema::SchemaRef,
    ) -> Result<DataFrame> {
        let backend = self.store().backend();
        let paths: Vec<String> = parts.iter().map(|p| backend.location(p)).collect();
        Ok(ctx
            .read_parquet(paths, ParquetReadOptions::default().schema(&schema))
            .await?)
    }
}

/// Raw rows: key columns, step, value.
fn add_rows<K: Ord + Clone>(grid: &mut Grid<K>, b: &RecordBatch, read: &Read<'_, K>) -> Result<()> {
    let n = read.key_columns.len();
    let step = b.column(n).as_primitive::<UInt64Type>();
    let value = b.column(n + 1).as_primitive::<Float64Type>();
    let mut current: Option<(K, usize)> = None;
    for i in 0..b.num_rows() {
        let s = step.value(i);
        let Some(bucket) = read.buckets.index(s) else {
            continue;
        };
        let row = row_of(grid, &mut current, (read.key)(b, i))?;
        grid.rows[row][bucket].add(s, value.value(i));
    }
    Ok(())
}

/// Rollup rows: key columns, start, count, nonfinite, min, max, last_step, last.
fn add_rollups<K: Ord + Clone>(
    grid: &mut Grid<K>,
    b: &RecordBatch,
    read: &Read<'_, K>,
) -> Result<()> {
    let n = read.key_columns.len();
    let start = b.column(n).as_primitive::<UInt64Type>();
    let count = b.column(n + 1).as_primitive::<UInt64Type>();
    let nonfinite = b.column(n + 2).as_primitive::<UInt64Type>();
    let min = b.column(n + 3).as_primitive::<Float64Type>();
    let max = b.column(n + 4).as_primitive::<Float64Type>();
    let last_step = b.column(n + 5).as_primitive::<UInt64Type>();
    let last = b.column(n + 6).as_list::<i32>();
    let offsets = last.value_offsets();
    let last_values = last.values().as_primitive::<Float64Type>().values();
    let mut current: Option<(K, usize)> = None;
    let (from, to) = (read.buckets.from, read.buckets.to);
    for i in 0..b.num_rows() {
        // A window cut by an end starts before `from`; its rows are all in range.
        let Some(bucket) = read.buckets.index(start.value(i).clamp(from, to)) else {
            continue;
        };
        let row = row_of(grid, &mut current, (read.key)(b, i))?;
        let extremes = min.is_valid(i).then(|| (min.value(i), max.value(i)));
        let values = &last_values[offsets[i] as usize..offsets[i + 1] as usize];
        grid.rows[row][bucket].merge(
            count.value(i),
            nonfinite.value(i),
            extremes,
            last_step.value(i),
            values,
        );
    }
    Ok(())
}

/// The grid row of `key`; rows arrive sorted by key, so the previous row's is tried first.
fn row_of<K: Ord + Clone>(
    grid: &mut Grid<K>,
    current: &mut Option<(K, usize)>,
    key: K,
) -> Result<usize> {
    if let Some((k, row)) = current
        && *k == key
    {
        return Ok(*row);
    }
    let row = grid.row(&key)?;
    *current = Some((key, row));
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_answers_from_the_windows_its_rows_allow() {
        // A part with rows beyond both ends: only the windows inside the range.
        assert_eq!(windows_for(1, 62, (0, 100), 3), Some((8, 48)));
        assert_eq!(windows_for(0, 63, (0, 100), 3), Some((0, 56)));
        // No rows before `from` or after `to`: the cut windows too.
        assert_eq!(windows_for(1, 62, (1, 62), 3), Some((0, 56)));
        assert_eq!(windows_for(1, 62, (0, 62), 3), Some((8, 56)));
        assert_eq!(windows_for(10, 12, (10, 12), 3), Some((8, 8)));
        assert_eq!(windows_for(1, 14, (0, 20), 3), None);
        assert_eq!(windows_for(0, 6, (0, 9), 3), None);
        assert_eq!(
            windows_for(u64::MAX - 7, u64::MAX, (0, u64::MAX), 3),
            Some((u64::MAX - 7, u64::MAX - 7))
        );
        assert_eq!(level(2, false), None);
        assert_eq!(level(2, true), Some(2));
        assert_eq!(level(0, true), None);
        assert_eq!(level(5, false), Some(5));
        assert_eq!(level(40, true), Some(16));
    }
}
