//! The `sketches` table: one gradient sketch per rank and step.

use std::sync::{Arc, LazyLock};

use arrow_array::cast::AsArray;
use arrow_array::types::Float32Type;
use arrow_array::{
    Array, ArrayRef, Float64Array, ListArray, RecordBatch, StringArray, UInt32Array, UInt64Array,
};
use arrow_schema::{DataType, Field, SchemaRef};

use super::{Columns, field, schema, timestamp_type, utc_times};
use crate::error::{Error, Result};
use crate::record::SketchRecord;
use crate::validate::RunId;

/// Table name.
pub const TABLE: &str = "sketches";

fn vector_type() -> DataType {
    DataType::List(Arc::new(Field::new_list_field(DataType::Float32, true)))
}

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    schema(vec![
        field("run", DataType::Utf8, false),
        field("rank", DataType::UInt32, false),
        field("step", DataType::UInt64, false),
        field("time", timestamp_type(), false),
        field("kind", DataType::Utf8, false),
        field("seed", DataType::UInt32, false),
        field("norm", DataType::Float64, false),
        field("vector", vector_type(), false),
    ])
});

/// The `sketches` schema.
pub fn schema_ref() -> SchemaRef {
    SCHEMA.clone()
}

/// Checks the schema of `batch` (not its values) and returns it in canonical column order.
pub fn normalize(batch: &RecordBatch) -> Result<RecordBatch> {
    super::normalize(TABLE, &SCHEMA, batch)
}

/// Rows to a batch.
pub fn to_batch(rows: &[SketchRecord]) -> Result<RecordBatch> {
    let vectors = ListArray::from_iter_primitive::<Float32Type, _, _>(
        rows.iter()
            .map(|r| Some(r.vector.iter().copied().map(Some).collect::<Vec<_>>())),
    );
    let columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.run.as_str()),
        )),
        Arc::new(UInt32Array::from_iter_values(rows.iter().map(|r| r.rank))),
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|r| r.step))),
        utc_times(rows.iter().map(|r| Some(r.time_ms))),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.kind.as_str()),
        )),
        Arc::new(UInt32Array::from_iter_values(rows.iter().map(|r| r.seed))),
        Arc::new(Float64Array::from_iter_values(rows.iter().map(|r| r.norm))),
        Arc::new(vectors),
    ];
    Ok(RecordBatch::try_new(schema_ref(), columns)?)
}

/// A batch to rows; a null inside a vector is refused (a sketch has no missing coordinates).
pub fn from_batch(batch: &RecordBatch) -> Result<Vec<SketchRecord>> {
    let c = Columns::new(TABLE, &SCHEMA, batch)?;
    let (run, rank, step, time) = (
        c.strings("run"),
        c.u32s("rank"),
        c.u64s("step"),
        c.times("time"),
    );
    let (kind, seed, norm, vector) = (
        c.strings("kind"),
        c.u32s("seed"),
        c.f64s("norm"),
        c.list("vector"),
    );
    (0..c.rows())
        .map(|i| {
            let values = vector.value(i);
            let values = values.as_primitive::<Float32Type>();
            if values.null_count() > 0 {
                return Err(c.at(i)(Error::Dimension(
                    "sketch vector contains nulls".to_owned(),
                )));
            }
            Ok(SketchRecord {
                run: RunId::new(run.value(i)).map_err(c.at(i))?,
                rank: rank.value(i),
                step: step.value(i),
                time_ms: time.value(i),
                kind: kind
                    .value(i)
                    .parse()
                    .map_err(|e: rankwatch_api::UnknownName| c.at(i)(e.into()))?,
                seed: seed.value(i),
                norm: norm.value(i),
                vector: values.values().to_vec(),
            })
        })
        .collect()
}
