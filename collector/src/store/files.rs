//! Writing and reading the Parquet files of the store.
//!
//! Files are zstd-compressed and sorted — samples by (metric, layer, site, rank, step),
//! sketches by (step, rank) — with small data pages and page-level statistics, so a query
//! for one series reads a few pages instead of the file. The `run` column is not stored:
//! it is the Hive partition directory `run=<id>`, which is how DuckDB, Spark and Trino expect
//! partition columns.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::UInt64Type;
use arrow_row::{RowConverter, SortField};
use arrow_schema::{SchemaRef, SortOptions};
use parquet::arrow::ArrowWriter;

use crate::disk::Disk;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::SortingColumn;
use parquet::file::properties::{EnabledStatistics, WriterProperties};

use crate::entry::Table;
use crate::error::{Error, Result};

/// Columns a table is sorted by, by name.
pub fn sort_columns(table: Table) -> &'static [&'static str] {
    match table {
        Table::Samples => &["metric", "layer", "site", "rank", "step"],
        Table::Sketches => &["step", "rank"],
        Table::Runs => &[],
    }
}

/// The stored schema of `table`: the wire schema without `run`.
pub fn file_schema(table: Table) -> SchemaRef {
    let full = crate::entry::schema_of(table);
    let fields: Vec<_> = full
        .fields()
        .iter()
        .filter(|f| f.name() != "run")
        .cloned()
        .collect();
    Arc::new(arrow_schema::Schema::new(fields))
}

/// Drops the `run` column of a wire batch.
pub fn without_run(batch: &RecordBatch) -> Result<RecordBatch> {
    let keep: Vec<usize> = (0..batch.num_columns())
        .filter(|&i| batch.schema().field(i).name() != "run")
        .collect();
    batch.project(&keep).map_err(Error::Arrow)
}

/// The rows of `batches` (file schema) in the table's order, as one batch.
pub fn sorted(table: Table, batches: &[RecordBatch]) -> Result<RecordBatch> {
    let schema = file_schema(table);
    let keys = sort_columns(table);
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    if keys.is_empty() || rows < 2 {
        return arrow_select::concat::concat_batches(&schema, batches).map_err(Error::Arrow);
    }
    // The sort is most of a flush's CPU, so it is done without comparing rows. The sort
    // columns but the last (for samples the series: metric, layer, site, rank; for sketches
    // the step) become byte-comparable rows (arrow-row) and each distinct one gets its rank
    // among the distinct values; a counting sort by that rank then puts the rows of each
    // together in arrival order, and only a group whose last sort column (the step; a
    // sketch's rank) does not already ascend is sorted further, stably.
    // The key columns of the output are taken from the distinct keys by rank (sequential,
    // from a table that fits in cache); only the other columns are gathered from the batches
    // as they are: concatenating them first copied every row once more.
    let (series_keys, last_key) = keys.split_at(keys.len() - 1);
    let column = |batch: &RecordBatch, name: &str| {
        batch
            .column_by_name(name)
            .cloned()
            .ok_or_else(|| Error::Corrupt {
                what: format!("a {} batch", table.as_str()),
                reason: format!("it has no `{name}` column"),
            })
    };
    let fields = series_keys
        .iter()
        .map(|name| {
            let field = schema.field_with_name(name).map_err(Error::Arrow)?;
            Ok(SortField::new_with_options(
                field.data_type().clone(),
                SortOptions {
                    descending: false,
                    nulls_first: true,
                },
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let converter = RowConverter::new(fields).map_err(Error::Arrow)?;
    let converted = batches
        .iter()
        .map(|batch| {
            let columns = series_keys
                .iter()
                .map(|name| column(batch, name))
                .collect::<Result<Vec<_>>>()?;
            converter.convert_columns(&columns).map_err(Error::Arrow)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut ids: foldhash::HashMap<arrow_row::Row<'_>, u32> = Default::default();
    let series: Vec<u32> = converted
        .iter()
        .flat_map(|rows| rows.iter())
        .map(|row| {
            let next = ids.len() as u32;
            *ids.entry(row).or_insert(next)
        })
        .collect();
    let mut distinct: Vec<(arrow_row::Row<'_>, u32)> = ids.into_iter().collect();
    distinct.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let mut rank_of = vec![0u32; distinct.len()];
    for (rank, (_, id)) in distinct.iter().enumerate() {
        rank_of[*id as usize] = rank as u32;
    }
    let distinct_keys = converter
        .convert_rows(distinct.iter().map(|(row, _)| *row))
        .map_err(Error::Arrow)?;
    let mut last: Vec<u64> = Vec::with_capacity(rows);
    for batch in batches {
        let values = column(batch, last_key[0])?;
        match values.data_type() {
            arrow_schema::DataType::UInt64 => {
                last.extend_from_slice(values.as_primitive::<UInt64Type>().values())
            }
            arrow_schema::DataType::UInt32 => last.extend(
                values
                    .as_primitive::<arrow_array::types::UInt32Type>()
                    .values()
                    .iter()
                    .map(|&v| u64::from(v)),
            ),
            other => {
                return Err(Error::Corrupt {
                    what: format!("a {} batch", table.as_str()),
                    reason: format!("its `{}` column is {other}, not an integer", last_key[0]),
                });
            }
        }
    }
    // Counting sort by series rank: where each series' rows start in the output.
    let mut starts = vec![0usize; distinct.len() + 1];
    for &id in &series {
        starts[rank_of[id as usize] as usize + 1] += 1;
    }
    for i in 1..starts.len() {
        starts[i] += starts[i - 1];
    }
    let mut next = starts.clone();
    // (last key, batch, row) of each output row; arrival order within a series.
    let mut order: Vec<(u64, u32, u32)> = vec![(0, 0, 0); rows];
    let mut arrival = 0usize;
    for (b, batch) in batches.iter().enumerate() {
        for row in 0..batch.num_rows() {
            let rank = rank_of[series[arrival] as usize] as usize;
            order[next[rank]] = (last[arrival], b as u32, row as u32);
            next[rank] += 1;
            arrival += 1;
        }
    }
    for range in starts.windows(2) {
        let run = &mut order[range[0]..range[1]];
        if !run.is_sorted_by_key(|o| o.0) {
            // Stable: equal steps keep their arrival order.
            run.sort_by_key(|o| o.0);
        }
    }
    let indices: Vec<(usize, usize)> = order
        .iter()
        .map(|&(_, b, row)| (b as usize, row as usize))
        .collect();
    // The distinct key of each output row, by rank: runs of equal ranks, ascending.
    let ranks = arrow_array::UInt32Array::from_iter_values(
        starts
            .windows(2)
            .enumerate()
            .flat_map(|(rank, range)| std::iter::repeat_n(rank as u32, range[1] - range[0])),
    );
    let out_schema = batches[0].schema();
    let out_columns = out_schema
        .fields()
        .iter()
        .map(|field| {
            let name = field.name();
            match series_keys.iter().position(|k| k == name) {
                Some(k) => {
                    arrow_select::take::take(&distinct_keys[k], &ranks, None).map_err(Error::Arrow)
                }
                None => {
                    let sources = batches
                        .iter()
                        .map(|batch| column(batch, name))
                        .collect::<Result<Vec<_>>>()?;
                    let sources: Vec<&dyn arrow_array::Array> =
                        sources.iter().map(|a| a.as_ref()).collect();
                    arrow_select::interleave::interleave(&sources, &indices).map_err(Error::Arrow)
                }
            }
        })
        .collect::<Result<Vec<_>>>()?;
    RecordBatch::try_new(out_schema, out_columns).map_err(Error::Arrow)
}

/// Step range of a file-schema batch.
pub fn step_range(batch: &RecordBatch) -> (Option<u64>, Option<u64>) {
    let Some(step) = batch.column_by_name("step") else {
        return (None, None);
    };
    let step = step.as_primitive::<UInt64Type>();
    (step.iter().flatten().min(), step.iter().flatten().max())
}

/// How a part is laid out: the columns it is sorted by (recorded in the footer) and the
/// integer columns that are delta-encoded. Every part is zstd-compressed (level 3), in pages
/// of 8 k rows; floating-point columns are byte-stream-split, never dictionary-encoded.
///
/// Why no dictionary for floats: measured values are nearly all distinct, so the writer
/// filled a 1 MB dictionary page per column chunk before falling back to plain pages, and a
/// reader must decompress a chunk's dictionary before any page of it. A dashboard read of a
/// few hundred rollup rows paid ~3 MB of zstd per row group (value, min, max, last), ~3 ms
/// per file: most of an overview query's time (docs/performance.md § Dashboard).
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub sorted_by: &'static [&'static str],
    /// Integer columns that mostly step by a constant (window starts).
    pub delta_columns: &'static [&'static str],
}

impl Layout {
    /// Side tables (run metadata, alerts): unsorted.
    pub const UNSORTED: Layout = Layout {
        sorted_by: &[],
        delta_columns: &[],
    };

    /// A table's own layout.
    pub fn of(table: Table) -> Layout {
        Layout {
            sorted_by: sort_columns(table),
            // Within a series the steps (and their times) ascend, mostly by one.
            delta_columns: match table {
                Table::Samples => &["step", "time"],
                Table::Sketches | Table::Runs => &[],
            },
        }
    }
}

fn properties(layout: Layout, schema: &SchemaRef) -> WriterProperties {
    let sorting: Vec<SortingColumn> = layout
        .sorted_by
        .iter()
        .filter_map(|name| schema.index_of(name).ok())
        .map(|i| SortingColumn {
            column_idx: i as i32,
            descending: false,
            nulls_first: true,
        })
        .collect();
    let mut builder = WriterProperties::builder();
    for name in layout.delta_columns {
        let path = parquet::schema::types::ColumnPath::from(*name);
        builder = builder
            .set_column_dictionary_enabled(path.clone(), false)
            .set_column_encoding(path, parquet::basic::Encoding::DELTA_BINARY_PACKED);
    }
    // Every leaf of type double, list items included (their paths are the Parquet ones).
    if let Ok(parquet_schema) = parquet::arrow::ArrowSchemaConverter::new().convert(schema) {
        for column in parquet_schema.columns() {
            if column.physical_type() == parquet::basic::Type::DOUBLE {
                // No min/max: Parquet leaves NaN out of them, and a reader that trusts them
                // (DataFusion takes min == max for a constant column, and prunes by them)
                // answers wrong for a part holding a NaN. No query here filters on a value.
                builder = builder
                    .set_column_statistics_enabled(column.path().clone(), EnabledStatistics::None)
                    .set_column_dictionary_enabled(column.path().clone(), false)
                    .set_column_encoding(
                        column.path().clone(),
                        parquet::basic::Encoding::BYTE_STREAM_SPLIT,
                    );
            }
        }
    }
    builder
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3).unwrap_or_default()))
        .set_max_row_group_row_count(Some(256 * 1024))
        .set_data_page_row_count_limit(8 * 1024)
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_sorting_columns((!sorting.is_empty()).then_some(sorting))
        .build()
}

/// Writes `batches` (one schema, together already sorted as `layout` says, which the file
/// records) to `path` durably: a temporary file, fsync, rename, directory fsync. Returns the
/// file's size. Several batches are written one after the other, not concatenated first.
pub fn write(disk: &dyn Disk, layout: Layout, batches: &[RecordBatch], path: &Path) -> Result<u64> {
    let Some(first) = batches.first() else {
        return Err(Error::Corrupt {
            what: format!("a write of {}", path.display()),
            reason: "it has no batch".into(),
        });
    };
    let schema = first.schema();
    crate::disk::write_with(disk, path, |file| -> Result<()> {
        let mut writer =
            ArrowWriter::try_new(file, schema.clone(), Some(properties(layout, &schema)))?;
        for batch in batches {
            writer.write(batch)?;
        }
        writer.close()?;
        Ok(())
    })
}

/// Reads a whole file.
pub fn read(path: &Path) -> Result<Vec<RecordBatch>> {
    read_all(File::open(path)?)
}

/// Reads a whole file fetched into memory (from object storage).
pub fn read_bytes(bytes: bytes::Bytes) -> Result<Vec<RecordBatch>> {
    read_all(bytes)
}

fn read_all(source: impl parquet::file::reader::ChunkReader + 'static) -> Result<Vec<RecordBatch>> {
    let reader = ParquetRecordBatchReaderBuilder::try_new(source)?
        .with_batch_size(64 * 1024)
        .build()?;
    reader
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(Error::Arrow)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::Array;
    use arrow_array::types::{Float64Type, UInt32Type};
    use parquet::basic::Encoding;
    use proptest::prelude::*;
    use rankwatch_analytics::math::SketchKind;
    use rankwatch_analytics::schema::{samples, sketches};
    use rankwatch_analytics::{MetricName, RunId, Sample, Site, SketchRecord};

    type Key = (String, Option<u32>, Option<String>, Option<u32>, u64);

    fn keys(b: &RecordBatch) -> Vec<(Key, u64)> {
        let metric = b.column_by_name("metric").unwrap().as_string::<i32>();
        let layer = b
            .column_by_name("layer")
            .unwrap()
            .as_primitive::<UInt32Type>();
        let site = b.column_by_name("site").unwrap().as_string::<i32>();
        let rank = b
            .column_by_name("rank")
            .unwrap()
            .as_primitive::<UInt32Type>();
        let step = b
            .column_by_name("step")
            .unwrap()
            .as_primitive::<UInt64Type>();
        let value = b
            .column_by_name("value")
            .unwrap()
            .as_primitive::<Float64Type>();
        (0..b.num_rows())
            .map(|i| {
                (
                    (
                        metric.value(i).to_owned(),
                        layer.is_valid(i).then(|| layer.value(i)),
                        site.is_valid(i).then(|| site.value(i).to_owned()),
                        rank.is_valid(i).then(|| rank.value(i)),
                        step.value(i),
                    ),
                    value.value(i).to_bits(),
                )
            })
            .collect()
    }

    proptest! {
        /// A sorted part is the rows in (metric, layer, site, rank, step) order, nulls first,
        /// equal keys in arrival order: what a stable sort of the same tuples gives.
        #[test]
        fn parts_are_sorted_like_the_key_tuples(
            rows in proptest::collection::vec(
                (0usize..3, proptest::option::of(0u32..3), proptest::option::of(0usize..3), proptest::option::of(0u32..3), 0u64..5),
                0..200,
            ),
            cuts in proptest::collection::vec(0usize..200, 0..4),
        ) {
            let samples: Vec<Sample> = rows
                .iter()
                .enumerate()
                .map(|(i, &(m, layer, site, rank, step))| Sample {
                    run: RunId::new("r").unwrap(),
                    rank,
                    step,
                    time_ms: 0,
                    metric: MetricName::new(["loss", "spectral.sigma", "user/x"][m]).unwrap(),
                    layer,
                    // Sites whose text order is not their declaration order.
                    site: site.map(|s| [Site::Up, Site::Down, Site::AttnOut][s]),
                    value: i as f64,
                })
                .collect();
            let batch = without_run(&samples::to_batch(&samples).unwrap()).unwrap();
            let mut want = keys(&batch);
            want.sort_by(|a, b| a.0.cmp(&b.0));
            // As a flush finds them: in several batches, some of them empty.
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(batch.num_rows())).collect();
            cuts.sort_unstable();
            let mut parts = Vec::new();
            let mut from = 0;
            for cut in cuts.into_iter().chain([batch.num_rows()]) {
                parts.push(batch.slice(from, cut - from));
                from = cut;
            }
            let got = keys(&sorted(Table::Samples, &parts).unwrap());
            prop_assert_eq!(&got, &want);
            // An empty batch first (its schema is the output's).
            parts.insert(0, batch.slice(0, 0));
            prop_assert_eq!(keys(&sorted(Table::Samples, &parts).unwrap()), want);
        }

        /// Sketches are sorted by (step, rank), equal keys in arrival order, their vectors
        /// carried along.
        #[test]
        fn sketch_parts_are_sorted_by_step_then_rank(
            rows in proptest::collection::vec((0u64..5, 0u32..4), 0..120),
            cut in 0usize..120,
        ) {
            let records: Vec<SketchRecord> = rows
                .iter()
                .enumerate()
                .map(|(i, &(step, rank))| SketchRecord {
                    run: RunId::new("r").unwrap(),
                    rank,
                    step,
                    time_ms: 0,
                    kind: SketchKind::Rademacher,
                    seed: 1,
                    norm: i as f64,
                    vector: vec![i as f32; 3],
                })
                .collect();
            let batch = without_run(&sketches::to_batch(&records).unwrap()).unwrap();
            let cut = cut.min(batch.num_rows());
            let parts = [batch.slice(0, cut), batch.slice(cut, batch.num_rows() - cut)];
            let out = sorted(Table::Sketches, &parts).unwrap();
            let step = out.column_by_name("step").unwrap().as_primitive::<UInt64Type>();
            let rank = out.column_by_name("rank").unwrap().as_primitive::<UInt32Type>();
            let norm = out.column_by_name("norm").unwrap().as_primitive::<Float64Type>();
            let vector = out.column_by_name("vector").unwrap().as_list::<i32>();
            let got: Vec<(u64, u32, usize)> = (0..out.num_rows())
                .map(|i| {
                    let arrival = norm.value(i) as usize;
                    let v = vector.value(i);
                    let v = v.as_primitive::<arrow_array::types::Float32Type>();
                    assert!(v.values().iter().all(|&x| x == arrival as f32), "row {i}'s vector");
                    (step.value(i), rank.value(i), arrival)
                })
                .collect();
            let mut want: Vec<(u64, u32, usize)> =
                rows.iter().enumerate().map(|(i, &(s, r))| (s, r, i)).collect();
            want.sort_by_key(|&(s, r, _)| (s, r));
            prop_assert_eq!(got, want);
        }
    }

    /// Measured values are written byte-stream-split without a dictionary (a reader would
    /// otherwise decompress a 1 MB dictionary page per chunk before any row), steps and times
    /// delta-encoded, and every value comes back bit for bit (NaN payloads, signed zeros,
    /// infinities included).
    #[test]
    fn floats_are_written_without_dictionaries_and_read_back_bit_for_bit() {
        let special = [
            f64::NAN,
            -0.0,
            0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MIN_POSITIVE,
        ];
        let samples: Vec<Sample> = (0..50_000u64)
            .map(|i| Sample {
                run: RunId::new("r").unwrap(),
                rank: Some((i % 4) as u32),
                step: i / 4,
                time_ms: 1_700_000_000_000 + (i / 4) as i64 * 250,
                metric: MetricName::new("loss").unwrap(),
                layer: None,
                site: None,
                value: special
                    .get(i as usize)
                    .copied()
                    .unwrap_or_else(|| (i as f64 * 0.7).sin() * 1e3),
            })
            .collect();
        let batch = without_run(&samples::to_batch(&samples).unwrap()).unwrap();
        let batch = sorted(Table::Samples, &[batch]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("part-0.parquet");
        write(
            &crate::disk::RealDisk,
            Layout::of(Table::Samples),
            std::slice::from_ref(&batch),
            &path,
        )
        .unwrap();

        let reader =
            parquet::file::reader::SerializedFileReader::new(File::open(&path).unwrap()).unwrap();
        let chunks = parquet::file::reader::FileReader::metadata(&reader).row_group(0);
        let chunk = |name: &str| {
            chunks
                .columns()
                .iter()
                .find(|c| c.column_path().string() == name)
                .unwrap()
        };
        let value = chunk("value");
        assert!(
            value.dictionary_page_offset().is_none(),
            "value has a dictionary page"
        );
        assert!(value.encodings().any(|e| e == Encoding::BYTE_STREAM_SPLIT));
        // No min/max for doubles: Parquet's would leave the NaN out, and a reader trusting
        // them misreads the part. The sort columns keep theirs (every pruning rests on them).
        assert!(
            value
                .statistics()
                .is_none_or(|s| s.min_bytes_opt().is_none()),
            "value has min/max statistics: {:?}",
            value.statistics()
        );
        assert!(
            value.column_index_offset().is_none(),
            "value has a page index"
        );
        assert!(
            chunk("step")
                .statistics()
                .is_some_and(|s| s.min_bytes_opt().is_some())
        );
        for name in ["step", "time"] {
            let c = chunk(name);
            assert!(
                c.dictionary_page_offset().is_none(),
                "{name} has a dictionary page"
            );
            assert!(
                c.encodings().any(|e| e == Encoding::DELTA_BINARY_PACKED),
                "{name}"
            );
        }
        // The series key columns keep their dictionaries: a few distinct values each.
        assert!(chunk("metric").dictionary_page_offset().is_some());

        let back = read(&path).unwrap();
        let back = arrow_select::concat::concat_batches(&back[0].schema(), &back).unwrap();
        assert_eq!(keys(&back), keys(&batch));
    }
}
