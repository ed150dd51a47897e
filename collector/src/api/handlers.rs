//! Route handlers: thin adapters from HTTP to the ingest path and the query engine.

use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use futures_util::StreamExt;
use rankwatch_analytics::{AlertState, RunId};
use rankwatch_api::{
    AlertFeed, Alerts, ByteSize, Catalog, Health, Heatmap, Override, ProbeSwitch, RetentionReport,
    RetentionRequest, RulesAnswer, Runs, SeriesAnswer, SetProbes, SqlAnswer, SqlRequest, Workers,
};
use serde::Deserialize;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;

use super::AppState;
use super::extract::Query;
use crate::decode::parse_table;
use crate::error::{Error, Result};
use crate::ingest::Format;
use crate::query::json;
use crate::query::views::{HeatmapQuery, SeriesQuery, WorkersQuery};
use crate::store::Event;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct IngestQuery {
    table: Option<String>,
}

/// The body's declared length, if any.
fn declared_length(headers: &HeaderMap) -> Option<usize> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
}

/// Reads a whole body of at most `limit` bytes, within the collector's body timeout.
pub(super) async fn read_body(
    state: &AppState,
    body: Body,
    headers: &HeaderMap,
    limit: usize,
) -> Result<Bytes> {
    if declared_length(headers).is_some_and(|n| n > limit) {
        return Err(Error::BodyTooLarge { limit });
    }
    within_body_timeout(state, async {
        axum::body::to_bytes(body, limit)
            .await
            .map_err(|_| Error::BodyTooLarge { limit })
    })
    .await
}

/// `read` (a body being read), cut off at `--body-timeout`.
async fn within_body_timeout<T>(
    state: &AppState,
    read: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let timeout = state.inner.admission.limits().body_timeout;
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or_else(|_| {
            Err(Error::Timeout(format!(
                "the request body did not arrive within {timeout:?} (--body-timeout)"
            )))
        })
}

/// How much of an ingest body of unknown length is charged to the in-flight budget at a time.
const CHARGE_STEP: usize = 64 << 10;

/// Reads an ingest body of unknown length (chunked), charging the in-flight budget in
/// [`CHARGE_STEP`]s as bytes arrive, so a stalled body holds what it sent, not the limit;
/// within `--body-timeout`, refused past `limit`.
async fn read_charging(
    state: &AppState,
    body: Body,
    limit: usize,
) -> Result<(Bytes, Vec<super::admission::Slot>)> {
    let admission = &state.inner.admission;
    within_body_timeout(state, async {
        let mut stream = body.into_data_stream();
        let mut buffer = bytes::BytesMut::new();
        let mut slots = Vec::new();
        let mut charged = 0usize;
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| Error::bad(format!("the request body broke off: {e}")))?;
            if buffer.len() + chunk.len() > limit {
                return Err(Error::BodyTooLarge { limit });
            }
            buffer.extend_from_slice(&chunk);
            while charged < buffer.len() {
                let step = CHARGE_STEP.min(limit - charged).max(1);
                slots.push(admission.body_bytes(step).await?);
                charged += step;
            }
        }
        Ok((buffer.freeze(), slots))
    })
    .await
}

/// Bodies of the small JSON endpoints (rules, probe switches, retention).
pub(super) const SMALL_BODY_LIMIT: usize = 2 << 20;

pub(super) async fn ingest(
    State(state): State<AppState>,
    Query(q): Query<IngestQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<crate::ingest::Ack>> {
    let ingestor = &state.inner.ingestor;
    // One wait for room in the hot buffer, before the body is read and before the commit
    // together: at most --queue-wait in all.
    let room_until = tokio::time::Instant::now() + state.inner.admission.limits().queue_wait;
    let result = async {
        ingestor.committer.wal.accepting()?;
        if !state.is_ready() {
            return Err(Error::Unavailable("the collector is shutting down".into()));
        }
        let format = Format::from_content_type(
            headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok()),
        )?;
        let table = parse_table(q.table.as_deref().unwrap_or("samples"))?;
        // Before the body: a batch of another release's wire protocol is not read at all.
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        rankwatch_api::check_peer(
            header(rankwatch_api::VERSION_HEADER),
            header(rankwatch_api::PROTOCOL_HEADER),
        )
        .map_err(Error::IncompatibleVersion)?;
        let limit = state.inner.max_body_bytes;
        let declared = declared_length(&headers);
        if declared.is_some_and(|n| n > limit) {
            return Err(Error::BodyTooLarge { limit });
        }
        // Before a byte is read: a collector over its memory budget waits (up to
        // --queue-wait) for the flush that takes its buffer, then says so, and bodies are
        // admitted only while there is room for them. A declared length is charged whole
        // before the body is read; a body of unknown length (chunked) as it arrives — charged
        // at the limit up front, four stalled ones held the whole budget.
        ingestor.committer.store.room_until(room_until).await?;
        let (body, mut room) = match declared {
            Some(length) => {
                let room = state.inner.admission.body_bytes(length).await?;
                (read_body(&state, body, &headers, limit).await?, vec![room])
            }
            None => read_charging(&state, body, limit).await?,
        };
        // The decoded batch is charged too, before a byte is decoded: a zstd body may decode
        // to a thousand times its size, and the budget counted only the compressed bytes
        // (32 bodies of 2 MiB asked for 64 GiB). Its framing says how much.
        if format == Format::Arrow {
            let decoded = crate::decode::preflight(&body, ingestor.limits.max_rows)?;
            if decoded > limit {
                return Err(Error::DecodesTooLarge { decoded, limit });
            }
            room.push(state.inner.admission.body_bytes(decoded).await?);
        }
        let key = match headers.get("idempotency-key") {
            Some(v) => Some(
                v.to_str()
                    .map_err(|_| Error::bad("Idempotency-Key is not visible ASCII"))?
                    .to_owned(),
            ),
            None => None,
        };
        Ok((body, format, table, key, room))
    }
    .await;
    // `_room` is held until the batch is committed: the body and its decoded rows live until then.
    let (body, format, table, key, _room) = match result {
        Ok(parts) => parts,
        Err(e) => {
            state.inner.requests.reject(&e);
            return Err(e);
        }
    };
    match ingestor
        .ingest(body, format, table, key.as_deref(), room_until)
        .await
    {
        Ok(ack) => Ok(Json(ack)),
        Err(e) => {
            state.inner.requests.reject(&e);
            Err(e)
        }
    }
}

pub(super) async fn runs(State(state): State<AppState>) -> Json<Runs> {
    Json(state.inner.queries.runs())
}

pub(super) async fn catalog(
    State(state): State<AppState>,
    Path(run): Path<String>,
) -> Result<Json<Catalog>> {
    Ok(Json(state.inner.queries.catalog(&run)?))
}

/// A large JSON answer (a series, a heatmap: megabytes of numbers), serialised into one
/// buffer that grows by reallocation. `axum::Json` writes token by token into a `BytesMut`
/// that copies itself as it grows: a fifth of a 64 × 1,000 heatmap's time went there.
pub(super) struct LargeJson<T>(pub T);

impl<T: serde::Serialize> IntoResponse for LargeJson<T> {
    fn into_response(self) -> Response {
        let mut body = Vec::with_capacity(64 * 1024);
        match serde_json::to_writer(&mut body, &self.0) {
            Ok(()) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
            // Our own answer failing to serialise is the server's fault, not the request's.
            Err(e) => Error::Io(std::io::Error::other(e)).into_response(),
        }
    }
}

pub(super) async fn series(
    State(state): State<AppState>,
    Path(run): Path<String>,
    Query(q): Query<SeriesQuery>,
) -> Result<LargeJson<SeriesAnswer>> {
    Ok(LargeJson(state.inner.queries.series(&run, q).await?))
}

pub(super) async fn heatmap(
    State(state): State<AppState>,
    Path(run): Path<String>,
    Query(q): Query<HeatmapQuery>,
) -> Result<LargeJson<Heatmap>> {
    Ok(LargeJson(state.inner.queries.heatmap(&run, q).await?))
}

pub(super) async fn workers(
    State(state): State<AppState>,
    Path(run): Path<String>,
    Query(q): Query<WorkersQuery>,
) -> Result<Json<Workers>> {
    Ok(Json(state.inner.queries.workers(&run, q).await?))
}

/// `GET /api/v1/runs/{run}/consistency[?from=&to=]`: the run's worker-level consistency.
pub(super) async fn consistency(
    State(state): State<AppState>,
    Path(run): Path<String>,
    Query(q): Query<crate::query::consistency::ConsistencyQuery>,
) -> Result<Json<rankwatch_api::ConsistencyReport>> {
    Ok(Json(state.inner.queries.consistency(&run, q).await?))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AlertsQuery {
    run: Option<String>,
    state: Option<String>,
}

pub(super) fn parse_state(s: &str) -> Result<AlertState> {
    s.parse()
        .map_err(|e: rankwatch_api::UnknownName| Error::bad(e.to_string()))
}

pub(super) async fn alerts(
    State(state): State<AppState>,
    Query(q): Query<AlertsQuery>,
) -> Result<Json<Alerts>> {
    let run = q.run.map(RunId::new).transpose()?;
    let wanted = q.state.as_deref().map(parse_state).transpose()?;
    let alerts: Vec<_> = state
        .inner
        .queries
        .store()
        .alerts(run.as_ref())
        .into_iter()
        .filter(|a| wanted.is_none_or(|s| a.state == s))
        .map(|a| (&a).into())
        .collect();
    Ok(Json(Alerts { alerts }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EventsQuery {
    run: Option<String>,
}

pub(super) async fn events(
    State(state): State<AppState>,
    Query(q): Query<EventsQuery>,
) -> Result<Sse<impl Stream<Item = std::result::Result<SseEvent, Infallible>>>> {
    let run = q.run.map(RunId::new).transpose()?.map(|r| r.to_string());
    let slot = state.inner.admission.event_stream()?;
    let receiver = state.inner.queries.store().subscribe();
    let mut closing = state.inner.closing.subscribe();
    let stream = BroadcastStream::new(receiver).filter_map(move |item| {
        let _alive = &slot;
        let event = match item {
            Ok(event) => {
                let matches = match (&run, event.run()) {
                    (Some(wanted), Some(about)) => wanted == about,
                    // Unfiltered, or not about one run: every subscriber gets it.
                    _ => true,
                };
                matches.then_some(event)
            }
            // A slow client missed events; it learns how many and can re-query.
            Err(BroadcastStreamRecvError::Lagged(missed)) => Some(Event::Lagged { missed }),
        };
        std::future::ready(event.map(|e| {
            Ok(SseEvent::default()
                .event(e.name())
                .data(serde_json::to_string(&e).unwrap_or_default()))
        }))
    });
    // Ends when the collector shuts down, so that shutdown does not wait on open dashboards.
    let stream = stream.take_until(async move {
        let _ = closing.wait_for(|closing| *closing).await;
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))))
}

pub(super) async fn sql(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<SqlAnswer>> {
    let _slot = state.inner.admission.sql()?;
    let bytes = read_body(&state, body, &headers, 1 << 20).await?;
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let sql = if is_json {
        serde_json::from_slice::<SqlRequest>(&bytes)?.sql
    } else {
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::bad("the SQL text is not UTF-8"))?
    };
    if sql.trim().is_empty() {
        return Err(Error::bad("empty SQL"));
    }
    let (batches, truncated) = state.inner.queries.sql(&sql).await?;
    let columns: Vec<String> = batches
        .first()
        .map(|b| {
            b.schema()
                .fields()
                .iter()
                .map(|f| f.name().clone())
                .collect()
        })
        .unwrap_or_default();
    Ok(Json(SqlAnswer {
        columns,
        rows: json::rows(&batches),
        truncated,
    }))
}

pub(super) async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.inner.exporter.render(),
    )
        .into_response()
}

fn health(status: &str, reason: Option<String>) -> Json<Health> {
    Json(Health {
        status: status.to_owned(),
        reason,
        version: rankwatch_api::VERSION.to_owned(),
        wire_protocol: rankwatch_api::WIRE_PROTOCOL,
    })
}

/// Liveness: fails while the write-ahead log does (a supervisor may restart the collector; it
/// also heals by itself when the disk does, see `wal`).
pub(super) async fn healthz(State(state): State<AppState>) -> Response {
    match state.inner.ingestor.committer.wal.failure() {
        None => health("ok", None).into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            health("failing", Some(reason)),
        )
            .into_response(),
    }
}

pub(super) async fn readyz(State(state): State<AppState>) -> Response {
    let failure = state.inner.ingestor.committer.wal.failure();
    if state.is_ready() {
        health("ready", None).into_response()
    } else {
        let reason = failure.unwrap_or_else(|| "shutting down".into());
        (
            StatusCode::SERVICE_UNAVAILABLE,
            health("not ready", Some(reason)),
        )
            .into_response()
    }
}

pub(super) async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], super::OPENAPI).into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RulesQuery {
    run: Option<String>,
}

/// The rules in force: the file's (or the defaults), or one run's with its override.
pub(super) async fn rules(
    State(state): State<AppState>,
    Query(q): Query<RulesQuery>,
) -> Result<Json<RulesAnswer>> {
    let book = &state.inner.alerting.rules;
    match q.run.map(RunId::new).transpose()? {
        None => Ok(Json(RulesAnswer {
            run: None,
            rules: to_json(book.base())?,
            overrides: Override::Absent,
        })),
        Some(run) => {
            let overrides = match book.override_of(&run) {
                Some(o) => Override::Set(to_json(o)?),
                None => Override::None,
            };
            Ok(Json(RulesAnswer {
                run: Some(run.to_string()),
                rules: to_json(book.for_run(&run))?,
                overrides,
            }))
        }
    }
}

/// Rules (the analytics crate's configuration) as the JSON the contract passes through.
fn to_json(value: impl serde::Serialize) -> Result<serde_json::Value> {
    serde_json::to_value(value).map_err(|e| Error::Unavailable(format!("rules as JSON: {e}")))
}

/// Sets a run's rule override (JSON, or TOML as application/toml); the run's detectors
/// restart under the new rules. A bad override is refused with 400 and changes nothing.
pub(super) async fn set_rules(
    State(state): State<AppState>,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<RulesAnswer>> {
    let run = RunId::new(run)?;
    let body = read_body(&state, body, &headers, SMALL_BODY_LIMIT).await?;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let partial = crate::alerting::rules::parse_override(&body, content_type)?;
    let alerting = &state.inner.alerting;
    let config = alerting.rules.set_override(&run, partial.clone())?;
    if let Some(engine) = &alerting.engine {
        engine.reset(run.clone()).await;
    }
    Ok(Json(RulesAnswer {
        run: Some(run.to_string()),
        rules: to_json(config)?,
        overrides: Override::Set(to_json(partial)?),
    }))
}

/// Drops a run's override: the file's rules apply again.
pub(super) async fn clear_rules(
    State(state): State<AppState>,
    Path(run): Path<String>,
) -> Result<Json<RulesAnswer>> {
    let run = RunId::new(run)?;
    let alerting = &state.inner.alerting;
    let config = alerting.rules.clear_override(&run)?;
    if let Some(engine) = &alerting.engine {
        engine.reset(run.clone()).await;
    }
    Ok(Json(RulesAnswer {
        run: Some(run.to_string()),
        rules: to_json(config)?,
        overrides: Override::None,
    }))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FeedQuery {
    after: Option<u64>,
}

/// The alert changes of one run after revision `after`, for the training process: `epoch`
/// changes when the collector restarts (revisions start again), `revision` is the cursor for
/// the next call.
pub(super) async fn alert_feed(
    State(state): State<AppState>,
    Path(run): Path<String>,
    Query(q): Query<FeedQuery>,
) -> Result<Json<AlertFeed>> {
    let run = RunId::new(run)?;
    let store = state.inner.queries.store();
    let (revision, changes) = store.alert_changes(&run, q.after.unwrap_or(0));
    Ok(Json(AlertFeed {
        epoch: store.epoch(),
        revision,
        alerts: changes.iter().map(Into::into).collect(),
    }))
}

/// A run's probe switch: `{"run", "on", "revision", "changed_ms"}`, with `on: null` and
/// `revision: 0` when nobody set it.
pub(super) async fn probes(
    State(state): State<AppState>,
    Path(run): Path<String>,
) -> Result<Json<ProbeSwitch>> {
    let run = RunId::new(run)?;
    Ok(Json(switch_body(&run, state.inner.switches.get(&run))))
}

fn switch_body(run: &RunId, switch: Option<crate::switches::Switch>) -> ProbeSwitch {
    ProbeSwitch {
        run: run.to_string(),
        on: switch.map(|s| s.on),
        revision: switch.map_or(0, |s| s.revision),
        changed_ms: switch.map(|s| s.changed_ms),
    }
}

/// Sets a run's probes on or off (`{"on": true}`); its agents act within a few steps.
pub(super) async fn set_probes(
    State(state): State<AppState>,
    Path(run): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<ProbeSwitch>> {
    let run = RunId::new(run)?;
    let body = read_body(&state, body, &headers, SMALL_BODY_LIMIT).await?;
    super::browser::require_json(&headers, &body)?;
    let wish: SetProbes = serde_json::from_slice(&body).map_err(|e| {
        crate::error::Error::bad(format!(
            "probe switch: expected {{\"on\": true|false}}: {e}"
        ))
    })?;
    let switch = state
        .inner
        .switches
        .set(&run, wish.on, state.inner.queries.store().now_ms())?;
    Ok(Json(switch_body(&run, Some(switch))))
}

/// Deletes a run: its data, metadata, alerts and rule override.
pub(super) async fn delete_run(
    State(state): State<AppState>,
    Path(run): Path<String>,
) -> Result<Json<rankwatch_api::Deleted>> {
    let run = RunId::new(run)?;
    let deleted = state.inner.housekeeper.delete_run(&run).await?;
    // The run's rule override and probe switch go with it (none is fine).
    let _ = state.inner.alerting.rules.clear_override(&run);
    let _ = state.inner.switches.remove(&run);
    if let Err(e) = state.inner.alerting.actions.forget_run(&run) {
        tracing::warn!(%run, error = %e, "the deleted run's acknowledgements could not be dropped");
    }
    Ok(Json(deleted))
}

/// Applies a retention policy now: the one in the body, else the collector's own.
pub(super) async fn retention(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<RetentionReport>> {
    let body = read_body(&state, body, &headers, SMALL_BODY_LIMIT).await?;
    super::browser::require_json(&headers, &body)?;
    let request: RetentionRequest = if body.is_empty() {
        RetentionRequest::default()
    } else {
        serde_json::from_slice(&body)?
    };
    let mut policy = state.inner.retention;
    if request.max_age.is_some() || request.max_bytes.is_some() {
        policy.max_age = request
            .max_age
            .as_deref()
            .map(crate::config::parse_duration)
            .transpose()
            .map_err(|e| Error::bad(format!("max_age: {e}")))?;
        policy.max_bytes = match &request.max_bytes {
            None => None,
            Some(ByteSize::Bytes(n)) => Some(*n),
            Some(ByteSize::Text(s)) => Some(
                crate::config::parse_bytes(s).map_err(|e| Error::bad(format!("max_bytes: {e}")))?,
            ),
        };
    }
    if !policy.is_set() {
        return Err(Error::bad(
            "no retention policy: send max_age and/or max_bytes, or start the collector with \
             --retention-age / --retention-max-bytes",
        ));
    }
    Ok(Json(
        state
            .inner
            .housekeeper
            .retain(&policy, request.dry_run)
            .await?
            .into(),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ExportQuery {
    format: Option<String>,
    table: Option<String>,
}

/// Streams a run's samples (or sketches) as Parquet or CSV.
pub(super) async fn export(
    State(state): State<AppState>,
    Path(run): Path<String>,
    Query(q): Query<ExportQuery>,
) -> Result<Response> {
    let run = state.inner.queries.known_run(&run)?;
    let format = crate::export::Format::parse(q.format.as_deref().unwrap_or("parquet"))?;
    let table = match q.table.as_deref().unwrap_or("samples") {
        "samples" => crate::entry::Table::Samples,
        "sketches" => crate::entry::Table::Sketches,
        other => {
            return Err(Error::bad(format!(
                "unknown table {other:?}; expected samples or sketches"
            )));
        }
    };
    let slot = state.inner.admission.export()?;
    let stall = state.inner.admission.limits().body_timeout;
    let store = state.inner.queries.store().clone();
    let snapshot = crate::export::Snapshot::open(
        run.clone(),
        table,
        store.view(table, &run),
        store.backend(),
    )?;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let errors = tx.clone();
    let name = format!("{}.{}.{}", run, table.as_str(), format.extension());
    tokio::task::spawn_blocking(move || {
        // The slot is the thread's: it frees when the export ends, however it ends.
        let _slot = slot;
        let written = snapshot.write(format, crate::export::ChannelWriter::new(tx, stall));
        if let Err(e) = written {
            tracing::warn!(error = %e, "export cut short");
            // Ends the body with an error: the client sees a failed transfer, not a short file.
            let _ = errors.blocking_send(Err(std::io::Error::other(e.to_string())));
        }
    });
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Ok((
        [
            (header::CONTENT_TYPE, format.content_type().to_owned()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{}\"", name.replace('"', "_")),
            ),
        ],
        body,
    )
        .into_response())
}
