//! Turning an ingest body into checked batches, and batches into write-ahead-log payloads.
//!
//! Two body forms are accepted. An Arrow IPC *stream* (`application/vnd.apache.arrow.stream`,
//! zstd or LZ4 buffer compression allowed) of one table, chosen by `?table=`; this is what the
//! agent sends, and its bytes go into the log as they are. And a JSON document for curl and
//! simple clients (see `docs/api.md`), which is converted to Arrow before it is logged, so that
//! replay never depends on the clock (`time_ms` defaults to the arrival time).
//!
//! Every batch holds rows of one run (the idempotency key names it). Sample rows are checked
//! column-wise: identifiers and scope rules are checked once per distinct (metric, site,
//! rank?, layer?) combination through [`Sample::validate`], ranges once per row. Values are not
//! checked: NaN and ±Inf are stored and counted.

use std::io::Cursor;

use arrow_array::cast::AsArray;
use arrow_array::types::{UInt32Type, UInt64Type};
use arrow_array::{Array, RecordBatch};
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::StreamWriter;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use rankwatch_analytics::schema::{runs, samples, sketches};
use rankwatch_analytics::{MetricName, RunId, RunInfo, Sample, Site, SketchRecord};
use rankwatch_api::IngestBody;

use crate::error::{Error, Result};

/// Media type of Arrow IPC stream bodies.
pub const ARROW_STREAM: &str = "application/vnd.apache.arrow.stream";

pub use crate::entry::{Entry, Table};

/// The media type of a `Content-Type` value: lowercase, parameters dropped.
pub fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// Parses the `?table=` parameter.
pub fn parse_table(name: &str) -> Result<Table> {
    Table::from_name(name).ok_or_else(|| {
        Error::bad(format!(
            "unknown table {name:?}; expected samples, sketches or runs"
        ))
    })
}

/// Limits a body must respect.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_rows: usize,
    /// Most ranks a run may declare: the alert engine keeps per-rank state and visits every
    /// rank of a step, so an absurd world size is an allocation the collector cannot survive.
    pub max_world_size: u32,
}

/// Checks a run's metadata: its own invariants, then this collector's limits.
fn check_info(info: &RunInfo, limits: Limits) -> Result<()> {
    info.validate()?;
    if info.world_size > limits.max_world_size {
        return Err(Error::bad(format!(
            "world_size {} is above this collector's limit of {} ranks (--max-world-size)",
            info.world_size, limits.max_world_size
        )));
    }
    Ok(())
}

/// Most bytes the buffers of one body may decompress to, as a multiple of the body's size.
/// Metric columns compress well, but not a thousandfold; a larger claim is a decompression bomb.
const MAX_EXPANSION: usize = 1000;

fn malformed(why: String) -> Error {
    Error::Arrow(arrow_schema::ArrowError::IpcError(why))
}

fn read_i32(body: &[u8], at: usize) -> Result<i32> {
    body.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map(i32::from_le_bytes)
        .ok_or_else(|| malformed("cut short inside a message header".into()))
}

/// Walks the stream's framing before any decoding: every message and body must lie inside the
/// request, no dictionary batches (no table has dictionaries), at most `max_rows` rows, and
/// declared decompressed sizes within `MAX_EXPANSION` (1000) times the body. The decoder
/// trusts these lengths when it allocates, so without this check a few hostile bytes could
/// make it ask for terabytes and abort the process. Returns the bytes the buffers decode to (their declared
/// decompressed sizes; the stored sizes where uncompressed): what ingest charges to its
/// in-flight budget before decoding.
pub fn preflight(body: &[u8], max_rows: usize) -> Result<usize> {
    let fail = malformed;
    let max_decoded = body.len().saturating_mul(MAX_EXPANSION);
    let (mut at, mut rows, mut decoded) = (0usize, 0i64, 0usize);
    while at < body.len() {
        let mut len = read_i32(body, at)?;
        at += 4;
        if len == -1 {
            len = read_i32(body, at)?;
            at += 4;
        }
        if len == 0 {
            break; // end-of-stream marker
        }
        let len = usize::try_from(len).map_err(|_| fail("negative message length".into()))?;
        let meta = body.get(at..at.saturating_add(len)).ok_or_else(|| {
            fail(format!(
                "a message header of {len} bytes runs past the body"
            ))
        })?;
        at += len;
        let message = arrow_ipc::root_as_message(meta)
            .map_err(|e| fail(format!("unreadable message header: {e}")))?;
        let body_len = usize::try_from(message.bodyLength())
            .map_err(|_| fail("negative message body length".into()))?;
        let message_body = body.get(at..at.saturating_add(body_len)).ok_or_else(|| {
            fail(format!(
                "a message body of {body_len} bytes runs past the request"
            ))
        })?;
        if message.header_as_dictionary_batch().is_some() {
            return Err(fail("dictionary batches are not accepted".into()));
        }
        if let Some(batch) = message.header_as_record_batch() {
            rows = rows.saturating_add(batch.length().max(0));
            if rows as u64 > max_rows as u64 {
                return Err(Error::TooManyRows {
                    rows: usize::try_from(rows).unwrap_or(usize::MAX),
                    limit: max_rows,
                });
            }
            let compressed = batch.compression().is_some();
            for buffer in batch.buffers().iter().flatten() {
                let (offset, length) = (buffer.offset(), buffer.length());
                let (Ok(offset), Ok(length)) = (usize::try_from(offset), usize::try_from(length))
                else {
                    return Err(fail("negative buffer offset or length".into()));
                };
                let bytes = message_body
                    .get(offset..offset.saturating_add(length))
                    .ok_or_else(|| fail("a buffer lies outside its message body".into()))?;
                let size = match (compressed, bytes.get(..8)) {
                    (true, Some(prefix)) => {
                        let declared = i64::from_le_bytes(prefix.try_into().unwrap_or([0; 8]));
                        if declared < 0 {
                            length
                        } else {
                            usize::try_from(declared).unwrap_or(usize::MAX)
                        }
                    }
                    _ => length,
                };
                decoded = decoded.saturating_add(size);
                if decoded > max_decoded {
                    return Err(fail(format!(
                        "buffers claim to decompress to more than {MAX_EXPANSION} times the body"
                    )));
                }
            }
        }
        at += body_len;
    }
    Ok(decoded)
}

/// Reads every batch of an Arrow IPC stream whose schema is `expected`'s. The framing is checked
/// first (`preflight`) and the schema before any batch is decoded; a panic inside the decoder
/// (a bug in a dependency on hostile input) becomes an error too.
pub fn read_ipc(body: &[u8], table: Table, max_rows: usize) -> Result<Vec<RecordBatch>> {
    preflight(body, max_rows)?;
    // Read in place: a copy of the body (once made here) doubled what a batch holds in memory.
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(
        || -> Result<Vec<RecordBatch>> {
            let reader = StreamReader::try_new(Cursor::new(body), None).map_err(Error::Arrow)?;
            // The schema message alone says whether the batches can be ours.
            normalizer(table)(&RecordBatch::new_empty(reader.schema()))?;
            reader
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(Error::Arrow)
        },
    ))
    .unwrap_or_else(|_| Err(malformed("the decoder rejected it".into())))
}

fn normalizer(table: Table) -> fn(&RecordBatch) -> rankwatch_analytics::Result<RecordBatch> {
    match table {
        Table::Samples => samples::normalize,
        Table::Sketches => sketches::normalize,
        Table::Runs => runs::normalize,
    }
}

fn concat(table: Table, batches: Vec<RecordBatch>, limits: Limits) -> Result<RecordBatch> {
    let rows: usize = batches.iter().map(RecordBatch::num_rows).sum();
    if rows > limits.max_rows {
        return Err(Error::TooManyRows {
            rows,
            limit: limits.max_rows,
        });
    }
    if rows == 0 {
        return Err(Error::bad(format!(
            "the {} batch holds no rows",
            table.as_str()
        )));
    }
    let batches = batches
        .iter()
        .map(normalizer(table))
        .collect::<rankwatch_analytics::Result<Vec<_>>>()?;
    let schema = batches[0].schema();
    arrow_select::concat::concat_batches(&schema, &batches).map_err(Error::Arrow)
}

/// Decodes an Arrow IPC body of `table` into a checked [`Entry`]. `known` looks up a run's
/// metadata, so rank and layer ranges are checked when the run has announced itself.
pub fn decode_arrow(
    body: &[u8],
    table: Table,
    limits: Limits,
    known: &dyn Fn(&RunId) -> Option<RunInfo>,
) -> Result<Entry> {
    let batch = concat(table, read_ipc(body, table, limits.max_rows)?, limits)?;
    entry_from_batch(table, batch, known, limits)
}

fn entry_from_batch(
    table: Table,
    batch: RecordBatch,
    known: &dyn Fn(&RunId) -> Option<RunInfo>,
    limits: Limits,
) -> Result<Entry> {
    match table {
        Table::Samples => {
            let run = single_run(&batch)?;
            let info = known(&run);
            check_samples(&run, &batch, info.as_ref())?;
            Ok(Entry {
                run,
                samples: Some(batch),
                sketches: None,
                info: None,
            })
        }
        Table::Sketches => {
            let rows = sketches::from_batch(&batch)?;
            let run = single_run(&batch)?;
            let info = known(&run);
            check_sketches(&rows, info.as_ref())?;
            Ok(Entry {
                run,
                samples: None,
                sketches: Some(batch),
                info: None,
            })
        }
        Table::Runs => {
            let mut rows = runs::from_batch(&batch)?;
            if rows.len() != 1 {
                return Err(Error::bad(format!(
                    "a runs batch holds exactly one run's metadata, got {} rows",
                    rows.len()
                )));
            }
            let info = rows.remove(0);
            check_info(&info, limits)?;
            Ok(Entry {
                run: info.run.clone(),
                samples: None,
                sketches: None,
                info: Some(info),
            })
        }
    }
}

/// The run of a normalized batch (its first column), which must be the same on every row.
fn single_run(batch: &RecordBatch) -> Result<RunId> {
    let column = batch.column(0).as_string::<i32>();
    let first = column.value(0);
    if let Some(row) = (0..column.len()).find(|&i| column.value(i) != first) {
        return Err(Error::bad(format!(
            "a batch must hold rows of one run; row 0 has {first:?}, row {row} has {:?}",
            column.value(row)
        )));
    }
    Ok(RunId::new(first)?)
}

/// Checks every row of a normalized samples batch (see the module docs).
fn check_samples(run: &RunId, batch: &RecordBatch, info: Option<&RunInfo>) -> Result<()> {
    let rank = batch.column(1).as_primitive::<UInt32Type>();
    let step = batch.column(2).as_primitive::<UInt64Type>();
    let metric = batch.column(4).as_string::<i32>();
    let layer = batch.column(5).as_primitive::<UInt32Type>();
    let site = batch.column(6).as_string::<i32>();
    let world = info.map(|i| i.world_size);
    let layers = info.map(|i| i.layout.layer_count()).filter(|&n| n > 0);
    let mut seen: foldhash::HashSet<(&str, Option<&str>, bool, bool)> = Default::default();
    let mut previous = None;
    for row in 0..batch.num_rows() {
        let row_rank = rank.is_valid(row).then(|| rank.value(row));
        let row_layer = layer.is_valid(row).then(|| layer.value(row));
        let row_site = site.is_valid(row).then(|| site.value(row));
        let key = (
            metric.value(row),
            row_site,
            row_rank.is_some(),
            row_layer.is_some(),
        );
        let at = |source: rankwatch_analytics::Error| rankwatch_analytics::Error::Row {
            table: samples::TABLE,
            row,
            source: Box::new(source),
        };
        // Rows come in runs of one shape: the set is asked only when the shape changes.
        if previous != Some(key) && !seen.contains(&key) {
            // One representative row per shape runs the full scope check.
            let sample = Sample {
                run: run.clone(),
                rank: row_rank,
                step: step.value(row),
                time_ms: 0,
                metric: MetricName::new(key.0).map_err(at)?,
                layer: row_layer,
                site: row_site
                    .map(str::parse::<Site>)
                    .transpose()
                    .map_err(|e| at(e.into()))?,
                value: 0.0,
            };
            sample.validate(None).map_err(at)?;
            seen.insert(key);
        }
        previous = Some(key);
        if let (Some(r), Some(w)) = (row_rank, world)
            && r >= w
        {
            return Err(Error::Domain(at(
                rankwatch_analytics::Error::InvalidSample {
                    metric: key.0.to_owned(),
                    reason: format!("rank {r} out of range: world size is {w}"),
                },
            )));
        }
        if let (Some(l), Some(n)) = (row_layer, layers)
            && l >= n
        {
            return Err(Error::Domain(at(
                rankwatch_analytics::Error::InvalidSample {
                    metric: key.0.to_owned(),
                    reason: format!("layer {l} out of range: the model has {n} layers"),
                },
            )));
        }
    }
    Ok(())
}

fn check_sketches(rows: &[SketchRecord], info: Option<&RunInfo>) -> Result<()> {
    let dim = rows[0].vector.len();
    for (row, r) in rows.iter().enumerate() {
        let fail = |reason: String| Error::bad(format!("table sketches, row {row}: {reason}"));
        if r.vector.is_empty() || r.vector.len() != dim {
            return Err(fail(format!(
                "sketch has {} entries; every sketch of a batch needs the same non-zero size ({dim})",
                r.vector.len()
            )));
        }
        if let Some(info) = info
            && r.rank >= info.world_size
        {
            return Err(fail(format!(
                "rank {} out of range: world size is {}",
                r.rank, info.world_size
            )));
        }
    }
    Ok(())
}

/// Decodes a JSON body into a checked [`Entry`]; missing times become `now_ms`.
pub fn decode_json(
    body: &[u8],
    limits: Limits,
    now_ms: i64,
    known: &dyn Fn(&RunId) -> Option<RunInfo>,
) -> Result<Entry> {
    // The contract's type; an error names the field where it lies (`samples[3].value: ...`).
    let doc: IngestBody = serde_path_to_error::deserialize(
        &mut serde_json::Deserializer::from_slice(body),
    )
    .map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            Error::Json(inner)
        } else {
            Error::Json(serde::de::Error::custom(format!("{path}: {inner}")))
        }
    })?;
    let run = RunId::new(doc.run)?;
    let rows = doc.samples.len() + doc.sketches.len();
    if rows > limits.max_rows {
        return Err(Error::TooManyRows {
            rows,
            limit: limits.max_rows,
        });
    }
    if rows == 0 && doc.info.is_none() {
        return Err(Error::bad(
            "the body holds nothing: give at least one of info, samples, sketches",
        ));
    }
    let info = doc
        .info
        .map(|i| {
            let info = RunInfo {
                run: run.clone(),
                world_size: i.world_size,
                started_at_ms: i.started_at_ms.unwrap_or(now_ms),
                layout: i.layout,
                tags: i.tags,
            };
            check_info(&info, limits).map(|_| info)
        })
        .transpose()?;
    let known_info = info.clone().or_else(|| known(&run));
    let samples = if doc.samples.is_empty() {
        None
    } else {
        let rows = doc
            .samples
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let at = |e: rankwatch_analytics::Error| {
                    Error::Domain(rankwatch_analytics::Error::Row {
                        table: samples::TABLE,
                        row: i,
                        source: Box::new(e),
                    })
                };
                Ok(Sample {
                    run: run.clone(),
                    rank: s.rank,
                    step: s.step,
                    time_ms: s.time_ms.unwrap_or(now_ms),
                    metric: MetricName::new(s.metric).map_err(at)?,
                    layer: s.layer,
                    site: s
                        .site
                        .as_deref()
                        .map(str::parse::<Site>)
                        .transpose()
                        .map_err(|e| at(e.into()))?,
                    value: s.value.get(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let batch = samples::to_batch(&rows)?;
        check_samples(&run, &batch, known_info.as_ref())?;
        Some(batch)
    };
    let sketches = if doc.sketches.is_empty() {
        None
    } else {
        let rows = doc
            .sketches
            .into_iter()
            .map(|s| SketchRecord {
                run: run.clone(),
                rank: s.rank,
                step: s.step,
                time_ms: s.time_ms.unwrap_or(now_ms),
                kind: s.kind,
                seed: s.seed,
                norm: s.norm.get(),
                vector: s.vector,
            })
            .collect::<Vec<_>>();
        check_sketches(&rows, known_info.as_ref())?;
        Some(sketches::to_batch(&rows)?)
    };
    Ok(Entry {
        run,
        samples,
        sketches,
        info,
    })
}

fn ipc_bytes(batch: &RecordBatch) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut writer = StreamWriter::try_new(&mut out, &batch.schema()).map_err(Error::Arrow)?;
    writer.write(batch).map_err(Error::Arrow)?;
    writer.finish().map_err(Error::Arrow)?;
    drop(writer);
    Ok(out)
}

const ENTRY_VERSION: u8 = 1;

/// Encodes a log payload: version, idempotency key, then tagged Arrow IPC parts. `raw` is the
/// request body when it already is the IPC encoding of the entry's one part.
pub fn encode_entry(
    key: Option<&str>,
    entry: &Entry,
    raw: Option<(Table, &[u8])>,
) -> Result<Bytes> {
    let key = key.unwrap_or("");
    let mut out = BytesMut::new();
    out.put_u8(ENTRY_VERSION);
    out.put_u16_le(u16::try_from(key.len()).map_err(|_| Error::bad("idempotency key too long"))?);
    out.put_slice(key.as_bytes());
    let mut parts: Vec<(Table, Vec<u8>)> = Vec::new();
    if let Some((table, body)) = raw {
        parts.push((table, body.to_vec()));
    } else {
        if let Some(info) = &entry.info {
            parts.push((
                Table::Runs,
                ipc_bytes(&runs::to_batch(std::slice::from_ref(info))?)?,
            ));
        }
        if let Some(b) = &entry.samples {
            parts.push((Table::Samples, ipc_bytes(b)?));
        }
        if let Some(b) = &entry.sketches {
            parts.push((Table::Sketches, ipc_bytes(b)?));
        }
    }
    out.put_u8(parts.len() as u8);
    for (table, bytes) in parts {
        out.put_u8(table.tag());
        // A part's length is 4 bytes on the log: a larger one is refused, never wrapped (a
        // wrapped length would make replay read the rest of the record as the next part).
        out.put_u32_le(part_len(bytes.len())?);
        out.put_slice(&bytes);
    }
    // The log's record length is 4 bytes too (with the 8-byte sequence number): refused here,
    // before the log sees it — a write error there stops the log for every batch.
    part_len(out.len() + 8)?;
    Ok(out.freeze())
}

/// A log part's length as its 4-byte field, or the refusal of a part of 4 GiB or more.
fn part_len(len: usize) -> Result<u32> {
    u32::try_from(len).map_err(|_| Error::BodyTooLarge {
        limit: u32::MAX as usize,
    })
}

/// Decodes a log payload written by [`encode_entry`]. The rows were checked when they arrived;
/// replay only re-reads them, so a later limit change cannot make an acknowledged batch vanish.
pub fn decode_entry(mut payload: &[u8]) -> Result<(Option<String>, Entry)> {
    let corrupt = |reason: &str| Error::Corrupt {
        what: "write-ahead-log entry".into(),
        reason: reason.into(),
    };
    if payload.remaining() < 4 || payload.get_u8() != ENTRY_VERSION {
        return Err(corrupt("unknown version"));
    }
    let key_len = payload.get_u16_le() as usize;
    if payload.remaining() < key_len + 1 {
        return Err(corrupt("cut short"));
    }
    let key = std::str::from_utf8(&payload[..key_len])
        .map_err(|_| corrupt("key is not utf-8"))?
        .to_owned();
    payload.advance(key_len);
    let parts = payload.get_u8();
    let mut entry: Option<Entry> = None;
    let limits = Limits {
        max_rows: usize::MAX,
        max_world_size: u32::MAX,
    };
    for _ in 0..parts {
        if payload.remaining() < 5 {
            return Err(corrupt("cut short"));
        }
        let tag = payload.get_u8();
        let table = Table::from_tag(tag).ok_or_else(|| Error::Corrupt {
            what: "write-ahead-log entry".into(),
            reason: format!("unknown table tag {tag}"),
        })?;
        let len = payload.get_u32_le() as usize;
        if payload.remaining() < len {
            return Err(corrupt("cut short"));
        }
        let batch = concat(table, read_ipc(&payload[..len], table, usize::MAX)?, limits)?;
        payload.advance(len);
        let part = entry_from_batch(table, batch, &|_| None, limits)?;
        match entry.as_mut() {
            None => entry = Some(part),
            Some(e) => {
                e.samples = e.samples.take().or(part.samples);
                e.sketches = e.sketches.take().or(part.sketches);
                e.info = e.info.take().or(part.info);
            }
        }
    }
    let entry = entry.ok_or_else(|| corrupt("no parts"))?;
    Ok(((!key.is_empty()).then_some(key), entry))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_part_or_record_of_4_gib_is_refused_not_wrapped() {
        assert_eq!(part_len(12).unwrap(), 12);
        assert_eq!(part_len(u32::MAX as usize).unwrap(), u32::MAX);
        // Before, `as u32` wrapped 4 GiB + 6 to 5, and replay read the rest as another part.
        let e = part_len(u32::MAX as usize + 6).unwrap_err();
        assert_eq!(e.status(), axum::http::StatusCode::PAYLOAD_TOO_LARGE);
    }
}
