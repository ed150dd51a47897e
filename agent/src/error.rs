//! The agent's one error type.

/// Everything the agent can refuse or fail at. Delivery failures are not errors: they are
/// retried, spooled or counted (see [`crate::StatsSnapshot`]); only misuse and local I/O surface here.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is unusable.
    #[error("invalid agent configuration: {0}")]
    Config(String),
    /// A logged value does not fit the metric vocabulary or the run.
    #[error("invalid sample: {0}")]
    InvalidSample(String),
    /// The agent was shut down; nothing more is accepted.
    #[error("the agent is shut down")]
    Closed,
    /// The spool directory could not be used.
    #[error("spool {path}: {source}")]
    Spool {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Arrow encoding failed (a bug, reported rather than panicking).
    #[error("encoding a batch failed: {0}")]
    Encode(String),
    /// The shared domain crate refused a value.
    #[error(transparent)]
    Analytics(#[from] rankwatch_analytics::Error),
}

impl Error {
    pub(crate) fn spool(path: &std::path::Path, source: std::io::Error) -> Error {
        Error::Spool {
            path: path.display().to_string(),
            source,
        }
    }
}

/// The agent's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
