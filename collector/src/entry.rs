//! The collector's unit of data: one checked batch of one run ([`Entry`]), as ingest admits it,
//! the write-ahead log records it, the hot buffer holds it and the alert engine reads it.
//!
//! Kept apart from [`crate::decode`] (which turns request bodies and log payloads *into*
//! entries) so that the store, the queries and the alert engine depend on the model only, not
//! on how bodies are parsed.

use arrow_array::RecordBatch;
use arrow_array::cast::AsArray;
use arrow_array::types::Float64Type;
use rankwatch_analytics::schema::{runs, samples, sketches};
use rankwatch_analytics::{RunId, RunInfo};

pub use rankwatch_analytics::schema::Table;

/// One ingest request's data, checked: rows of one run.
#[derive(Debug, Clone)]
pub struct Entry {
    pub run: RunId,
    pub samples: Option<RecordBatch>,
    pub sketches: Option<RecordBatch>,
    pub info: Option<RunInfo>,
}

impl Entry {
    /// Rows over all parts.
    pub fn rows(&self) -> usize {
        self.samples.as_ref().map_or(0, RecordBatch::num_rows)
            + self.sketches.as_ref().map_or(0, RecordBatch::num_rows)
            + usize::from(self.info.is_some())
    }

    /// NaN and ±Inf sample values.
    pub fn nonfinite(&self) -> usize {
        self.samples.as_ref().map_or(0, |b| {
            b.column(7)
                .as_primitive::<Float64Type>()
                .values()
                .iter()
                .filter(|v| !v.is_finite())
                .count()
        })
    }
}

/// Shared handle to a schema, for callers that build empty tables.
pub fn schema_of(table: Table) -> arrow_schema::SchemaRef {
    match table {
        Table::Samples => samples::schema_ref(),
        Table::Sketches => sketches::schema_ref(),
        Table::Runs => runs::schema_ref(),
    }
}
