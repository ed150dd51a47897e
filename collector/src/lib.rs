//! The rankwatch collector: the daemon every training agent streams to and the dashboard
//! reads from.
//!
//! A batch travels: HTTP body ([`api`]) → decoded and checked ([`decode`]) into an [`entry`]
//! → committed ([`commit`]: admitted against the memory budget, cardinality and idempotency
//! keys of the [`store`] and [`idempotency`], appended to the write-ahead log with group commit
//! ([`wal`]), applied to the queryable hot buffer) → flushed to sorted, zstd Parquet in a Hive
//! layout and compacted ([`store`]). Reads go through DataFusion over the Parquet files and the
//! hot buffer ([`query`]). Every acknowledged batch also feeds the alert engine
//! ([`alerting`]) through its own channel: the step aligner's all-ranks statistics and the
//! detectors run on the live stream, and alerts go to the store, SSE, webhooks, Slack,
//! Alertmanager and the training process. Each component counts its own work; [`telemetry`]
//! gathers the counters and bounded per-run aggregates for Prometheus. Time is read through
//! one [`clock`]. [`server`] builds the components in dependency order and ties start-up
//! (recovery first), background work and graceful shutdown together; [`http`] serves the API
//! with bounded time and connections, and `api`'s admission bounds what runs at once.
//!
//! The modules are layered: each imports only from lower layers, so there is no import cycle
//! (`cargo xtask check` enforces it; the table is in `xtask/src/layers.rs`).

pub mod alerting;
pub mod api;
pub mod client;
pub mod clock;
pub mod commit;
pub mod config;
pub mod decode;
pub mod dirlock;
pub mod disk;
pub mod entry;
pub mod error;
pub mod export;
pub mod fsutil;
pub mod http;
pub mod idempotency;
pub mod ingest;
pub mod instrument;
pub mod query;
pub mod retention;
pub mod server;
pub mod store;
pub mod summary;
pub mod switches;
pub mod telemetry;
pub mod tokens;
pub mod wal;

pub use api::{AppState, app};
pub use config::{Cli, Command, ServeConfig};
pub use error::{Error, Result};
pub use server::{Collector, serve};
