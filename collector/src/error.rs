//! The collector's one error type, and its mapping to HTTP status codes in one place.
//!
//! Client mistakes (malformed bodies, unknown metrics, hostile run ids) become 4xx responses
//! whose JSON body carries the lowercase message that names the problem. Server faults become
//! 5xx and are logged; their message is still returned, because an operator reading an agent's
//! log should see why a batch was refused.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use rankwatch_api::ErrorReason;

/// Everything that can go wrong in the collector.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A request that is malformed or breaks a rule of the data model.
    #[error("{0}")]
    BadRequest(String),

    /// Domain data that the analytics crate refused (bad run id, unknown site, bad scope...).
    #[error(transparent)]
    Domain(#[from] rankwatch_analytics::Error),

    /// An Arrow IPC body that could not be decoded.
    #[error("malformed arrow ipc stream: {0}")]
    Arrow(#[source] arrow_schema::ArrowError),

    /// A JSON body that could not be parsed.
    #[error("malformed json body: {0}")]
    Json(#[from] serde_json::Error),

    /// A body over the configured size limit.
    #[error("request body exceeds the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },

    /// A compressed body whose buffers decode to more than a body may hold: refused before a
    /// byte is decoded (the in-flight budget would otherwise count the compressed size only).
    #[error(
        "the body's buffers decode to {decoded} bytes, over the limit of {limit} bytes a body may hold (--max-body-bytes); send smaller batches"
    )]
    DecodesTooLarge { decoded: usize, limit: usize },

    /// A batch over the configured row limit.
    #[error("batch of {rows} rows exceeds the limit of {limit} rows")]
    TooManyRows { rows: usize, limit: usize },

    /// A run that would exceed a cardinality limit (series, metrics).
    #[error("{0}")]
    Cardinality(String),

    /// A content type the endpoint does not speak.
    #[error(
        "unsupported content type {0:?}; send application/vnd.apache.arrow.stream or application/json"
    )]
    UnsupportedMediaType(String),

    /// Missing or wrong bearer token.
    #[error("{0}")]
    Unauthorized(&'static str),

    /// Not allowed whatever the token: a foreign browser origin, an unknown `Host` (DNS
    /// rebinding), deletion on a collector without an admin token.
    #[error("{0}")]
    Forbidden(String),

    /// No such route.
    #[error("no such endpoint; see /api/v1/openapi.json")]
    NotFound,

    /// A route whose object does not exist (an incident, a silence); the message names it.
    #[error("{0}")]
    Missing(String),

    /// An agent of another rankwatch release, speaking another wire protocol.
    #[error("{0}")]
    IncompatibleVersion(String),

    /// A run the collector has never seen.
    #[error("unknown run {0:?}")]
    UnknownRun(String),

    /// The same idempotency key is being written by another request right now.
    #[error("a batch with idempotency key {0:?} is being written; retry")]
    InFlight(String),

    /// The hot buffer is over its memory budget; the client should retry later.
    #[error(
        "the collector is over its memory budget ({bytes} bytes buffered); retry after {retry_after_s} s"
    )]
    Backpressure { bytes: usize, retry_after_s: u64 },

    /// Every slot of a bounded resource is taken (requests, in-flight bytes, event streams,
    /// exports, SQL queries); the message names the flag that sets it.
    #[error("busy: {0}; retry shortly")]
    Busy(String),

    /// The client did not send its request in time.
    #[error("timeout: {0}")]
    Timeout(String),

    /// A read-only SQL endpoint asked to write, or a query that failed to plan or run.
    #[error("sql: {0}")]
    Sql(String),

    /// The collector is shutting down or its write-ahead log has failed.
    #[error("unavailable: {0}")]
    Unavailable(String),

    /// File-system trouble.
    #[error("io: {0}")]
    Io(#[from] std::io::Error),

    /// Parquet encoding or decoding trouble.
    #[error("parquet: {0}")]
    Parquet(#[from] parquet::errors::ParquetError),

    /// A query-engine failure on stored data.
    #[error("query: {0}")]
    Query(#[from] datafusion::error::DataFusionError),

    #[error("object storage: {0}")]
    Storage(#[from] object_store::Error),

    /// A stored file that does not parse (manifest, key snapshot).
    #[error("corrupt {what}: {reason}")]
    Corrupt { what: String, reason: String },

    /// The command-line client's call to a collector failed (unreachable, or refused with
    /// the collector's own message).
    #[error("{0}")]
    Remote(String),
}

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A stored file at `path` that does not read as it must.
    pub(crate) fn corrupt(path: &std::path::Path, reason: impl Into<String>) -> Error {
        Error::Corrupt {
            what: path.display().to_string(),
            reason: reason.into(),
        }
    }

    /// The HTTP status this error maps to.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::BadRequest(_)
            | Error::Domain(_)
            | Error::Arrow(_)
            | Error::Json(_)
            | Error::Sql(_)
            | Error::IncompatibleVersion(_) => StatusCode::BAD_REQUEST,
            Error::BodyTooLarge { .. }
            | Error::DecodesTooLarge { .. }
            | Error::TooManyRows { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Error::Cardinality(_) => StatusCode::UNPROCESSABLE_ENTITY,
            Error::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Error::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Error::Forbidden(_) => StatusCode::FORBIDDEN,
            Error::UnknownRun(_) | Error::NotFound | Error::Missing(_) => StatusCode::NOT_FOUND,
            Error::InFlight(_) => StatusCode::CONFLICT,
            Error::Backpressure { .. } | Error::Busy(_) => StatusCode::TOO_MANY_REQUESTS,
            Error::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            Error::Unavailable(_) | Error::Storage(_) => StatusCode::SERVICE_UNAVAILABLE,
            Error::Remote(_) => StatusCode::BAD_GATEWAY,
            Error::Io(_) | Error::Parquet(_) | Error::Query(_) | Error::Corrupt { .. } => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    /// The stable reason code of the error body (and the `rejects` counter's label).
    pub fn reason(&self) -> ErrorReason {
        match self {
            Error::BadRequest(_) => ErrorReason::BadRequest,
            Error::Domain(_) => ErrorReason::InvalidData,
            Error::Arrow(_) => ErrorReason::MalformedArrow,
            Error::Json(_) => ErrorReason::MalformedJson,
            Error::BodyTooLarge { .. } | Error::DecodesTooLarge { .. } => ErrorReason::BodyTooLarge,
            Error::TooManyRows { .. } => ErrorReason::TooManyRows,
            Error::Cardinality(_) => ErrorReason::Cardinality,
            Error::UnsupportedMediaType(_) => ErrorReason::MediaType,
            Error::Unauthorized(_) => ErrorReason::Unauthorized,
            Error::Forbidden(_) => ErrorReason::Forbidden,
            Error::IncompatibleVersion(_) => ErrorReason::IncompatibleVersion,
            Error::UnknownRun(_) => ErrorReason::UnknownRun,
            Error::NotFound | Error::Missing(_) => ErrorReason::NotFound,
            Error::InFlight(_) => ErrorReason::InFlight,
            Error::Backpressure { .. } => ErrorReason::Backpressure,
            Error::Busy(_) => ErrorReason::Busy,
            Error::Timeout(_) => ErrorReason::Timeout,
            Error::Sql(_) => ErrorReason::Sql,
            Error::Unavailable(_) => ErrorReason::Unavailable,
            Error::Storage(_) => ErrorReason::Storage,
            Error::Remote(_) => ErrorReason::Remote,
            Error::Io(_) | Error::Parquet(_) | Error::Query(_) | Error::Corrupt { .. } => {
                ErrorReason::Internal
            }
        }
    }

    /// Shorthand for a [`Error::BadRequest`].
    pub fn bad(message: impl Into<String>) -> Self {
        Error::BadRequest(message.into())
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(error = %self, "request failed");
        }
        let body = rankwatch_api::ErrorBody {
            error: self.to_string(),
            reason: self.reason(),
        };
        let mut response = (status, axum::Json(body)).into_response();
        let headers = response.headers_mut();
        match self {
            Error::Backpressure { retry_after_s, .. } => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
            }
            Error::Busy(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(1u64));
            }
            // The rest of the body may still be on its way: this connection cannot be reused.
            Error::Timeout(_) => {
                headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            // Shutting down or a failed log: a client retries (with its idempotency key) soon.
            Error::Unavailable(_) => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(5u64));
            }
            _ => {}
        }
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
