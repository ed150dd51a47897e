//! The crate's one error type. Messages are lowercase and name the offending value, so the
//! collector can return them verbatim in a 4xx body.

/// Everything that can be wrong with domain data handed to this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A run id that is empty, too long, or could escape a directory.
    #[error("invalid run id {}: {reason}", rankwatch_api::quoted(.id))]
    InvalidRunId { id: String, reason: String },

    /// A metric name outside the allowed charset or length.
    #[error("invalid metric name {}: {reason}", rankwatch_api::quoted(.name))]
    InvalidMetricName { name: String, reason: String },

    /// A name outside one of the contract's vocabularies (a site, a sketch kind, a rule...).
    #[error(transparent)]
    UnknownName(#[from] rankwatch_api::UnknownName),

    /// A sample whose metric, rank, layer and site do not fit together.
    #[error("invalid sample for metric {metric}: {reason}")]
    InvalidSample { metric: String, reason: String },

    /// Run metadata that contradicts itself.
    #[error("invalid run info for {run}: {reason}")]
    InvalidRunInfo { run: String, reason: String },

    /// A record batch whose columns are not the table's schema.
    #[error("table {table}: {reason}")]
    Schema { table: &'static str, reason: String },

    /// A record batch whose values break the table's rules, with the row that does.
    #[error("table {table}, row {row}: {source}")]
    Row {
        table: &'static str,
        row: usize,
        #[source]
        source: Box<Error>,
    },

    /// Operands whose shapes do not fit (matrix products, sketches of different sizes, ...).
    #[error("dimension mismatch: {0}")]
    Dimension(String),

    /// A configuration value outside its domain.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// An error from arrow-rs while building a batch.
    #[error("arrow: {0}")]
    Arrow(#[from] arrow_schema::ArrowError),
}

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
