//! The body of every error answer: what went wrong in words, and a stable reason code.

use serde::{Deserialize, Serialize};

/// `{"error": "...", "reason": "..."}`, the body of every non-2xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[cfg_attr(feature = "openapi", schemars(rename = "Error"))]
pub struct ErrorBody {
    /// What went wrong, for a person.
    pub error: String,
    /// Why, for a program (and the `reason` label of the collector's reject counter).
    pub reason: ErrorReason,
}

/// The stable reason codes of [`ErrorBody`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(schemars::JsonSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorReason {
    BadRequest,
    InvalidData,
    MalformedArrow,
    MalformedJson,
    BodyTooLarge,
    TooManyRows,
    Cardinality,
    MediaType,
    Unauthorized,
    /// The request is authenticated (or needs no token) but is not allowed: a foreign browser
    /// origin, an unknown `Host`, or deletion on a collector that has no admin token.
    Forbidden,
    /// The sender speaks another wire protocol (another rankwatch release); the message names
    /// both versions.
    IncompatibleVersion,
    UnknownRun,
    NotFound,
    InFlight,
    Backpressure,
    /// Every slot of a bounded resource is taken (requests, in-flight bytes, event streams,
    /// exports, SQL queries); retry after `Retry-After`.
    Busy,
    /// The request (its body) did not arrive in time.
    Timeout,
    Sql,
    Unavailable,
    /// The dataset's storage (disk or object store) failed.
    Storage,
    /// An upstream the collector called (an object store) failed.
    Remote,
    Internal,
}

impl ErrorReason {
    /// Every code, in declaration order.
    pub const ALL: [ErrorReason; 22] = [
        ErrorReason::BadRequest,
        ErrorReason::InvalidData,
        ErrorReason::MalformedArrow,
        ErrorReason::MalformedJson,
        ErrorReason::BodyTooLarge,
        ErrorReason::TooManyRows,
        ErrorReason::Cardinality,
        ErrorReason::MediaType,
        ErrorReason::Unauthorized,
        ErrorReason::Forbidden,
        ErrorReason::IncompatibleVersion,
        ErrorReason::UnknownRun,
        ErrorReason::NotFound,
        ErrorReason::InFlight,
        ErrorReason::Backpressure,
        ErrorReason::Busy,
        ErrorReason::Timeout,
        ErrorReason::Sql,
        ErrorReason::Unavailable,
        ErrorReason::Storage,
        ErrorReason::Remote,
        ErrorReason::Internal,
    ];

    /// The wire name, as in the JSON body.
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorReason::BadRequest => "bad_request",
            ErrorReason::InvalidData => "invalid_data",
            ErrorReason::MalformedArrow => "malformed_arrow",
            ErrorReason::MalformedJson => "malformed_json",
            ErrorReason::BodyTooLarge => "body_too_large",
            ErrorReason::TooManyRows => "too_many_rows",
            ErrorReason::Cardinality => "cardinality",
            ErrorReason::MediaType => "media_type",
            ErrorReason::Unauthorized => "unauthorized",
            ErrorReason::Forbidden => "forbidden",
            ErrorReason::IncompatibleVersion => "incompatible_version",
            ErrorReason::UnknownRun => "unknown_run",
            ErrorReason::NotFound => "not_found",
            ErrorReason::InFlight => "in_flight",
            ErrorReason::Backpressure => "backpressure",
            ErrorReason::Busy => "busy",
            ErrorReason::Timeout => "timeout",
            ErrorReason::Sql => "sql",
            ErrorReason::Unavailable => "unavailable",
            ErrorReason::Storage => "storage",
            ErrorReason::Remote => "remote",
            ErrorReason::Internal => "internal",
        }
    }
}
