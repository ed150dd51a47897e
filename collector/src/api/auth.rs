//! Bearer-token checks: one token for ingest, one for reads, one for deleting data. Comparison takes the same
//! time whatever the mismatch, so a token cannot be guessed byte by byte from response times.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::AppState;
use crate::error::Error;

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn check(expected: Option<&str>, request: &Request) -> Result<(), Error> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .ok_or(Error::Unauthorized("missing bearer token"))?;
    if constant_time_eq(given.trim().as_bytes(), expected.as_bytes()) {
        Ok(())
    } else {
        Err(Error::Unauthorized("wrong bearer token"))
    }
}

fn guard(expected: Option<&str>, state: &AppState, request: &Request) -> Option<Response> {
    check(expected, request).err().map(|e| {
        state.inner.requests.reject(&e);
        e.into_response()
    })
}

/// Requires the ingest token, when one is configured.
pub(super) async fn ingest(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    match guard(state.inner.ingest_token.as_deref(), &state, &request) {
        Some(refusal) => refusal,
        None => next.run(request).await,
    }
}

/// Requires the read token, when one is configured.
pub(super) async fn read(State(state): State<AppState>, request: Request, next: Next) -> Response {
    match guard(state.inner.read_token.as_deref(), &state, &request) {
        Some(refusal) => refusal,
        None => next.run(request).await,
    }
}

/// Requires the admin token; without one, the ingest token (whoever may write may delete).
pub(super) async fn admin(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let expected = state
        .inner
        .admin_token
        .as_deref()
        .or(state.inner.ingest_token.as_deref());
    match guard(expected, &state, &request) {
        Some(refusal) => refusal,
        None => next.run(request).await,
    }
}
