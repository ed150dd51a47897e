//! The long-format `samples` table: one row per value.

use std::str::FromStr;
use std::sync::{Arc, LazyLock};

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, TimestampMillisecondType, UInt32Type, UInt64Type};
use arrow_array::{ArrayRef, Float64Array, RecordBatch, StringArray, UInt32Array, UInt64Array};
use arrow_schema::{DataType, SchemaRef};

use super::{Columns, field, opt, opt_str, schema, timestamp_type, utc_times};
use crate::error::Result;
use crate::record::Sample;
use crate::validate::{MetricName, RunId};
use crate::vocab::Site;

/// Table name, as used in the Hive layout (`table=samples`).
pub const TABLE: &str = "samples";

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    schema(vec![
        field("run", DataType::Utf8, false),
        field("rank", DataType::UInt32, true),
        field("step", DataType::UInt64, false),
        field("time", timestamp_type(), false),
        field("metric", DataType::Utf8, false),
        field("layer", DataType::UInt32, true),
        field("site", DataType::Utf8, true),
        field("value", DataType::Float64, false),
    ])
});

/// The `samples` schema.
pub fn schema_ref() -> SchemaRef {
    SCHEMA.clone()
}

/// Rows to a batch.
pub fn to_batch(rows: &[Sample]) -> Result<RecordBatch> {
    let columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|s| s.run.as_str()),
        )),
        Arc::new(UInt32Array::from_iter(rows.iter().map(|s| s.rank))),
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|s| s.step))),
        utc_times(rows.iter().map(|s| Some(s.time_ms))),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|s| s.metric.as_str()),
        )),
        Arc::new(UInt32Array::from_iter(rows.iter().map(|s| s.layer))),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|s| s.site.map(Site::as_str)),
        )),
        Arc::new(Float64Array::from_iter_values(rows.iter().map(|s| s.value))),
    ];
    Ok(RecordBatch::try_new(schema_ref(), columns)?)
}

/// One row of a samples batch, borrowing its strings: what a reader that only routes rows
/// (the collector's alert engine) needs, without an allocation per row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleRow<'a> {
    pub run: &'a str,
    pub rank: Option<u32>,
    pub step: u64,
    pub time_ms: i64,
    pub metric: &'a str,
    pub layer: Option<u32>,
    pub site: Option<&'a str>,
    pub value: f64,
}

/// A samples batch's columns, its schema checked once: for readers that go column by column
/// (the alert engine resolves a batch's metric names from the `metric` column as a whole) and
/// then row by row.
#[derive(Debug, Clone, Copy)]
pub struct SampleColumns<'a> {
    /// The checked batch, for naming a row in an error.
    checked: Columns<'a>,
    run: &'a StringArray,
    rank: &'a UInt32Array,
    step: &'a UInt64Array,
    time: &'a arrow_array::TimestampMillisecondArray,
    /// The metric names, by row.
    pub metric: &'a StringArray,
    layer: &'a UInt32Array,
    site: &'a StringArray,
    value: &'a Float64Array,
}

impl<'a> SampleColumns<'a> {
    /// Checks the schema of `batch` (not its values).
    pub fn new(batch: &'a RecordBatch) -> Result<Self> {
        let c = Columns::new(TABLE, &SCHEMA, batch)?;
        // In the schema's order (by position when the batch carries it, else by name).
        Ok(SampleColumns {
            checked: c,
            run: c.column_at(0, "run").as_string::<i32>(),
            rank: c.column_at(1, "rank").as_primitive::<UInt32Type>(),
            step: c.column_at(2, "step").as_primitive::<UInt64Type>(),
            time: c
                .column_at(3, "time")
                .as_primitive::<TimestampMillisecondType>(),
            metric: c.column_at(4, "metric").as_string::<i32>(),
            layer: c.column_at(5, "layer").as_primitive::<UInt32Type>(),
            site: c.column_at(6, "site").as_string::<i32>(),
            value: c.column_at(7, "value").as_primitive::<Float64Type>(),
        })
    }

    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.value.len()
    }

    /// Row `i` (below [`SampleColumns::rows`]). Inlined into the reader, so the columns it
    /// does not use are not read.
    #[inline]
    pub fn row(&self, i: usize) -> SampleRow<'a> {
        SampleRow {
            run: self.run.value(i),
            rank: opt(self.rank, i),
            step: self.step.value(i),
            time_ms: self.time.value(i),
            metric: self.metric.value(i),
            layer: opt(self.layer, i),
            site: opt_str(self.site, i),
            value: self.value.value(i),
        }
    }
}

/// Checks the schema of `batch` and calls `f` with each row; stops at the first error `f`
/// returns, naming its row.
pub fn try_for_each_row<'a>(
    batch: &'a RecordBatch,
    mut f: impl FnMut(SampleRow<'a>) -> Result<()>,
) -> Result<()> {
    let columns = SampleColumns::new(batch)?;
    (0..columns.rows()).try_for_each(|i| f(columns.row(i)).map_err(columns.checked.at(i)))
}

/// A batch to rows, checking the schema and every identifier. Scope rules are checked
/// separately by [`Sample::validate`], which needs the run's metadata.
pub fn from_batch(batch: &RecordBatch) -> Result<Vec<Sample>> {
    let mut rows = Vec::with_capacity(batch.num_rows());
    try_for_each_row(batch, |row| {
        rows.push(Sample {
            run: RunId::new(row.run)?,
            rank: row.rank,
            step: row.step,
            time_ms: row.time_ms,
            metric: MetricName::new(row.metric)?,
            layer: row.layer,
            site: row.site.map(Site::from_str).transpose()?,
            value: row.value,
        });
        Ok(())
    })?;
    Ok(rows)
}

/// Checks the schema of `batch` (not its values) and returns it in canonical column order.
pub fn normalize(batch: &RecordBatch) -> Result<RecordBatch> {
    super::normalize(TABLE, &SCHEMA, batch)
}

/// NaN and ±Inf values in a batch's `value` column: data to store and count, not to refuse.
pub fn nonfinite_values(batch: &RecordBatch) -> Result<usize> {
    let c = Columns::new(TABLE, &SCHEMA, batch)?;
    Ok(c.f64s("value")
        .values()
        .iter()
        .filter(|v| !v.is_finite())
        .count())
}
