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

/// Whether `request` carries one of the collector's tokens (any group): then it is not a web
/// page's doing, since browsers never attach a bearer token across sites.
pub(super) fn bears_a_token(state: &AppState, request: &Request) -> bool {
    let inner = &state.inner;
    [&inner.ingest_token, &inner.read_token, &inner.admin_token]
        .into_iter()
        .flatten()
        .any(|token| check(Some(token.as_str()), request).is_ok())
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

/// Requires the admin token. A collector with other tokens but no admin token refuses
/// deletion outright: the ingest token is on every training node, and whoever can write
/// metrics must not thereby be able to erase runs. With no token at all, deletion is as open
/// as the rest (loopback, guarded by [`super::browser`]).
pub(super) async fn admin(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let inner = &state.inner;
    let refusal = match (&inner.admin_token, &inner.ingest_token, &inner.read_token) {
        (Some(admin), _, _) => guard(Some(admin), &state, &request),
        (None, None, None) => None,
        (None, _, _) => {
            let e = Error::Forbidden(
                "deleting data needs the admin token, and this collector has none: start it with \
                 --admin-token (the ingest token every training job holds does not grant it)"
                    .into(),
            );
            inner.requests.reject(&e);
            Some(e.into_response())
        }
    };
    match refusal {
        Some(refusal) => refusal,
        None => next.run(request).await,
    }
}
