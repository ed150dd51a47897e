//! The collector's HTTP contract, as types: every request and response body of `/api/v1`,
//! every server-sent event of `/api/v1/events`, and the error body, with the one convention
//! for non-finite floats ([`Num`]).
//!
//! The collector serialises its answers from these types; the dashboard (wasm), the agent's
//! alert feed and the `rankwatch` command line deserialise into them. A field renamed or
//! retyped here is therefore a compile error on every side at once, instead of a dashboard
//! that silently shows nothing. The crate holds data only — serde, no I/O, no Arrow — so it
//! builds for `wasm32-unknown-unknown` at a few kilobytes. `collector/openapi.json` documents
//! the same shapes for other clients: its component schemas are generated from these types
//! (feature `openapi`, `openapi::schemas`) and a collector test holds the file to them, so
//! the document cannot drift either.
//!
//! Vocabulary that is part of the contract lives here too ([`Rule`], [`Severity`],
//! [`AlertState`], [`ErrorReason`], [`Site`], [`SketchKind`], the [`ModelLayout`] a run's info
//! carries); the analytics crate re-exports it rather than keeping a second copy.

mod alerts;
mod consistency;
mod error;
mod events;
mod incidents;
mod ingest;
mod layout;
mod num;
#[cfg(feature = "openapi")]
pub mod openapi;
mod ops;
mod runs;
mod series;
mod version;
mod vocab;
mod workers;

pub use alerts::{Alert, AlertFeed, Alerts};
pub use consistency::{ConsistencyReport, ConsistencyVerdict, DispersionIndicator, RankStanding};
pub use error::{ErrorBody, ErrorReason};
pub use events::Event;
pub use incidents::{
    AckRequest, Acknowledgement, Incident, Incidents, Matchers, NewSilence, Silence, Silences,
};
pub use ingest::{IngestBody, IngestInfo, IngestSample, IngestSketch};
pub use layout::{AttentionShape, LayerLayout, ModelLayout, Site, SketchKind};
pub use num::{Num, non_finite};
pub use ops::{
    Ack, AckStatus, ByteSize, Deleted, Doomed, Health, Override, ProbeSwitch, RetentionReason,
    RetentionReport, RetentionRequest, RulesAnswer, SetProbes, SqlAnswer, SqlRequest, Tags,
};
pub use runs::{Catalog, CatalogMetric, MetricScope, RunSummary, Runs};
pub use series::{Bucket, BucketRange, Heatmap, Series, SeriesAnswer};
pub use version::{
    PROTOCOL_HEADER, VERSION, VERSION_HEADER, VERSION_TAG, WIRE_PROTOCOL, check_peer,
};
pub use vocab::{AlertState, Rule, Severity, UnknownName, quoted};
pub use workers::{Cosine, CosineMatrix, WorkerMetric, Workers};
