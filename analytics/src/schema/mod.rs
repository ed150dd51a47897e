//! Arrow schemas of the four tables (`samples`, `sketches`, `runs`, `alerts`) and lossless
//! conversion between their rows and [`arrow_array::RecordBatch`]es.
//!
//! The schemas are the contract for the wire (Arrow IPC bodies), the hot buffer and the Parquet
//! files, so readers are strict: a missing or extra column, a wrong type or a null in a
//! required column is an [`Error::Schema`] naming the column, and a bad value is an
//! [`Error::Row`] naming the row. Timestamps are milliseconds in UTC; any time zone annotation
//! is accepted on read since the instant is the same.

pub mod alerts;
pub mod runs;
pub mod samples;
pub mod sketches;
mod table;

pub use table::Table;

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, TimestampMillisecondType, UInt32Type, UInt64Type};
use arrow_array::{Array, ArrowPrimitiveType, PrimitiveArray, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};

use crate::error::{Error, Result};

/// The Arrow type of every timestamp column.
pub fn timestamp_type() -> DataType {
    DataType::Timestamp(TimeUnit::Millisecond, Some(Arc::from("UTC")))
}

fn same_type(expected: &DataType, actual: &DataType) -> bool {
    match (expected, actual) {
        (DataType::Timestamp(u1, _), DataType::Timestamp(u2, _)) => u1 == u2,
        (DataType::List(a), DataType::List(b)) => same_type(a.data_type(), b.data_type()),
        _ => expected == actual,
    }
}

/// Checks `batch` against `schema` and returns it in the schema's own column order and field
/// types (timestamps re-annotated as UTC), so batches from different writers concatenate.
pub(crate) fn normalize(
    table: &'static str,
    schema: &SchemaRef,
    batch: &RecordBatch,
) -> Result<RecordBatch> {
    Columns::new(table, schema, batch)?;
    let columns = schema
        .fields()
        .iter()
        .map(|field| {
            let column =
                batch
                    .column_by_name(field.name())
                    .cloned()
                    .ok_or_else(|| Error::Schema {
                        table,
                        reason: format!("missing column {:?}", field.name()),
                    })?;
            Ok(match field.data_type() {
                DataType::Timestamp(TimeUnit::Millisecond, _) => Arc::new(
                    column
                        .as_primitive::<TimestampMillisecondType>()
                        .clone()
                        .with_timezone("UTC"),
                ) as _,
                _ => column,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(RecordBatch::try_new(schema.clone(), columns)?)
}

/// Typed, checked access to the columns of a batch of one table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Columns<'a> {
    table: &'static str,
    batch: &'a RecordBatch,
    /// The batch carries the table's schema itself (see `new`): columns are where it puts them.
    canonical: bool,
}

impl<'a> Columns<'a> {
    /// Checks `batch` against `schema`: same column names, compatible types, no nulls where the
    /// schema forbids them.
    pub(crate) fn new(
        table: &'static str,
        schema: &Schema,
        batch: &'a RecordBatch,
    ) -> Result<Self> {
        let fail = |reason: String| Error::Schema { table, reason };
        // A batch built on the table's own schema (what `normalize` and the `to_batch`es return:
        // every batch the collector holds) has its names and types by construction; only its
        // nulls are checked. The alert engine reads batches of a rank's step (a few rows), where
        // comparing every column's type was most of the cost.
        let canonical = std::ptr::eq(batch.schema_ref().as_ref(), schema);
        if canonical {
            for (field, column) in schema.fields().iter().zip(batch.columns()) {
                if !field.is_nullable() && column.null_count() > 0 {
                    return Err(null_in(&fail, field.name(), column.as_ref()));
                }
            }
            return Ok(Columns {
                table,
                batch,
                canonical,
            });
        }
        for field in batch.schema().fields() {
            if schema.field_with_name(field.name()).is_err() {
                return Err(fail(format!(
                    "unexpected column {:?}; the columns are {}",
                    field.name(),
                    schema
                        .fields()
                        .iter()
                        .map(|f| f.name().as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        for field in schema.fields() {
            let Some(column) = batch.column_by_name(field.name()) else {
                return Err(fail(format!("missing column {:?}", field.name())));
            };
            if !same_type(field.data_type(), column.data_type()) {
                return Err(fail(format!(
                    "column {:?} has type {}, expected {}",
                    field.name(),
                    column.data_type(),
                    field.data_type()
                )));
            }
            if !field.is_nullable() && column.null_count() > 0 {
                return Err(null_in(&fail, field.name(), column.as_ref()));
            }
        }
        Ok(Columns {
            table,
            batch,
            canonical,
        })
    }

    /// Column `index` of the table's schema, named `name`: by position when the batch carries
    /// the schema itself, else by name.
    pub(crate) fn column_at(&self, index: usize, name: &str) -> &'a dyn Array {
        if self.canonical {
            self.batch.column(index).as_ref()
        } else {
            self.column(name)
        }
    }

    fn column(&self, name: &str) -> &'a dyn Array {
        // `new` checked presence; the schemas in this module name every column they read.
        self.batch
            .column_by_name(name)
            .map(|c| c.as_ref())
            .unwrap_or_else(|| panic!("column {name} checked by Columns::new"))
    }

    pub(crate) fn strings(&self, name: &str) -> &'a StringArray {
        self.column(name).as_string::<i32>()
    }

    pub(crate) fn primitive<T: ArrowPrimitiveType>(&self, name: &str) -> &'a PrimitiveArray<T> {
        self.column(name).as_primitive::<T>()
    }

    pub(crate) fn u32s(&self, name: &str) -> &'a PrimitiveArray<UInt32Type> {
        self.primitive(name)
    }
    pub(crate) fn u64s(&self, name: &str) -> &'a PrimitiveArray<UInt64Type> {
        self.primitive(name)
    }
    pub(crate) fn f64s(&self, name: &str) -> &'a PrimitiveArray<Float64Type> {
        self.primitive(name)
    }
    pub(crate) fn times(&self, name: &str) -> &'a PrimitiveArray<TimestampMillisecondType> {
        self.primitive(name)
    }
    pub(crate) fn list(&self, name: &str) -> &'a arrow_array::ListArray {
        self.column(name).as_list::<i32>()
    }

    pub(crate) fn rows(&self) -> usize {
        self.batch.num_rows()
    }

    /// Wraps a value error with the table and row it came from.
    pub(crate) fn at(&self, row: usize) -> impl Fn(Error) -> Error + '_ {
        move |e| Error::Row {
            table: self.table,
            row,
            source: Box::new(e),
        }
    }
}

/// The error for a null in required column `name`, naming its first null row.
fn null_in(fail: &impl Fn(String) -> Error, name: &str, column: &dyn Array) -> Error {
    let row = (0..column.len()).find(|&i| column.is_null(i)).unwrap_or(0);
    fail(format!("column {name:?} is required but row {row} is null"))
}

/// The value at `row`, or `None` if null.
#[inline]
pub(crate) fn opt<T: ArrowPrimitiveType>(a: &PrimitiveArray<T>, row: usize) -> Option<T::Native> {
    a.is_valid(row).then(|| a.value(row))
}

/// The string at `row`, or `None` if null.
#[inline]
pub(crate) fn opt_str(a: &StringArray, row: usize) -> Option<&str> {
    a.is_valid(row).then(|| a.value(row))
}

/// A timestamp column in milliseconds, annotated UTC.
pub(crate) fn utc_times(values: impl IntoIterator<Item = Option<i64>>) -> arrow_array::ArrayRef {
    Arc::new(arrow_array::TimestampMillisecondArray::from_iter(values).with_timezone("UTC"))
}

pub(crate) fn field(name: &str, data_type: DataType, nullable: bool) -> Field {
    Field::new(name, data_type, nullable)
}

pub(crate) fn schema(fields: Vec<Field>) -> SchemaRef {
    Arc::new(Schema::new(fields))
}
