//! Exporting one run's table (`GET /api/v1/runs/{run}/export`, `rankwatch export`) as Parquet
//! or CSV, streamed.
//!
//! The rows are what a query sees at the moment the export starts: the run's Parquet files
//! (opened up front, so a compaction that replaces them meanwhile cannot pull them away) and
//! its hot batches. Parts in object storage cannot be held open: they are fetched one at a
//! time as the export reaches them, and a part replaced by compaction stays readable for the
//! store's grace period; an export outlasting that fails rather than skip rows. They are written file by file, batch by batch, with the `run` column put
//! back, so memory stays at one batch whatever the run's size. Row order is storage order:
//! each file is sorted (samples by metric, layer, site, rank, step), the files are not merged.
//!
//! The writer runs on a blocking thread and hands the body over in chunks through a bounded
//! channel; a client that goes away stops it. An error after the first bytes can only cut the
//! response short — for Parquet that leaves no footer, so a reader refuses the file rather
//! than read part of it.

use std::fs::File;
use std::io::{self, Write};

use arrow_array::RecordBatch;
use bytes::Bytes;
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
use parquet::basic::{Compression, ZstdLevel};
use parquet::file::properties::WriterProperties;
use rankwatch_analytics::RunId;
use tokio::sync::mpsc;

use crate::entry::Table;
use crate::error::{Error, Result};
use crate::store::backend::Backend;
use crate::store::{TableView, add_run_column, files::file_schema};

/// The export's file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Parquet,
    Csv,
}

impl Format {
    /// `parquet` or `csv`.
    pub fn parse(text: &str) -> Result<Format> {
        match text {
            "parquet" => Ok(Format::Parquet),
            "csv" => Ok(Format::Csv),
            other => Err(Error::bad(format!(
                "unknown export format {other:?}; expected parquet or csv"
            ))),
        }
    }

    pub fn extension(self) -> &'static str {
        match self {
            Format::Parquet => "parquet",
            Format::Csv => "csv",
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::Parquet => "application/vnd.apache.parquet",
            Format::Csv => "text/csv; charset=utf-8",
        }
    }
}

/// A run's rows, pinned: open files and hot batches.
#[derive(Debug)]
pub struct Snapshot {
    run: RunId,
    table: Table,
    parts: Vec<Pinned>,
    batches: Vec<RecordBatch>,
}

/// One Parquet part of a snapshot.
#[derive(Debug)]
enum Pinned {
    /// Opened in the data directory.
    File(File),
    /// In object storage, fetched when its turn comes.
    Object(Backend, std::path::PathBuf),
}

impl Snapshot {
    /// Opens every file of `view` now (local parts; object-storage parts are named only).
    pub fn open(run: RunId, table: Table, view: TableView, backend: &Backend) -> Result<Snapshot> {
        let parts = view
            .files
            .into_iter()
            .map(|relative| match backend {
                Backend::Local(_) => File::open(backend.location(&relative)).map(Pinned::File),
                Backend::Remote(_) => Ok(Pinned::Object(backend.clone(), relative)),
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(Snapshot {
            run,
            table,
            parts,
            batches: view.batches,
        })
    }

    /// Writes every row to `out` in `format`; returns the row count.
    pub fn write(self, format: Format, out: impl Write + Send) -> Result<u64> {
        let schema =
            add_run_column(&RecordBatch::new_empty(file_schema(self.table)), &self.run)?.schema();
        let mut sink: Box<dyn BatchSink + '_> = match format {
            Format::Parquet => {
                let properties = WriterProperties::builder()
                    .set_compression(Compression::ZSTD(ZstdLevel::try_new(3).unwrap_or_default()))
                    .build();
                Box::new(ArrowWriter::try_new(out, schema, Some(properties))?)
            }
            Format::Csv => Box::new(arrow_csv::WriterBuilder::new().with_header(true).build(out)),
        };
        let mut rows = 0u64;
        let mut put = |batch: &RecordBatch, sink: &mut Box<dyn BatchSink + '_>| -> Result<()> {
            let with_run = add_run_column(batch, &self.run)?;
            rows += with_run.num_rows() as u64;
            sink.put(&with_run)
        };
        for part in self.parts {
            match part {
                Pinned::File(file) => {
                    let reader = ParquetRecordBatchReaderBuilder::try_new(file)?
                        .with_batch_size(64 * 1024)
                        .build()?;
                    for batch in reader {
                        put(&batch.map_err(Error::Arrow)?, &mut sink)?;
                    }
                }
                Pinned::Object(backend, relative) => {
                    for batch in backend.read(&relative)? {
                        put(&batch, &mut sink)?;
                    }
                }
            }
        }
        for batch in &self.batches {
            put(batch, &mut sink)?;
        }
        sink.finish()?;
        Ok(rows)
    }
}

/// The two writers, behind one face.
trait BatchSink {
    fn put(&mut self, batch: &RecordBatch) -> Result<()>;
    fn finish(self: Box<Self>) -> Result<()>;
}

impl<W: Write + Send> BatchSink for ArrowWriter<W> {
    fn put(&mut self, batch: &RecordBatch) -> Result<()> {
        Ok(self.write(batch)?)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        let mut out = self.into_inner()?;
        Ok(out.flush()?)
    }
}

impl<W: Write> BatchSink for arrow_csv::Writer<W> {
    fn put(&mut self, batch: &RecordBatch) -> Result<()> {
        self.write(batch).map_err(Error::Arrow)
    }

    fn finish(self: Box<Self>) -> Result<()> {
        let mut out = self.into_inner();
        Ok(out.flush()?)
    }
}

/// An `io::Write` that sends what it is given as body chunks of about `CHUNK` bytes.
#[derive(Debug)]
pub struct ChannelWriter {
    buffer: Vec<u8>,
    tx: mpsc::Sender<io::Result<Bytes>>,
    /// Longest wait for the client to take a chunk: a client that stops reading would
    /// otherwise hold the export's thread (and its slot) for ever.
    stall: std::time::Duration,
    runtime: tokio::runtime::Handle,
}

const CHUNK: usize = 256 * 1024;

impl ChannelWriter {
    /// A writer into `tx`; call on a blocking thread of the runtime (it waits on the channel).
    pub fn new(tx: mpsc::Sender<io::Result<Bytes>>, stall: std::time::Duration) -> Self {
        ChannelWriter {
            buffer: Vec::with_capacity(CHUNK),
            tx,
            stall,
            runtime: tokio::runtime::Handle::current(),
        }
    }

    fn send(&mut self) -> io::Result<()> {
        if self.buffer.is_empty() {
            return Ok(());
        }
        let chunk = Bytes::from(std::mem::replace(
            &mut self.buffer,
            Vec::with_capacity(CHUNK),
        ));
        let sent = self
            .runtime
            .block_on(self.tx.send_timeout(Ok(chunk), self.stall));
        sent.map_err(|e| match e {
            mpsc::error::SendTimeoutError::Timeout(_) => io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the client took no data for {:?} (--body-timeout)",
                    self.stall
                ),
            ),
            mpsc::error::SendTimeoutError::Closed(_) => {
                io::Error::new(io::ErrorKind::BrokenPipe, "the client went away")
            }
        })
    }
}

impl Write for ChannelWriter {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        self.buffer.extend_from_slice(data);
        if self.buffer.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.send()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_stops_reading_ends_the_export_after_the_stall_timeout() {
        let (tx, mut rx) = mpsc::channel(1);
        let writer = tokio::task::spawn_blocking(move || {
            let mut w = ChannelWriter::new(tx, Duration::from_millis(100));
            // Two chunks fit (one in the channel, one taken below); the third waits in vain.
            for _ in 0..3 {
                w.write_all(&vec![7u8; CHUNK])?;
            }
            w.flush()
        });
        let first = rx.recv().await.expect("a first chunk").unwrap();
        assert_eq!(first.len(), CHUNK);
        let err = writer.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("--body-timeout"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_went_away_ends_the_export_at_once() {
        let (tx, rx) = mpsc::channel(1);
        drop(rx);
        let err = tokio::task::spawn_blocking(move || {
            let mut w = ChannelWriter::new(tx, Duration::from_secs(3600));
            w.write_all(&vec![7u8; CHUNK])
        })
        .await
        .unwrap()
        .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    }
}
