//! The ingest path, independent of HTTP: decode, admit, log, apply, acknowledge.
//!
//! A batch is acknowledged only after its write-ahead-log record is fsynced *and* its rows are
//! in the hot buffer, so a successful response means "durable and queryable". A batch whose
//! idempotency key was already applied is acknowledged again without being written.

use std::sync::Arc;

use bytes::Bytes;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::alerting::EngineHandle;
use crate::commit::Committer;
use crate::decode::{self, Entry, Limits, Table};
use crate::error::{Error, Result};
use crate::idempotency::Key;
use crate::instrument::Labels;

/// The body's format, from its content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Arrow,
    Json,
}

impl Format {
    /// Picks the format from a `Content-Type` value (parameters ignored).
    pub fn from_content_type(value: Option<&str>) -> Result<Format> {
        let media = decode::media_type(value.unwrap_or(""));
        match media.as_str() {
            decode::ARROW_STREAM => Ok(Format::Arrow),
            "application/json" => Ok(Format::Json),
            "" => Err(Error::UnsupportedMediaType("(none)".into())),
            _ => Err(Error::UnsupportedMediaType(media)),
        }
    }

    fn label(self) -> &'static str {
        match self {
            Format::Arrow => "arrow",
            Format::Json => "json",
        }
    }
}

/// What the collector answers to an accepted batch: the contract's type.
pub use rankwatch_api::Ack;
use rankwatch_api::AckStatus;

/// Ingest's own counters; [`crate::telemetry`] exports them.
#[derive(Debug, Default)]
pub struct IngestMetrics {
    pub rows: Family<Labels, Counter>,
    pub bytes: Counter,
    pub batches: Family<Labels, Counter>,
    pub nonfinite: Counter,
    pub duplicates: Counter,
}

impl IngestMetrics {
    /// Adds these metrics to a registry, with their names and help texts.
    pub fn register(&self, r: &mut Registry) {
        r.register("ingest_rows", "Rows accepted, by table", self.rows.clone());
        r.register(
            "ingest_bytes",
            "Request body bytes accepted",
            self.bytes.clone(),
        );
        r.register(
            "ingest_batches",
            "Batches accepted, by body format",
            self.batches.clone(),
        );
        r.register(
            "ingest_nonfinite_values",
            "NaN or infinite sample values accepted (stored, not dropped)",
            self.nonfinite.clone(),
        );
        r.register(
            "ingest_duplicates",
            "Batches acknowledged again for an idempotency key already applied",
            self.duplicates.clone(),
        );
    }
}

/// Bodies up to this size are decoded on the request's task, larger ones on the blocking pool.
const INLINE_DECODE_BYTES: usize = 64 << 10;

/// Everything ingest needs.
#[derive(Debug, Clone)]
pub struct Ingestor {
    pub committer: Committer,
    pub metrics: Arc<IngestMetrics>,
    pub limits: Limits,
    /// Where accepted batches go next; `None` runs the collector without alerting.
    pub engine: Option<EngineHandle>,
}

impl Ingestor {
    /// Ingests one request body; a full hot buffer is waited for until `room_until`.
    pub async fn ingest(
        &self,
        body: Bytes,
        format: Format,
        table: Table,
        key: Option<&str>,
        room_until: tokio::time::Instant,
    ) -> Result<Ack> {
        let key = key.map(Key::parse).transpose()?;
        let store = self.committer.store.clone();
        let limits = self.limits;
        let body_len = body.len();
        let decode_body = body.clone();
        let decode = move || {
            let known = |run: &rankwatch_analytics::RunId| store.run_info(run);
            let arrived_ms = store.now_ms();
            match format {
                Format::Arrow => decode::decode_arrow(&decode_body, table, limits, &known),
                Format::Json => decode::decode_json(&decode_body, limits, arrived_ms, &known),
            }
        };
        // An agent's batch (a rank's report of a second, ~1.5 KB) decodes in microseconds: on
        // the request's own task. Handing it to the blocking pool cost two thread wake-ups a
        // request, more than the decoding. Large bodies still go there, so that decoding
        // 64 MiB never holds up the connections sharing a worker thread.
        let entry = if body_len <= INLINE_DECODE_BYTES {
            decode()?
        } else {
            tokio::task::spawn_blocking(decode)
                .await
                .map_err(|e| Error::Unavailable(format!("decoder task failed: {e}")))??
        };
        if let Some(key) = &key
            && key.run != entry.run
        {
            return Err(Error::bad(format!(
                "Idempotency-Key names run {:?} but the batch holds run {:?}",
                key.run.as_str(),
                entry.run.as_str()
            )));
        }
        let rows = entry.rows();
        let nonfinite = entry.nonfinite();
        let raw = (format == Format::Arrow).then_some((table, &body[..]));
        let run = entry.run.to_string();
        let Some(seq) = self.commit(key.as_ref(), entry, raw, room_until).await? else {
            self.metrics.duplicates.inc();
            return Ok(Ack {
                status: AckStatus::Duplicate,
                run,
                rows: rows as u64,
                nonfinite: nonfinite as u64,
                seq: None,
            });
        };
        let table_label = table.as_str();
        let t = &self.metrics;
        let table_name = if format == Format::Json {
            "mixed"
        } else {
            table_label
        };
        t.rows
            .get_or_create(&vec![("table", table_name)])
            .inc_by(rows as u64);
        t.batches
            .get_or_create(&vec![("format", format.label())])
            .inc();
        t.bytes.inc_by(body_len as u64);
        t.nonfinite.inc_by(nonfinite as u64);
        Ok(Ack {
            status: AckStatus::Stored,
            run,
            rows: rows as u64,
            nonfinite: nonfinite as u64,
            seq: Some(seq),
        })
    }

    /// Admits, logs and applies a decoded entry, then hands it to the alert engine. Returns
    /// its log sequence number, or `None` when its key was already applied.
    pub async fn commit(
        &self,
        key: Option<&Key>,
        entry: Entry,
        raw: Option<(Table, &[u8])>,
        room_until: tokio::time::Instant,
    ) -> Result<Option<u64>> {
        let arrived_ms = self.committer.store.now_ms();
        let Some(seq) = self
            .committer
            .commit(key, &entry, raw, Some(room_until))
            .await?
        else {
            return Ok(None);
        };
        if let Some(engine) = &self.engine {
            engine.feed(entry, arrived_ms).await;
        }
        Ok(Some(seq))
    }
}
