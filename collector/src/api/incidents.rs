//! Incidents, acknowledgements and silences over HTTP (`rankwatch_api::incidents` has the
//! shapes, `alerting::actions` the rules). Incidents are grouped from the store's alerts on
//! each request ([`crate::alerting::incidents`]).

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use rankwatch_analytics::{AlertState, RunId};
use rankwatch_api::{AckRequest, Incident, Incidents, NewSilence, Silence, Silences};
use serde::Deserialize;

use super::AppState;
use super::extract::Query;
use super::handlers::{SMALL_BODY_LIMIT, parse_state, read_body};
use crate::alerting::incidents;
use crate::error::{Error, Result};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct IncidentsQuery {
    run: Option<String>,
    state: Option<String>,
}

/// A run's (or every run's) incidents, with what people did about them.
fn incidents_of(state: &AppState, run: Option<&RunId>) -> Vec<Incident> {
    let store = state.inner.queries.store();
    incidents::with_actions(incidents::of(store, run), &state.inner.alerting.actions)
}

/// `GET /api/v1/incidents?run=&state=`: most urgent first.
pub(super) async fn incidents(
    State(state): State<AppState>,
    Query(q): Query<IncidentsQuery>,
) -> Result<Json<Incidents>> {
    let run = q.run.map(RunId::new).transpose()?;
    let wanted = q.state.as_deref().map(parse_state).transpose()?;
    let incidents = incidents_of(&state, run.as_ref())
        .into_iter()
        .filter(|i| wanted.is_none_or(|s| i.state == s))
        .collect();
    Ok(Json(Incidents { incidents }))
}

/// The incident `id`, or a 404 that says what ids look like.
fn find(state: &AppState, id: &str) -> Result<Incident> {
    // The id names its run after the prefix; grouping that run alone is enough, but a run id
    // may hold ':' so every run is grouped rather than parsing it back out.
    incidents_of(state, None)
        .into_iter()
        .find(|i| i.id == id)
        .ok_or_else(|| {
            Error::Missing(format!(
                "no incident {id:?}; ids come from GET /api/v1/incidents (an incident whose alerts were all pending and cleared is gone)"
            ))
        })
}

/// `POST /api/v1/incidents/{id}/ack`: acknowledges the incident's alerts as they are now.
pub(super) async fn acknowledge(
    State(state): State<AppState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Incident>> {
    let body = read_body(&state, body, &headers, SMALL_BODY_LIMIT).await?;
    super::browser::require_json(&headers, &body)?;
    let request: AckRequest = serde_json::from_slice(&body)?;
    let found = find(&state, &id)?;
    if found.state == AlertState::Resolved {
        return Err(Error::bad(format!(
            "incident {id:?} is resolved; there is nothing left to acknowledge"
        )));
    }
    let actions = &state.inner.alerting.actions;
    let mut found = found;
    found.acknowledged = Some(actions.acknowledge(&found.alerts, request)?);
    Ok(Json(found))
}

/// `DELETE /api/v1/incidents/{id}/ack`: takes the acknowledgement back.
pub(super) async fn unacknowledge(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Incident>> {
    let mut found = find(&state, &id)?;
    state.inner.alerting.actions.unacknowledge(&found.alerts)?;
    found.acknowledged = None;
    Ok(Json(found))
}

/// `GET /api/v1/silences`: active first, then those ended within a week.
pub(super) async fn silences(State(state): State<AppState>) -> Json<Silences> {
    Json(Silences {
        silences: state.inner.alerting.actions.silences(),
    })
}

/// `POST /api/v1/silences`.
pub(super) async fn create_silence(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<Silence>)> {
    let body = read_body(&state, body, &headers, SMALL_BODY_LIMIT).await?;
    super::browser::require_json(&headers, &body)?;
    let request: NewSilence = serde_json::from_slice(&body)?;
    let silence = state.inner.alerting.actions.silence(request)?;
    Ok((StatusCode::CREATED, Json(silence)))
}

/// `DELETE /api/v1/silences/{id}`: ends it now; held-back alerts are told within a second.
pub(super) async fn expire_silence(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Silence>> {
    Ok(Json(state.inner.alerting.actions.expire(&id)?))
}
