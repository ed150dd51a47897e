//! Point reads: the rows of a few series from sorted local parts, without a DataFusion plan.
//!
//! # Design
//!
//! A dashboard read wants a handful of series — one rank of one layer, or every layer's
//! rank-pooled rollup rows — out of parts sorted by series. DataFusion finds them through
//! page statistics, but it plans every query afresh, opens and reads each file's footer, and
//! hops to its blocking pool: about 3 ms before the first row on a 2-core machine, most of a
//! series read and the whole difference to a DuckDB scan of a small run. Parts never change once
//! written, so this module keeps, per part, what a read needs to go straight to its rows:
//!
//! - the Parquet footer with its page index (`ArrowReaderMetadata`), read once;
//! - the part's series index: every distinct series key — (level, pooled, metric, layer, site,
//!   rank) for rollups, (metric, layer, site, rank) for samples — with the rows it occupies.
//!   A sorted part holds each series in one contiguous range; the index does not rely on it
//!   (a key met twice gets two ranges), so an unsorted part is read correctly, only slower.
//!
//! A read matches its [`Selector`] against the index, turns the matching ranges into a
//! `RowSelection` — with the page index, only the pages holding those rows are decompressed —
//! decodes only the columns asked for, and drops the rows outside its step ranges. What it
//! returns is what the DataFusion scan returned for the same filter, in the same order (the
//! part's), which `collector/tests/it/rollups.rs` checks over random runs.
//!
//! The index is built on a part's first read (one pass over its key columns, about as costly
//! as one scan of the part) and kept in a cache bounded in bytes, least recently used out. An
//! entry is keyed by the part's path, length and modification time, so a file replaced under
//! the same name is never read through a stale index; a part removed by compaction or
//! retention is not asked for again and ages out. A part whose index would take over a quarter
//! of the cache (a rollup of hundreds of thousands of series) is remembered as such and read
//! through DataFusion instead, as are parts in object storage and the hot buffer
//! ([`super::plan`]). A read checks the query's deadline between parts and batches, so the
//! query timeout still ends it.
//!
//! The rows a read decoded are kept as well, in a second cache bounded in bytes
//! (`--read-cache-bytes`), keyed by everything that decides them — the part's version, the
//! selector, level and pooling, the columns — but not the step ranges, which are applied to
//! the kept rows afresh. A dashboard asks the same overview on every refresh, and decoding
//! Parquet pages was 40 % of a 10 M-row heatmap. A read of one part whose rows pass a quarter
//! of that cache streams without keeping them, so it neither empties the cache nor holds more
//! than that quarter while it decodes. What is outside the budget: the rows of reads in
//! progress (up to a quarter each) and of evicted entries a read is still replaying. A read
//! across many parts is kept part by part, least recently used out like any other.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt8Type, UInt32Type, UInt64Type};
use arrow_array::{Array, BooleanArray, RecordBatch};
use datafusion::prelude::{Expr, col, lit};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
};
use parquet::file::metadata::PageIndexPolicy;

use crate::error::{Error, Result};

/// The cache's default size: about 1.6 M series keys across all cached parts. One part's
/// index larger than a quarter of it is not kept: that part is read through DataFusion.
pub(crate) const DEFAULT_BUDGET_BYTES: usize = 64 << 20;

/// Bytes counted for a kept read besides its rows' buffers (its key, its slot in the map, the
/// batches' structs): a generous estimate, so many small kept reads stay within the budget.
const ROWS_ENTRY_OVERHEAD: usize = 1024;

/// Rows decoded at a time.
const BATCH_ROWS: usize = 8192;

/// When a read gives up: the query's timeout, checked between parts and batches (a blocking
/// read is never interrupted by the future's timeout around it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    pub at: Instant,
    pub after: std::time::Duration,
}

impl Deadline {
    pub(crate) fn check(&self) -> Result<()> {
        if Instant::now() > self.at {
            return Err(Error::Unavailable(format!(
                "query cancelled after {:?}; narrow the step range",
                self.after
            )));
        }
        Ok(())
    }
}

/// One condition on a nullable key column.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Pick<T> {
    Any,
    Null,
    NotNull,
    Is(T),
}

impl<T> Pick<T> {
    fn admits<U>(&self, value: Option<&U>) -> bool
    where
        T: std::borrow::Borrow<U>,
        U: PartialEq + ?Sized,
    {
        match self {
            Pick::Any => true,
            Pick::Null => value.is_none(),
            Pick::NotNull => value.is_some(),
            Pick::Is(want) => value == Some(want.borrow()),
        }
    }
}

impl<T: Clone + datafusion::logical_expr::Literal> Pick<T> {
    fn expr(&self, column: &str) -> Option<Expr> {
        match self {
            Pick::Any => None,
            Pick::Null => Some(col(column).is_null()),
            Pick::NotNull => Some(col(column).is_not_null()),
            Pick::Is(v) => Some(col(column).eq(lit(v.clone()))),
        }
    }
}

/// Which series a read wants: conditions on the columns samples and rollups share.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Selector {
    pub metric: String,
    pub layer: Pick<u32>,
    pub site: Pick<String>,
    pub rank: Pick<u32>,
}

impl Selector {
    /// The same conditions as a DataFusion filter.
    pub(crate) fn expr(&self) -> Expr {
        [
            self.layer.expr("layer"),
            self.site.expr("site"),
            self.rank.expr("rank"),
        ]
        .into_iter()
        .flatten()
        .fold(col("metric").eq(lit(self.metric.clone())), Expr::and)
    }
}

/// One series of a part, its strings as positions in the part's name tables. Samples parts
/// have level 0 and `pooled` false throughout. Ordered by level, pooling and metric first, so
/// one binary search finds a read's candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct SeriesKey {
    level: u8,
    pooled: bool,
    metric: u32,
    layer: Option<u32>,
    site: Option<u32>,
    rank: Option<u32>,
}

/// A run of rows holding one series: 40 bytes, so a cache of 64 MiB holds 1.6 M of them.
#[derive(Debug, Clone, Copy)]
struct Entry {
    key: SeriesKey,
    start: u32,
    len: u32,
}

/// What a point read of one part needs: its footer and where each series lies.
#[derive(Debug)]
struct PartIndex {
    metadata: ArrowReaderMetadata,
    /// The part's distinct metric and site names; keys refer to them by position.
    metrics: Vec<Box<str>>,
    sites: Vec<Box<str>>,
    /// Sorted by key (not by row).
    entries: Vec<Entry>,
}

/// Positions of names, the previous one tried first (rows of a sorted part repeat it).
#[derive(Default)]
struct Names {
    names: Vec<Box<str>>,
    positions: HashMap<Box<str>, u32>,
    last: Option<u32>,
}

impl Names {
    fn position(&mut self, name: &str) -> Result<u32> {
        if let Some(p) = self.last
            && *self.names[p as usize] == *name
        {
            return Ok(p);
        }
        let p = match self.positions.get(name) {
            Some(&p) => p,
            None => {
                let p = u32::try_from(self.names.len()).map_err(|_| {
                    Error::Unavailable("a part names over 4 G distinct strings".into())
                })?;
                self.names.push(name.into());
                self.positions.insert(name.into(), p);
                p
            }
        };
        self.last = Some(p);
        Ok(p)
    }
}

impl PartIndex {
    /// Reads the footer and page offsets of `file` (at `path`), then its key columns once,
    /// giving up past `deadline`.
    /// None when it would hold more than `max_entries` keys.
    fn build(
        path: &Path,
        file: File,
        deadline: Deadline,
        max_entries: usize,
    ) -> Result<Option<PartIndex>> {
        // The offset index (where each page starts) is what lets a row selection skip pages;
        // the column index (per-page min/max) is not needed once the series index exists.
        let options = ArrowReaderOptions::new().with_offset_index_policy(PageIndexPolicy::Optional);
        let metadata = ArrowReaderMetadata::load(&file, options)?;
        let rows = usize::try_from(metadata.metadata().file_metadata().num_rows())
            .ok()
            .filter(|&r| u32::try_from(r).is_ok())
            .ok_or_else(|| Error::corrupt(path, "a row count outside 0..2^32 in the footer"))?;
        let schema = metadata.schema().clone();
        let wanted = ["level", "pooled", "metric", "layer", "site", "rank"];
        let roots: Vec<usize> = wanted
            .iter()
            .filter_map(|name| schema.index_of(name).ok())
            .collect();
        let mask = ProjectionMask::roots(metadata.parquet_schema(), roots);
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file, metadata.clone())
            .with_projection(mask)
            .with_batch_size(64 * 1024)
            .build()?;
        let (mut metrics, mut sites) = (Names::default(), Names::default());
        let mut entries: Vec<Entry> = Vec::new();
        let mut row = 0u32;
        for batch in reader {
            deadline.check()?;
            let batch = batch.map_err(|e| Error::corrupt(path, e.to_string()))?;
            let columns = KeyColumns::of(&batch, path)?;
            for i in 0..batch.num_rows() {
                let key = SeriesKey {
                    level: columns.level.map_or(0, |c| c.value(i)),
                    pooled: columns.pooled.is_some_and(|c| c.value(i)),
                    metric: metrics.position(columns.metric.value(i))?,
                    layer: columns.layer.is_valid(i).then(|| columns.layer.value(i)),
                    site: columns
                        .site
                        .is_valid(i)
                        .then(|| sites.position(columns.site.value(i)))
                        .transpose()?,
                    rank: columns.rank.is_valid(i).then(|| columns.rank.value(i)),
                };
                match entries.last_mut() {
                    Some(e) if e.key == key && e.start + e.len == row => e.len += 1,
                    _ => {
                        if entries.len() == max_entries {
                            return Ok(None); // too large to keep: not built further
                        }
                        entries.push(Entry {
                            key,
                            start: row,
                            len: 1,
                        });
                    }
                }
                row = row
                    .checked_add(1)
                    .filter(|&r| r as usize <= rows)
                    .ok_or_else(|| {
                        Error::corrupt(path, format!("more rows than the footer's {rows}"))
                    })?;
            }
        }
        if row as usize != rows {
            return Err(Error::corrupt(
                path,
                format!("{row} rows read, the footer says {rows}"),
            ));
        }
        // Stable: a key met in several runs (an unsorted part) keeps its runs in row order.
        entries.sort_by_key(|e| e.key);
        entries.shrink_to_fit();
        Ok(Some(PartIndex {
            metadata,
            metrics: metrics.names,
            sites: sites.names,
            entries,
        }))
    }

    /// Roughly the bytes this index holds.
    fn bytes(&self) -> usize {
        let footer = self.metadata.metadata().memory_size();
        let names: usize = self
            .metrics
            .iter()
            .chain(&self.sites)
            .map(|n| n.len() + 32)
            .sum();
        footer + names + self.entries.len() * std::mem::size_of::<Entry>()
    }

    /// The row groups holding any of `ranges` (ascending, disjoint rows of the whole part), and
    /// the ranges as a selection over those groups' rows alone. A reader sets up every column
    /// of every row group it is given, skipped or not — with zstd that is a compression and a
    /// decompression context per column chunk, 60 % of a one-series read before this — so the
    /// groups a read does not touch are left out entirely.
    fn row_groups(&self, ranges: &[Range<usize>]) -> (Vec<usize>, RowSelection) {
        let (mut groups, mut local) = (Vec::new(), Vec::new());
        let (mut start, mut kept) = (0usize, 0usize);
        let mut next = ranges.iter().peekable();
        for (g, group) in self.metadata.metadata().row_groups().iter().enumerate() {
            let end = start + usize::try_from(group.num_rows()).unwrap_or(0);
            let mut hit = false;
            while let Some(r) = next.peek() {
                if r.start >= end {
                    break;
                }
                let (a, b) = (r.start.max(start), r.end.min(end));
                if a < b {
                    local.push(a - start + kept..b - start + kept);
                    hit = true;
                }
                if r.end > end {
                    break; // the range goes on into the next group
                }
                next.next();
            }
            if hit {
                groups.push(g);
                kept += end - start;
            }
            start = end;
        }
        (
            groups,
            RowSelection::from_consecutive_ranges(local.into_iter(), kept),
        )
    }

    /// The row ranges of the series `select` admits at (`level`, `pooled`), ascending and
    /// disjoint.
    fn ranges(&self, select: &Selector, level: u8, pooled: bool) -> Vec<Range<usize>> {
        let position = |names: &[Box<str>], name: &str| names.iter().position(|n| **n == *name);
        let Some(metric) = position(&self.metrics, &select.metric) else {
            return Vec::new();
        };
        let site = match &select.site {
            Pick::Any => Pick::Any,
            Pick::Null => Pick::Null,
            Pick::NotNull => Pick::NotNull,
            Pick::Is(name) => match position(&self.sites, name) {
                Some(p) => Pick::Is(p as u32),
                None => return Vec::new(),
            },
        };
        let prefix = (level, pooled, metric as u32);
        let lo = self
            .entries
            .partition_point(|e| (e.key.level, e.key.pooled, e.key.metric) < prefix);
        let hi = lo
            + self.entries[lo..]
                .partition_point(|e| (e.key.level, e.key.pooled, e.key.metric) == prefix);
        let mut ranges: Vec<Range<usize>> = self.entries[lo..hi]
            .iter()
            .filter(|e| {
                select.layer.admits(e.key.layer.as_ref())
                    && site.admits(e.key.site.as_ref())
                    && select.rank.admits(e.key.rank.as_ref())
            })
            .map(|e| e.start as usize..(e.start + e.len) as usize)
            .collect();
        ranges.sort_unstable_by_key(|r| r.start);
        ranges
    }
}

/// The key columns of one batch of an index build.
struct KeyColumns<'a> {
    level: Option<&'a arrow_array::PrimitiveArray<UInt8Type>>,
    pooled: Option<&'a BooleanArray>,
    metric: &'a arrow_array::StringArray,
    layer: &'a arrow_array::PrimitiveArray<UInt32Type>,
    site: &'a arrow_array::StringArray,
    rank: &'a arrow_array::PrimitiveArray<UInt32Type>,
}

impl<'a> KeyColumns<'a> {
    fn of(batch: &'a RecordBatch, path: &Path) -> Result<KeyColumns<'a>> {
        let column = |name: &str| {
            batch
                .column_by_name(name)
                .ok_or_else(|| Error::corrupt(path, format!("no `{name}` column")))
        };
        let wrong =
            |name: &str| Error::corrupt(path, format!("the `{name}` column has the wrong type"));
        Ok(KeyColumns {
            level: batch
                .column_by_name("level")
                .map(|c| {
                    c.as_primitive_opt::<UInt8Type>()
                        .ok_or_else(|| wrong("level"))
                })
                .transpose()?,
            pooled: batch
                .column_by_name("pooled")
                .map(|c| c.as_boolean_opt().ok_or_else(|| wrong("pooled")))
                .transpose()?,
            metric: column("metric")?
                .as_string_opt::<i32>()
                .ok_or_else(|| wrong("metric"))?,
            layer: column("layer")?
                .as_primitive_opt::<UInt32Type>()
                .ok_or_else(|| wrong("layer"))?,
            site: column("site")?
                .as_string_opt::<i32>()
                .ok_or_else(|| wrong("site"))?,
            rank: column("rank")?
                .as_primitive_opt::<UInt32Type>()
                .ok_or_else(|| wrong("rank"))?,
        })
    }
}

/// What identifies a version of a file on disk.
type Version = (u64, Option<SystemTime>);

/// A map bounded in bytes, least recently used out: the part indexes and the decoded rows.
/// Use order is kept beside the map, so an eviction takes the oldest entry without a scan.
#[derive(Debug)]
struct Lru<K, V> {
    /// Each value with the bytes counted for it and when it was last used.
    entries: HashMap<K, (V, usize, u64)>,
    /// The keys by when they were last used (ticks are unique).
    by_use: BTreeMap<u64, K>,
    bytes: usize,
    budget: usize,
    tick: u64,
}

impl<K: std::hash::Hash + Eq + Clone, V: Clone> Lru<K, V> {
    fn new(budget: usize) -> Self {
        Lru {
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            bytes: 0,
            budget,
            tick: 0,
        }
    }

    /// The value of `key`, now the most recently used.
    fn get<Q>(&mut self, key: &Q) -> Option<V>
    where
        K: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        let (value, _, used) = self.entries.get_mut(key)?;
        self.tick += 1;
        if let Some(k) = self.by_use.remove(used) {
            self.by_use.insert(self.tick, k);
        }
        *used = self.tick;
        Some(value.clone())
    }

    /// Keeps `value` under `key` (replacing what was there), then drops the least recently
    /// used entries other than this one until the map is within its budget.
    fn insert(&mut self, key: K, value: V, bytes: usize) {
        self.tick += 1;
        if let Some((_, old, used)) = self.entries.insert(key.clone(), (value, bytes, self.tick)) {
            self.bytes -= old;
            self.by_use.remove(&used);
        }
        self.by_use.insert(self.tick, key);
        self.bytes += bytes;
        // The entry just kept is the most recently used: the last one left, never evicted.
        while self.bytes > self.budget && self.entries.len() > 1 {
            let Some((_, oldest)) = self.by_use.pop_first() else {
                break;
            };
            if let Some((_, freed, _)) = self.entries.remove(&oldest) {
                self.bytes -= freed;
            }
        }
    }
}

/// A cached part index: the file's version it was built from, and the index (None: too
/// large to keep, read through DataFusion).
type CachedIndex = (Version, Option<Arc<PartIndex>>);

/// What one read decoded, identified by everything that decides it: the file's version, the
/// series and the columns. The step ranges are not in it: they are applied to the decoded
/// rows, so a read of other steps of the same series reuses them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct RowsKey {
    path: PathBuf,
    version: Version,
    level: u8,
    pooled: bool,
    select: Selector,
    /// The part's column positions decoded, ascending.
    columns: Vec<usize>,
}

/// The counters of the read caches, exported by the store's metrics.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Part indexes built.
    pub builds: prometheus_client::metrics::counter::Counter,
    /// Reads answered from rows an earlier read decoded.
    pub rows_reused: prometheus_client::metrics::counter::Counter,
}

/// The per-part indexes and the rows recent reads decoded, shared by every query of a
/// collector.
#[derive(Debug)]
pub(crate) struct PartIndexes {
    indexes: Mutex<Lru<PathBuf, CachedIndex>>,
    /// Parts never change once written, so decoded rows stay true until the part is gone.
    /// What a dashboard asks again and again (the overview's heatmap on every refresh) is
    /// then answered without decoding Parquet pages, which was 40 % of a 10 M-row heatmap.
    rows: Mutex<Lru<RowsKey, Arc<[RecordBatch]>>>,
    counters: Counters,
}

/// One point read: which rows of a part, which columns, which steps.
pub(crate) struct PointRead<'a> {
    pub select: &'a Selector,
    /// Rollup level and pooling; (0, false) for a samples part.
    pub level: u8,
    pub pooled: bool,
    /// Columns of the batches handed on, in this order.
    pub columns: &'a [&'a str],
    /// The step-like column (`step`, or a rollup's `start`) and the inclusive ranges kept.
    pub steps: (&'a str, &'a [(u64, u64)]),
}

/// Locks a cache. A panic while holding the lock leaves a consistent map (every change is
/// one insert or remove), so a poisoned lock is used as it is.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PartIndexes {
    /// Caches of `index_budget` bytes of part indexes and `rows_budget` bytes of decoded rows
    /// (0: none kept).
    pub(crate) fn new(index_budget: usize, rows_budget: usize, counters: Counters) -> Self {
        PartIndexes {
            indexes: Mutex::new(Lru::new(index_budget)),
            rows: Mutex::new(Lru::new(rows_budget)),
            counters,
        }
    }

    /// The index of `file` (the part at `path`), built now unless cached for this version of
    /// it; None for a part whose index is too large to keep.
    fn index(
        &self,
        path: &Path,
        version: Version,
        file: &File,
        deadline: Deadline,
    ) -> Result<Option<Arc<PartIndex>>> {
        if let Some((v, index)) = lock(&self.indexes).get(path)
            && v == version
        {
            return Ok(index);
        }
        // Two queries meeting the same cold part both build it; the second insert replaces
        // the first (both are the same index), and the count says so.
        let budget = lock(&self.indexes).budget;
        let max_entries = budget / 4 / std::mem::size_of::<Entry>();
        let index = PartIndex::build(path, file.try_clone()?, deadline, max_entries)?.map(Arc::new);
        self.counters.builds.inc();
        let bytes = index.as_ref().map_or(64, |i| i.bytes());
        lock(&self.indexes).insert(path.to_owned(), (version, index.clone()), bytes);
        Ok(index)
    }

    /// Hands `each` the batches of `read` from the part at `path`; returns the rows handed on,
    /// or None when the part has no index to read it by (too large: DataFusion's to read).
    pub(crate) fn read(
        &self,
        path: &Path,
        read: &PointRead<'_>,
        deadline: Deadline,
        each: &mut dyn FnMut(&RecordBatch) -> Result<()>,
    ) -> Result<Option<u64>> {
        // One handle for the version check, the index and the read: a part replaced in
        // between is never decoded with another file's footer.
        let file = File::open(path)?;
        let stat = file.metadata()?;
        let version: Version = (stat.len(), stat.modified().ok());
        let Some(index) = self.index(path, version, &file, deadline)? else {
            return Ok(None);
        };
        let ranges = index.ranges(read.select, read.level, read.pooled);
        if ranges.is_empty() {
            return Ok(Some(0));
        }
        let schema = index.metadata.schema().clone();
        let mut wanted: Vec<usize> = read
            .columns
            .iter()
            .chain(std::iter::once(&read.steps.0))
            .map(|name| {
                schema
                    .index_of(name)
                    .map_err(|_| Error::corrupt(path, format!("no `{name}` column")))
            })
            .collect::<Result<_>>()?;
        wanted.sort_unstable();
        wanted.dedup();
        let mut hand = Hand::new(path, read, each);
        let key = RowsKey {
            path: path.to_owned(),
            version,
            level: read.level,
            pooled: read.pooled,
            select: read.select.clone(),
            columns: wanted,
        };
        // Taken out of the cache before it is replayed: the lock is never held across the
        // caller's work on the rows.
        let cached = lock(&self.rows).get(&key);
        if let Some(batches) = cached {
            self.counters.rows_reused.inc();
            for batch in batches.iter() {
                deadline.check()?;
                hand.batch(batch)?;
            }
            return Ok(Some(hand.handed));
        }
        let mask =
            ProjectionMask::roots(index.metadata.parquet_schema(), key.columns.iter().copied());
        let (groups, selection) = index.row_groups(&ranges);
        let reader =
            ParquetRecordBatchReaderBuilder::new_with_metadata(file, index.metadata.clone())
                .with_projection(mask)
                .with_row_groups(groups)
                .with_row_selection(selection)
                .with_batch_size(BATCH_ROWS)
                .build()?;
        // Kept while they fit a quarter of the cache: one large read (the raw rows of a whole
        // part) neither empties the cache nor holds more than that while it streams. Counted
        // with what the batches' buffers do not show: the key, the map's slot, the batches'
        // own structs.
        let most = lock(&self.rows).budget / 4;
        let fixed = key.path.as_os_str().len() + ROWS_ENTRY_OVERHEAD;
        let mut kept = (fixed <= most).then(|| (Vec::new(), fixed));
        for batch in reader {
            deadline.check()?;
            let batch = batch.map_err(|e| Error::corrupt(path, e.to_string()))?;
            if let Some((batches, bytes)) = &mut kept {
                *bytes += batch.get_array_memory_size();
                if *bytes <= most {
                    batches.push(batch.clone());
                } else {
                    kept = None;
                }
            }
            hand.batch(&batch)?;
        }
        if let Some((batches, bytes)) = kept {
            lock(&self.rows).insert(key, batches.into(), bytes);
        }
        Ok(Some(hand.handed))
    }
}

/// Hands on the decoded batches of one read: its rows within the step ranges, its columns
/// in the order asked for.
struct Hand<'r, 'a> {
    path: &'r Path,
    read: &'r PointRead<'a>,
    each: &'r mut dyn FnMut(&RecordBatch) -> Result<()>,
    /// The asked-for columns' positions in a decoded batch (all have the same schema).
    order: Option<Vec<usize>>,
    handed: u64,
}

impl<'r, 'a> Hand<'r, 'a> {
    fn new(
        path: &'r Path,
        read: &'r PointRead<'a>,
        each: &'r mut dyn FnMut(&RecordBatch) -> Result<()>,
    ) -> Self {
        Hand {
            path,
            read,
            each,
            order: None,
            handed: 0,
        }
    }

    fn batch(&mut self, batch: &RecordBatch) -> Result<()> {
        // Errors here are the part's (or this module's), never the request's.
        let path = self.path;
        let broken = |e: arrow_schema::ArrowError| Error::corrupt(path, e.to_string());
        let order = match &self.order {
            Some(order) => order,
            None => {
                let schema = batch.schema();
                let order: Vec<usize> = self
                    .read
                    .columns
                    .iter()
                    .map(|name| schema.index_of(name))
                    .collect::<std::result::Result<_, _>>()
                    .map_err(broken)?;
                self.order.insert(order)
            }
        };
        let (column, ranges) = self.read.steps;
        let steps = batch
            .column_by_name(column)
            .and_then(|c| c.as_primitive_opt::<UInt64Type>())
            .ok_or_else(|| Error::corrupt(path, format!("no integer `{column}` column")))?;
        let keep: BooleanArray = steps
            .values()
            .iter()
            .map(|s| Some(ranges.iter().any(|&(a, b)| a <= *s && *s <= b)))
            .collect();
        let batch = batch.project(order).map_err(broken)?;
        let batch = if keep.true_count() == keep.len() {
            batch
        } else {
            arrow_select::filter::filter_record_batch(&batch, &keep).map_err(broken)?
        };
        if batch.num_rows() > 0 {
            self.handed += batch.num_rows() as u64;
            (self.each)(&batch)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{ArrayRef, Float64Array, StringArray, UInt32Array, UInt64Array};
    use parquet::arrow::ArrowWriter;
    use parquet::file::properties::WriterProperties;

    /// (layer, site, rank, step) of a row read back.
    type ReadRow = (Option<u32>, Option<String>, Option<u32>, u64);
    type Row = (
        &'static str,
        Option<u32>,
        Option<&'static str>,
        Option<u32>,
        u64,
    );

    /// A samples-like part of `rows`, in the order given, in row groups of 4 rows and pages of 3.
    fn part(dir: &Path, name: &str, rows: &[Row]) -> PathBuf {
        let columns: Vec<(&str, ArrayRef)> = vec![
            (
                "metric",
                Arc::new(StringArray::from_iter_values(rows.iter().map(|r| r.0))),
            ),
            (
                "layer",
                Arc::new(UInt32Array::from_iter(rows.iter().map(|r| r.1))),
            ),
            (
                "site",
                Arc::new(StringArray::from_iter(rows.iter().map(|r| r.2))),
            ),
            (
                "rank",
                Arc::new(UInt32Array::from_iter(rows.iter().map(|r| r.3))),
            ),
            (
                "step",
                Arc::new(UInt64Array::from_iter_values(rows.iter().map(|r| r.4))),
            ),
            (
                "value",
                Arc::new(Float64Array::from_iter_values(
                    rows.iter().map(|r| r.4 as f64 / 2.0),
                )),
            ),
        ];
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let path = dir.join(name);
        // Row groups of 4 rows: reads pick groups, and ranges cross their edges.
        let properties = WriterProperties::builder()
            .set_max_row_group_row_count(Some(4))
            .set_data_page_row_count_limit(3)
            .set_write_batch_size(3)
            .build();
        let mut writer = ArrowWriter::try_new(
            File::create(&path).unwrap(),
            batch.schema(),
            Some(properties),
        )
        .unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
        path
    }

    /// (layer, site, rank, step) of every row a read hands on, in order.
    fn read_all(
        indexes: &PartIndexes,
        path: &Path,
        select: &Selector,
        steps: &[(u64, u64)],
    ) -> Vec<ReadRow> {
        let read = PointRead {
            select,
            level: 0,
            pooled: false,
            columns: &["layer", "site", "rank", "step"],
            steps: ("step", steps),
        };
        let mut out = Vec::new();
        indexes
            .read(path, &read, far(), &mut |b| {
                let layer = b.column(0).as_primitive::<UInt32Type>();
                let site = b.column(1).as_string::<i32>();
                let rank = b.column(2).as_primitive::<UInt32Type>();
                let step = b.column(3).as_primitive::<UInt64Type>();
                for i in 0..b.num_rows() {
                    out.push((
                        layer.is_valid(i).then(|| layer.value(i)),
                        site.is_valid(i).then(|| site.value(i).to_owned()),
                        rank.is_valid(i).then(|| rank.value(i)),
                        step.value(i),
                    ));
                }
                Ok(())
            })
            .unwrap()
            .expect("an index small enough to keep");
        out
    }

    /// Caches with room for every index and `rows_budget` bytes of decoded rows.
    fn keeping(rows_budget: usize) -> PartIndexes {
        PartIndexes::new(DEFAULT_BUDGET_BYTES, rows_budget, Counters::default())
    }

    /// A deadline no test reaches.
    fn far() -> Deadline {
        let after = std::time::Duration::from_secs(3600);
        Deadline {
            at: Instant::now() + after,
            after,
        }
    }

    fn build(path: &Path) -> PartIndex {
        PartIndex::build(path, File::open(path).unwrap(), far(), usize::MAX)
            .unwrap()
            .unwrap()
    }

    const ROWS: &[Row] = &[
        ("loss", None, None, Some(0), 1),
        ("spectral.ratio", Some(1), None, None, 1),
        ("loss", None, None, Some(0), 2),
        ("act_max", Some(0), Some("mlp_out"), Some(1), 1),
        ("spectral.ratio", Some(0), None, None, 1),
        ("spectral.ratio", Some(1), None, None, 2),
        ("act_max", Some(0), Some("attn_out"), Some(1), 1),
        ("spectral.ratio", Some(0), None, None, 2),
        ("loss", None, None, Some(1), 1),
        ("spectral.ratio", Some(1), None, None, 3),
    ];

    /// The rows a filter over every row keeps, in file order: what DataFusion would return.
    fn expected(select: &Selector, steps: &[(u64, u64)]) -> Vec<ReadRow> {
        ROWS.iter()
            .filter(|r| {
                r.0 == select.metric
                    && select.layer.admits(r.1.as_ref())
                    && select.site.admits::<str>(r.2)
                    && select.rank.admits(r.3.as_ref())
                    && steps.iter().any(|&(a, b)| a <= r.4 && r.4 <= b)
            })
            .map(|r| (r.1, r.2.map(str::to_owned), r.3, r.4))
            .collect()
    }

    #[test]
    fn an_unsorted_part_is_read_exactly_as_a_filter_over_every_row() {
        let dir = tempfile::tempdir().unwrap();
        let path = part(dir.path(), "unsorted.parquet", ROWS);
        let selectors = [
            Selector {
                metric: "spectral.ratio".into(),
                layer: Pick::NotNull,
                site: Pick::Null,
                rank: Pick::Any,
            },
            Selector {
                metric: "spectral.ratio".into(),
                layer: Pick::Is(1),
                site: Pick::Any,
                rank: Pick::Null,
            },
            Selector {
                metric: "loss".into(),
                layer: Pick::Any,
                site: Pick::Any,
                rank: Pick::Is(0),
            },
            Selector {
                metric: "act_max".into(),
                layer: Pick::Is(0),
                site: Pick::Is("attn_out".into()),
                rank: Pick::Any,
            },
            Selector {
                metric: "act_max".into(),
                layer: Pick::Any,
                site: Pick::Is("no such site".into()),
                rank: Pick::Any,
            },
            Selector {
                metric: "no such metric".into(),
                layer: Pick::Any,
                site: Pick::Any,
                rank: Pick::Any,
            },
        ];
        // Without decoded rows kept, and with them (the later step ranges of a series then
        // come from the rows its first read decoded).
        for rows_budget in [0, DEFAULT_BUDGET_BYTES] {
            let indexes = keeping(rows_budget);
            for select in &selectors {
                for steps in [&[(0, 10)][..], &[(2, 2)], &[(1, 1), (3, 3)], &[]] {
                    assert_eq!(
                        read_all(&indexes, &path, select, steps),
                        expected(select, steps),
                        "{select:?} {steps:?} {rows_budget}"
                    );
                }
            }
            assert_eq!(
                indexes.counters.builds.get(),
                1,
                "one index for the part, reused"
            );
            // Four selectors match rows, each read four times: three of them reuse.
            let reused = if rows_budget == 0 { 0 } else { 4 * 3 };
            assert_eq!(indexes.counters.rows_reused.get(), reused);
        }
        assert!(
            !expected(&selectors[0], &[(0, 10)]).is_empty(),
            "the cases read something"
        );
    }

    #[test]
    fn a_read_sets_up_only_the_row_groups_it_touches() {
        let dir = tempfile::tempdir().unwrap();
        let index = build(&part(dir.path(), "groups.parquet", ROWS));
        // Groups of rows 0..4, 4..8, 8..10.
        let (groups, selection) = index.row_groups(&[1..2, 3..5]);
        assert_eq!(groups, vec![0, 1]);
        assert_eq!(
            (selection.row_count(), selection.skipped_row_count()),
            (3, 5)
        );
        let (groups, selection) = index.row_groups(&[9..10, 10..10]);
        assert_eq!(groups, vec![2]);
        assert_eq!(
            (selection.row_count(), selection.skipped_row_count()),
            (1, 1)
        );
        let (groups, selection) = index.row_groups(&[0..5, 5..10]);
        assert_eq!(groups, vec![0, 1, 2]);
        assert_eq!(selection.row_count(), 10);
        let (groups, selection) = index.row_groups(&[2..3, 8..9]);
        assert_eq!(groups, vec![0, 2]);
        assert_eq!(
            (selection.row_count(), selection.skipped_row_count()),
            (2, 4)
        );
    }

    #[test]
    fn the_cache_stays_within_its_budget_and_rebuilds_what_it_evicted() {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = (0..3)
            .map(|i| part(dir.path(), &format!("p{i}.parquet"), ROWS))
            .collect();
        let one = build(&paths[0]).bytes();
        // Room for two indexes.
        let indexes = PartIndexes::new(2 * one + one / 2, 0, Counters::default());
        let select = every_loss();
        let want = expected(&select, &[(0, 10)]);
        for path in paths.iter().chain(&paths) {
            assert_eq!(read_all(&indexes, path, &select, &[(0, 10)]), want);
            assert!(lock(&indexes.indexes).bytes <= 2 * one + one / 2);
        }
        assert_eq!(lock(&indexes.indexes).entries.len(), 2);
        // Each of the three read twice with room for two, least recently used out: six builds.
        assert_eq!(indexes.counters.builds.get(), 6);
        // A part rewritten under the same name is indexed again, not read through the old index.
        std::fs::remove_file(&paths[2]).unwrap();
        part(dir.path(), "p2.parquet", &ROWS[..4]);
        let before = indexes.counters.builds.get();
        // Its first four rows hold the first two `loss` rows (the length differs, so the
        // version does even within the modification time's resolution).
        assert_eq!(
            read_all(&indexes, &paths[2], &select, &[(0, 10)]),
            want[..2].to_vec()
        );
        assert_eq!(indexes.counters.builds.get(), before + 1);
    }

    /// Every `loss` series.
    fn every_loss() -> Selector {
        Selector {
            metric: "loss".into(),
            layer: Pick::Any,
            site: Pick::Any,
            rank: Pick::Any,
        }
    }

    /// The steps 0..=10 of `select`'s series.
    fn steps_of(select: &Selector) -> PointRead<'_> {
        PointRead {
            select,
            level: 0,
            pooled: false,
            columns: &["step"],
            steps: ("step", &[(0, 10)]),
        }
    }

    #[test]
    fn a_part_whose_index_is_too_large_is_left_to_datafusion_and_remembered() {
        let dir = tempfile::tempdir().unwrap();
        let path = part(dir.path(), "wide.parquet", ROWS);
        // Room for a quarter-budget of 2 keys; the part has 7 distinct series.
        let indexes = PartIndexes::new(
            4 * 2 * std::mem::size_of::<Entry>(),
            DEFAULT_BUDGET_BYTES,
            Counters::default(),
        );
        let select = every_loss();
        let read = steps_of(&select);
        for _ in 0..2 {
            let got = indexes
                .read(&path, &read, far(), &mut |_| panic!("nothing is read"))
                .unwrap();
            assert_eq!(got, None);
        }
        assert_eq!(
            indexes.counters.builds.get(),
            1,
            "the verdict is cached like an index"
        );
    }

    #[test]
    fn a_read_past_its_deadline_is_cancelled_with_the_query_timeout_message() {
        let dir = tempfile::tempdir().unwrap();
        let path = part(dir.path(), "late.parquet", ROWS);
        let select = every_loss();
        let read = steps_of(&select);
        let past = Deadline {
            at: Instant::now() - std::time::Duration::from_millis(1),
            after: std::time::Duration::from_secs(30),
        };
        // Decoding, and replaying rows kept by an earlier read.
        let decoding = keeping(0);
        let kept = keeping(DEFAULT_BUDGET_BYTES);
        kept.read(&path, &read, far(), &mut |_| Ok(())).unwrap();
        for indexes in [&decoding, &kept] {
            let err = indexes
                .read(&path, &read, past, &mut |_| Ok(()))
                .unwrap_err();
            assert!(matches!(err, Error::Unavailable(_)), "{err}");
            assert!(
                err.to_string().contains("query cancelled after 30s"),
                "{err}"
            );
        }
        assert_eq!(
            kept.counters.rows_reused.get(),
            1,
            "the late read was a replay"
        );
    }

    #[test]
    fn decoded_rows_serve_other_steps_of_the_same_series_and_never_another_version_of_the_part() {
        let dir = tempfile::tempdir().unwrap();
        let path = part(dir.path(), "kept.parquet", ROWS);
        let indexes = keeping(DEFAULT_BUDGET_BYTES);
        let select = every_loss();
        let want = expected(&select, &[(0, 10)]);
        // The narrow range first: what is kept is every row of the series, not the first
        // read's steps.
        assert_eq!(
            read_all(&indexes, &path, &select, &[(2, 2)]),
            expected(&select, &[(2, 2)])
        );
        assert_eq!(
            indexes.counters.rows_reused.get(),
            0,
            "the first read decodes"
        );
        assert_eq!(read_all(&indexes, &path, &select, &[(0, 10)]), want);
        assert_eq!(
            indexes.counters.rows_reused.get(),
            1,
            "the second reuses its rows"
        );
        // Other columns are another read: decoded, not taken from rows that lack them.
        let read = steps_of(&select);
        let mut steps = Vec::new();
        indexes
            .read(&path, &read, far(), &mut |b| {
                assert_eq!(b.num_columns(), 1);
                steps.extend(
                    b.column(0)
                        .as_primitive::<UInt64Type>()
                        .values()
                        .iter()
                        .copied(),
                );
                Ok(())
            })
            .unwrap();
        assert_eq!(steps, want.iter().map(|r| r.3).collect::<Vec<_>>());
        assert_eq!(indexes.counters.rows_reused.get(), 1);
        // The part rewritten under the same name (shorter, so its version differs even within
        // the modification time's resolution): its own rows, not the kept ones.
        std::fs::remove_file(&path).unwrap();
        part(dir.path(), "kept.parquet", &ROWS[..4]);
        assert_eq!(
            read_all(&indexes, &path, &select, &[(0, 10)]),
            want[..2].to_vec()
        );
        assert_eq!(indexes.counters.rows_reused.get(), 1);
    }

    #[test]
    fn the_rows_cache_keeps_within_its_budget_and_streams_what_would_not_fit() {
        let dir = tempfile::tempdir().unwrap();
        let first = part(dir.path(), "rx.parquet", ROWS);
        let select = every_loss();
        let want = expected(&select, &[(0, 10)]);
        // How much one read keeps, measured with room for it (its path as long as the parts'
        // below: the path is counted too).
        let roomy = keeping(DEFAULT_BUDGET_BYTES);
        read_all(&roomy, &first, &select, &[(0, 10)]);
        let one = lock(&roomy.rows).bytes;
        assert!(one > 0);
        // Room for four such reads (a quarter of the budget is one): five parts read in turn,
        // twice, so each has been evicted by the time it is read again.
        let paths: Vec<PathBuf> = (0..5)
            .map(|i| part(dir.path(), &format!("r{i}.parquet"), ROWS))
            .collect();
        let indexes = keeping(4 * one);
        for path in paths.iter().chain(&paths) {
            assert_eq!(read_all(&indexes, path, &select, &[(0, 10)]), want);
            assert!(lock(&indexes.rows).bytes <= 4 * one);
        }
        assert_eq!(lock(&indexes.rows).entries.len(), 4);
        assert_eq!(indexes.counters.rows_reused.get(), 0, "every read decoded");
        // The last four are kept: the most recent is reused.
        assert_eq!(read_all(&indexes, &paths[4], &select, &[(0, 10)]), want);
        assert_eq!(indexes.counters.rows_reused.get(), 1);
        // With a budget whose quarter is below one read's rows, nothing is kept, and every
        // read is still whole.
        let small = keeping(4 * one - 4);
        for _ in 0..2 {
            assert_eq!(read_all(&small, &first, &select, &[(0, 10)]), want);
        }
        assert_eq!(small.counters.rows_reused.get(), 0);
        assert_eq!(lock(&small.rows).bytes, 0);
    }

    #[test]
    fn the_least_recently_used_entry_goes_first_and_never_the_one_just_kept() {
        let mut lru: Lru<u32, u32> = Lru::new(10);
        lru.insert(1, 10, 4);
        lru.insert(2, 20, 4);
        assert_eq!(lru.get(&1), Some(10)); // 2 is now the least recently used
        lru.insert(3, 30, 4);
        assert_eq!(
            (lru.get(&2), lru.get(&1), lru.get(&3)),
            (None, Some(10), Some(30))
        );
        assert_eq!(lru.bytes, 8);
        // Larger than the budget by itself: kept alone.
        lru.insert(4, 40, 11);
        assert_eq!((lru.entries.len(), lru.bytes), (1, 11));
        // Replacing a key counts its new size only.
        lru.insert(4, 41, 2);
        assert_eq!((lru.get(&4), lru.bytes), (Some(41), 2));
    }
}
