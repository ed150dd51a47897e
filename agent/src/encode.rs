//! Rows to request bodies: one Arrow IPC stream per table, buffers compressed with zstd.
//!
//! Samples are built column by column straight from the queued points (no intermediate
//! `Sample` structs); sketches and run metadata are rare and go through the shared schema
//! code of the analytics crate, so the wire layout has exactly one definition.

use std::sync::Arc;

use arrow_array::{
    ArrayRef, Float64Array, RecordBatch, StringArray, TimestampMillisecondArray, UInt32Array,
    UInt64Array,
};
use arrow_ipc::CompressionType;
use arrow_ipc::writer::{IpcWriteOptions, StreamWriter};
pub use rankwatch_analytics::schema::Table;
use rankwatch_analytics::schema::{runs, samples, sketches};
use rankwatch_analytics::{RunId, RunInfo, SketchRecord};

use crate::error::{Error, Result};
use crate::record::Point;

/// A point with its step and time, as it waits to be batched.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub step: u64,
    pub time_ms: i64,
    pub point: Point,
}

/// The `samples` body of `rows`.
pub fn samples_body(run: &RunId, rows: &[Row]) -> Result<Vec<u8>> {
    let columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(std::iter::repeat_n(
            run.as_str(),
            rows.len(),
        ))),
        Arc::new(UInt32Array::from_iter(rows.iter().map(|r| r.point.rank))),
        Arc::new(UInt64Array::from_iter_values(rows.iter().map(|r| r.step))),
        Arc::new(
            TimestampMillisecondArray::from_iter_values(rows.iter().map(|r| r.time_ms))
                .with_timezone("UTC"),
        ),
        Arc::new(StringArray::from_iter_values(
            rows.iter().map(|r| r.point.metric.as_str()),
        )),
        Arc::new(UInt32Array::from_iter(rows.iter().map(|r| r.point.layer))),
        Arc::new(StringArray::from_iter(
            rows.iter().map(|r| r.point.site.map(|s| s.as_str())),
        )),
        Arc::new(Float64Array::from_iter_values(
            rows.iter().map(|r| r.point.value),
        )),
    ];
    let batch = RecordBatch::try_new(samples::schema_ref(), columns)
        .map_err(|e| Error::Encode(e.to_string()))?;
    ipc(&batch)
}

/// The `sketches` body of `rows`.
pub fn sketches_body(rows: &[SketchRecord]) -> Result<Vec<u8>> {
    ipc(&sketches::to_batch(rows)?)
}

/// The `runs` body of one run's metadata.
pub fn runs_body(info: &RunInfo) -> Result<Vec<u8>> {
    ipc(&runs::to_batch(std::slice::from_ref(info))?)
}

fn ipc(batch: &RecordBatch) -> Result<Vec<u8>> {
    let fail = |e: arrow_schema::ArrowError| Error::Encode(e.to_string());
    let options = IpcWriteOptions::default()
        .try_with_compression(Some(CompressionType::ZSTD))
        .map_err(fail)?;
    let mut body = Vec::new();
    let mut writer =
        StreamWriter::try_new_with_options(&mut body, &batch.schema(), options).map_err(fail)?;
    writer.write(batch).map_err(fail)?;
    writer.finish().map_err(fail)?;
    drop(writer);
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Metric;
    use arrow_ipc::reader::StreamReader;
    use rankwatch_analytics::Site;

    #[test]
    fn samples_round_trip_through_the_shared_schema() {
        let run = RunId::new("r1").unwrap();
        let rows = vec![
            Row {
                step: 3,
                time_ms: 1_700_000_000_000,
                point: Point {
                    metric: Metric::new("loss").unwrap(),
                    rank: Some(1),
                    layer: None,
                    site: None,
                    value: f64::NAN,
                },
            },
            Row {
                step: 3,
                time_ms: 1_700_000_000_001,
                point: Point {
                    metric: Metric::new("act_max").unwrap(),
                    rank: None,
                    layer: Some(2),
                    site: Some(Site::Residual),
                    value: 7.5,
                },
            },
        ];
        let body = samples_body(&run, &rows).unwrap();
        let batches: Vec<_> = StreamReader::try_new(std::io::Cursor::new(body), None)
            .unwrap()
            .collect::<std::result::Result<_, _>>()
            .unwrap();
        let back = samples::from_batch(&batches[0]).unwrap();
        assert_eq!(back.len(), 2);
        assert!(back[0].value.is_nan());
        assert_eq!(back[0].rank, Some(1));
        assert_eq!(back[1].site, Some(Site::Residual));
        assert_eq!(back[1].layer, Some(2));
        assert_eq!(back[1].time_ms, 1_700_000_000_001);
        assert_eq!(back[1].metric.as_str(), "act_max");
    }
}
