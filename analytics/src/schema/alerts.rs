//! The `alerts` table: one row per alert state change; the latest row per id is the alert.

use std::str::FromStr;
use std::sync::{Arc, LazyLock};

use arrow_array::cast::AsArray;
use arrow_array::types::UInt32Type;
use arrow_array::{
    Array, ArrayRef, Float64Array, ListArray, RecordBatch, StringArray, UInt32Array, UInt64Array,
};
use arrow_schema::{DataType, Field, SchemaRef};

use super::{Columns, field, opt, opt_str, schema, timestamp_type, utc_times};
use crate::alert::Alert;
use crate::error::Result;
use crate::validate::RunId;
use crate::vocab::Site;

/// Table name.
pub const TABLE: &str = "alerts";

static SCHEMA: LazyLock<SchemaRef> = LazyLock::new(|| {
    schema(vec![
        field("id", DataType::Utf8, false),
        field("run", DataType::Utf8, false),
        field("rule", DataType::Utf8, false),
        field("severity", DataType::Utf8, false),
        field("state", DataType::Utf8, false),
        field("layer", DataType::UInt32, true),
        field("site", DataType::Utf8, true),
        field("rank", DataType::UInt32, true),
        field(
            "outlier_ranks",
            DataType::List(Arc::new(Field::new_list_field(DataType::UInt32, true))),
            false,
        ),
        field("value", DataType::Float64, false),
        field("threshold", DataType::Float64, false),
        field("first_step", DataType::UInt64, false),
        field("last_step", DataType::UInt64, false),
        field("started_at", timestamp_type(), false),
        field("updated_at", timestamp_type(), false),
        field("fired_at", timestamp_type(), true),
        field("resolved_at", timestamp_type(), true),
        field("explanation", DataType::Utf8, false),
    ])
});

/// The `alerts` schema.
pub fn schema_ref() -> SchemaRef {
    SCHEMA.clone()
}

/// Rows to a batch.
pub fn to_batch(rows: &[Alert]) -> Result<RecordBatch> {
    let strs = |f: fn(&Alert) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(rows.iter().map(f)))
    };
    let columns: Vec<ArrayRef> = vec![
        strs(|a| &a.id),
        strs(|a| a.run.as_str()),
        strs(|a| a.rule.as_str()),
        strs(|a| a.severity.as_str()),
        strs(|a| a.state.as_str()),
        Arc::new(UInt32Array::from_iter(rows.iter().map(|a| a.layer))),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|a| a.site.map(Site::as_str)),
        )),
        Arc::new(UInt32Array::from_iter(rows.iter().map(|a| a.rank))),
        Arc::new(ListArray::from_iter_primitive::<UInt32Type, _, _>(
            rows.iter().map(|a| {
                Some(
                    a.outlier_ranks
                        .iter()
                        .copied()
                        .map(Some)
                        .collect::<Vec<_>>(),
                )
            }),
        )),
        Arc::new(Float64Array::from_iter_values(rows.iter().map(|a| a.value))),
        Arc::new(Float64Array::from_iter_values(
            rows.iter().map(|a| a.threshold),
        )),
        Arc::new(UInt64Array::from_iter_values(
            rows.iter().map(|a| a.first_step),
        )),
        Arc::new(UInt64Array::from_iter_values(
            rows.iter().map(|a| a.last_step),
        )),
        utc_times(rows.iter().map(|a| Some(a.started_at_ms))),
        utc_times(rows.iter().map(|a| Some(a.updated_at_ms))),
        utc_times(rows.iter().map(|a| a.fired_at_ms)),
        utc_times(rows.iter().map(|a| a.resolved_at_ms)),
        strs(|a| &a.explanation),
    ];
    Ok(RecordBatch::try_new(schema_ref(), columns)?)
}

/// A batch to rows.
pub fn from_batch(batch: &RecordBatch) -> Result<Vec<Alert>> {
    let c = Columns::new(TABLE, &SCHEMA, batch)?;
    let s = |name| c.strings(name);
    let outliers = c.list("outlier_ranks");
    (0..c.rows())
        .map(|i| {
            let at = c.at(i);
            let ranks = outliers.value(i);
            let ranks = ranks.as_primitive::<UInt32Type>();
            if ranks.null_count() > 0 {
                return Err(at(crate::error::Error::Schema {
                    table: TABLE,
                    reason: "column \"outlier_ranks\" holds a null rank".to_owned(),
                }));
            }
            Ok(Alert {
                id: s("id").value(i).to_owned(),
                run: RunId::new(s("run").value(i)).map_err(&at)?,
                rule: s("rule")
                    .value(i)
                    .parse()
                    .map_err(|e: rankwatch_api::UnknownName| at(e.into()))?,
                severity: s("severity")
                    .value(i)
                    .parse()
                    .map_err(|e: rankwatch_api::UnknownName| at(e.into()))?,
                state: s("state")
                    .value(i)
                    .parse()
                    .map_err(|e: rankwatch_api::UnknownName| at(e.into()))?,
                layer: opt(c.u32s("layer"), i),
                site: opt_str(s("site"), i)
                    .map(Site::from_str)
                    .transpose()
                    .map_err(|e| at(e.into()))?,
                rank: opt(c.u32s("rank"), i),
                outlier_ranks: ranks.values().to_vec(),
                value: c.f64s("value").value(i),
                threshold: c.f64s("threshold").value(i),
                first_step: c.u64s("first_step").value(i),
                last_step: c.u64s("last_step").value(i),
                started_at_ms: c.times("started_at").value(i),
                updated_at_ms: c.times("updated_at").value(i),
                fired_at_ms: opt(c.times("fired_at"), i),
                resolved_at_ms: opt(c.times("resolved_at"), i),
                explanation: s("explanation").value(i).to_owned(),
            })
        })
        .collect()
}
