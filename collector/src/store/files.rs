//! Writing and reading the Parquet files of the store.
//!
//! Files are zstd-compressed and sorted — samples by (metric, layer, site, rank, step),
//! sketches by (step, rank) — with small data pages and page-level statistics, so a query
//! for one series reads a few pages instead of the file. The `run` column is not stored:
//! it is the Hive partition directory `run=<id>`, which is how DuckDB, Spark and Trino expect
//! partition columns.

use std::fs::{self, File};
use std::path::Path;
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::UInt64Type;
use arrow_ord::sort::{SortColumn, lexsort_to_indices};
use arrow_schema::{SchemaRef, SortOptions};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::metadata::SortingColumn;
use parquet::file::properties::{EnabledStatistics, WriterProperties};

use crate::entry::Table;
use crate::error::{Error, Result};
use crate::fsutil::sync_parent;

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

/// Concatenates `batches` (file schema) and sorts them in the table's order.
pub fn sorted(table: Table, batches: &[RecordBatch]) -> Result<RecordBatch> {
    let schema = file_schema(table);
    let batch = arrow_select::concat::concat_batches(&schema, batches).map_err(Error::Arrow)?;
    let keys = sort_columns(table);
    if keys.is_empty() || batch.num_rows() < 2 {
        return Ok(batch);
    }
    let columns: Vec<SortColumn> = keys
        .iter()
        .map(|name| SortColumn {
            values: batch.column_by_name(name).cloned().unwrap_or_else(|| {
                arrow_array::new_null_array(&arrow_schema::DataType::Null, batch.num_rows())
            }),
            options: Some(SortOptions {
                descending: false,
                nulls_first: true,
            }),
        })
        .collect();
    let indices = lexsort_to_indices(&columns, None).map_err(Error::Arrow)?;
    arrow_select::take::take_record_batch(&batch, &indices).map_err(Error::Arrow)
}

/// Step range of a file-schema batch.
pub fn step_range(batch: &RecordBatch) -> (Option<u64>, Option<u64>) {
    let Some(step) = batch.column_by_name("step") else {
        return (None, None);
    };
    let step = step.as_primitive::<UInt64Type>();
    (step.iter().flatten().min(), step.iter().flatten().max())
}

fn properties(table: Table, schema: &SchemaRef) -> WriterProperties {
    let sorting: Vec<SortingColumn> = sort_columns(table)
        .iter()
        .filter_map(|name| schema.index_of(name).ok())
        .map(|i| SortingColumn {
            column_idx: i as i32,
            descending: false,
            nulls_first: true,
        })
        .collect();
    WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::try_new(3).unwrap_or_default()))
        .set_max_row_group_row_count(Some(256 * 1024))
        .set_data_page_row_count_limit(8 * 1024)
        .set_statistics_enabled(EnabledStatistics::Page)
        .set_sorting_columns((!sorting.is_empty()).then_some(sorting))
        .build()
}

/// Writes `batch` (file schema, already sorted) to `path` durably: a temporary file, fsync,
/// rename, directory fsync. Returns the file's size.
pub fn write(table: Table, batch: &RecordBatch, path: &Path) -> Result<u64> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
        sync_parent(dir)?;
    }
    let tmp = path.with_extension("tmp");
    let file = File::create(&tmp)?;
    let schema = batch.schema();
    let mut writer = ArrowWriter::try_new(file, schema.clone(), Some(properties(table, &schema)))?;
    writer.write(batch)?;
    let file = writer.into_inner()?;
    file.sync_all()?;
    let size = file.metadata()?.len();
    drop(file);
    fs::rename(&tmp, path)?;
    sync_parent(path)?;
    Ok(size)
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
