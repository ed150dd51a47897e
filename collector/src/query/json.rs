//! JSON encoding of SQL results, cell by cell. Floats follow the contract's convention
//! ([`Num`]): a non-finite value, exactly what a user must see, is the string `"NaN"`,
//! `"Infinity"` or `"-Infinity"`.

use arrow_array::cast::AsArray;
use arrow_array::types::*;
use arrow_array::{Array, RecordBatch};
use arrow_schema::{DataType, TimeUnit};
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use serde_json::{Map, Value};

pub use rankwatch_api::Num;

/// A float as a JSON value, per [`Num`].
pub fn float(v: f64) -> Value {
    serde_json::to_value(Num(v)).unwrap_or(Value::Null)
}

/// Rows of `batches` as JSON objects (column name → value).
pub fn rows(batches: &[RecordBatch]) -> Vec<Map<String, Value>> {
    let mut out = Vec::new();
    let options = FormatOptions::default();
    for batch in batches {
        let schema = batch.schema();
        let formatters: Vec<Option<ArrayFormatter<'_>>> = batch
            .columns()
            .iter()
            .map(|c| ArrayFormatter::try_new(c.as_ref(), &options).ok())
            .collect();
        for row in 0..batch.num_rows() {
            let mut object = Map::new();
            for (i, column) in batch.columns().iter().enumerate() {
                let value = cell(column.as_ref(), row, formatters[i].as_ref());
                object.insert(schema.field(i).name().clone(), value);
            }
            out.push(object);
        }
    }
    out
}

fn cell(a: &dyn Array, row: usize, formatter: Option<&ArrayFormatter<'_>>) -> Value {
    if a.is_null(row) {
        return Value::Null;
    }
    match a.data_type() {
        DataType::Boolean => Value::Bool(a.as_boolean().value(row)),
        DataType::Int8 => a.as_primitive::<Int8Type>().value(row).into(),
        DataType::Int16 => a.as_primitive::<Int16Type>().value(row).into(),
        DataType::Int32 => a.as_primitive::<Int32Type>().value(row).into(),
        DataType::Int64 => a.as_primitive::<Int64Type>().value(row).into(),
        DataType::UInt8 => a.as_primitive::<UInt8Type>().value(row).into(),
        DataType::UInt16 => a.as_primitive::<UInt16Type>().value(row).into(),
        DataType::UInt32 => a.as_primitive::<UInt32Type>().value(row).into(),
        DataType::UInt64 => a.as_primitive::<UInt64Type>().value(row).into(),
        DataType::Float32 => float(a.as_primitive::<Float32Type>().value(row) as f64),
        DataType::Float64 => float(a.as_primitive::<Float64Type>().value(row)),
        DataType::Utf8 => a.as_string::<i32>().value(row).into(),
        DataType::LargeUtf8 => a.as_string::<i64>().value(row).into(),
        DataType::Utf8View => a.as_string_view().value(row).into(),
        DataType::Timestamp(TimeUnit::Millisecond, _) => a
            .as_primitive::<TimestampMillisecondType>()
            .value(row)
            .into(),
        _ => formatter
            .map(|f| Value::String(f.value(row).to_string()))
            .unwrap_or(Value::Null),
    }
}
