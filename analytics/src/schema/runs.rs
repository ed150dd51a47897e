//! The `runs` table: one row per run. The model layout and tags are JSON columns: they are
//! small, read whole, and JSON keeps them readable from DuckDB (`json_extract`) as they are.

use std::sync::{Arc, LazyLock};

use arrow_array::{ArrayRef, RecordBatch, StringArray, UInt32Array};
use arrow_schema::{DataType, SchemaRef};

use super::{Columns, field, schema, timestamp_type, utc_times};
use crate::error::{Error, Result};
use crate::record::{ModelLayout, RunInfo};
use crate::validate::RunId;

/// Table name.
pub const TABLE: &str = "runs";

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    schema(vec![
        field("run", DataType::Utf8, false),
        field("world_size", DataType::UInt32, false),
        field("started_at", timestamp_type(), false),
        field("family", DataType::Utf8, false),
        field("layer_count", DataType::UInt32, false),
        field("layout", DataType::Utf8, false),
        field("tags", DataType::Utf8, false),
    ])
});

/// The `runs` schema.
pub fn schema_ref() -> SchemaRef {
    SCHEMA.clone()
}

fn to_json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("layouts and tags serialise")
}

/// Checks the schema of `batch` (not its values) and returns it in canonical column order.
pub fn normalize(batch: &RecordBatch) -> Result<RecordBatch> {
    super::normalize(TABLE, &SCHEMA, batch)
}

/// Rows to a batch.
pub fn to_batch(rows: &[RunInfo]) -> Result<RecordBatch> {
    let columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.run.as_str()),
        )),
        Arc::new(UInt32Array::from_iter_values(
            rows.iter().map(|r| r.world_size),
        )),
        utc_times(rows.iter().map(|r| Some(r.started_at_ms))),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.layout.family.as_str()),
        )),
        Arc::new(UInt32Array::from_iter_values(
            rows.iter().map(|r| r.layout.layer_count()),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| to_json(&r.layout.layers)),
        )),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| to_json(&r.tags)),
        )),
    ];
    Ok(RecordBatch::try_new(schema_ref(), columns)?)
}

/// A batch to rows; each row is also checked with [`RunInfo::validate`], and `layer_count`
/// must agree with the layout.
pub fn from_batch(batch: &RecordBatch) -> Result<Vec<RunInfo>> {
    let c = Columns::new(TABLE, &SCHEMA, batch)?;
    let (run, world, started) = (
        c.strings("run"),
        c.u32s("world_size"),
        c.times("started_at"),
    );
    let (family, count, layout, tags) = (
        c.strings("family"),
        c.u32s("layer_count"),
        c.strings("layout"),
        c.strings("tags"),
    );
    let json = |what: &str, e: serde_json::Error| Error::Schema {
        table: TABLE,
        reason: format!("column {what:?}: {e}"),
    };
    (0..c.rows())
        .map(|i| {
            let info = RunInfo {
                run: RunId::new(run.value(i)).map_err(c.at(i))?,
                world_size: world.value(i),
                started_at_ms: started.value(i),
                layout: ModelLayout {
                    family: family.value(i).to_owned(),
                    layers: serde_json::from_str(layout.value(i))
                        .map_err(|e| c.at(i)(json("layout", e)))?,
                },
                tags: serde_json::from_str(tags.value(i)).map_err(|e| c.at(i)(json("tags", e)))?,
            };
            if info.layout.layer_count() != count.value(i) {
                return Err(c.at(i)(Error::InvalidRunInfo {
                    run: info.run.to_string(),
                    reason: format!(
                        "layer_count {} disagrees with a layout of {} layers",
                        count.value(i),
                        info.layout.layer_count()
                    ),
                }));
            }
            info.validate().map_err(c.at(i))?;
            Ok(info)
        })
        .collect()
}
