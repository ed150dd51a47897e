//! The HTTP API. [`app`] builds the whole router from an [`AppState`], so tests can drive it
//! without a socket; the server binds it to a listener.
//!
//! Routes are in four groups: ingest (guarded by the ingest token), deletion and retention
//! (the admin token; refused when other tokens are set but no admin token), reads and
//! `/metrics` (the read token), and the always-open probes and OpenAPI document. Over all of
//! them, [`browser`] refuses what a web page could make a browser send. Every error
//! is a JSON body `{"error": "...", "reason": "..."}` with a 4xx or 5xx status (see
//! [`crate::error`]).

mod admission;
mod auth;
pub mod browser;
mod extract;
mod handlers;
mod incidents;
pub(crate) mod ui;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};

pub use admission::AdmissionLimits;

use crate::ingest::Ingestor;
use crate::query::Queries;
use crate::telemetry::{Exporter, RequestMetrics};

/// The OpenAPI document of this API.
pub const OPENAPI: &str = include_str!("../../openapi.json");

/// What every handler shares.
#[derive(Debug, Clone)]
pub struct AppState {
    pub(crate) inner: Arc<Shared>,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) ingestor: Ingestor,
    pub(crate) queries: Queries,
    pub(crate) requests: Arc<RequestMetrics>,
    pub(crate) exporter: Exporter,
    pub(crate) ingest_token: Option<String>,
    pub(crate) read_token: Option<String>,
    /// Deletion and retention; when unset, they are open only if no token is set at all.
    pub(crate) admin_token: Option<String>,
    pub(crate) max_body_bytes: usize,
    pub(crate) alerting: Alerting,
    pub(crate) housekeeper: crate::retention::Housekeeper,
    /// The collector's configured retention policy (`POST /api/v1/retention` without a body).
    pub(crate) retention: crate::retention::Policy,
    /// Per-run wishes for dormant agents: probes on or off.
    pub(crate) switches: Arc<crate::switches::ProbeSwitches>,
    /// The hosts and origins browsers' requests may name.
    pub(crate) browser: browser::BrowserPolicy,
    /// What the API takes on at once.
    pub(crate) admission: admission::Admission,
    /// Set when the collector starts shutting down: `/readyz` answers 503, ingest refuses new
    /// batches and open event streams end.
    pub(crate) closing: tokio::sync::watch::Sender<bool>,
}

/// The tokens guarding the API; `None` leaves that group open.
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    pub ingest: Option<String>,
    pub read: Option<String>,
    /// Deletion and retention; when unset while another token is set, they are refused.
    pub admin: Option<String>,
}

/// The alert engine's parts the API reaches: the rule book (per-run overrides) and the engine
/// (to restart a run's detectors under new rules).
#[derive(Debug, Clone)]
pub struct Alerting {
    pub rules: Arc<crate::alerting::rules::RuleBook>,
    /// `None` with `--no-alert-engine`.
    pub engine: Option<crate::alerting::EngineHandle>,
    /// Acknowledgements and silences (kept with or without the engine).
    pub actions: Arc<crate::alerting::actions::AlertActions>,
}

impl AppState {
    /// The read side (tests compare its answers with and without rollups).
    pub fn queries(&self) -> &Queries {
        &self.inner.queries
    }

    /// Shared state from its parts.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        ingestor: Ingestor,
        queries: Queries,
        requests: Arc<RequestMetrics>,
        exporter: Exporter,
        tokens: Tokens,
        max_body_bytes: usize,
        alerting: Alerting,
        retention: crate::retention::Policy,
        switches: Arc<crate::switches::ProbeSwitches>,
        browser: browser::BrowserPolicy,
        admission: AdmissionLimits,
    ) -> Self {
        let housekeeper =
            crate::retention::Housekeeper::new(queries.store().clone(), alerting.engine.clone());
        let admission =
            admission::Admission::new(admission, &requests.admission, &requests.sse_clients);
        AppState {
            inner: Arc::new(Shared {
                ingestor,
                queries,
                requests,
                exporter,
                ingest_token: tokens.ingest,
                read_token: tokens.read,
                admin_token: tokens.admin,
                max_body_bytes,
                alerting,
                housekeeper,
                retention,
                switches,
                browser,
                admission,
                closing: tokio::sync::watch::Sender::new(false),
            }),
        }
    }

    /// Marks the collector as not ready (shutting down): `/readyz` answers 503 and ingest
    /// refuses new batches.
    pub fn set_ready(&self, ready: bool) {
        self.inner.closing.send_replace(!ready);
    }

    pub(crate) fn is_ready(&self) -> bool {
        !*self.inner.closing.borrow() && !self.inner.ingestor.committer.wal.is_failed()
    }
}

/// The whole API.
pub fn app(state: AppState) -> Router {
    let ingest = Router::new()
        .route("/api/v1/ingest", post(handlers::ingest))
        // The ingest handler enforces its own, configurable limit with a clear message.
        .layer(DefaultBodyLimit::disable())
        // Writes that are not data: per-run rule overrides (axum's default 2 MB body limit) and
        // the alert feed the training process polls (it holds the ingest token, not the read one).
        .route(
            "/api/v1/runs/{run}/rules",
            axum::routing::put(handlers::set_rules).delete(handlers::clear_rules),
        )
        .route("/api/v1/runs/{run}/alerts/feed", get(handlers::alert_feed))
        // Probe switches: the dormant agent polls them, `rankwatch attach/detach RUN` sets them.
        .route(
            "/api/v1/runs/{run}/probes",
            get(handlers::probes).put(handlers::set_probes),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            admission::admit,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::ingest,
        ));
    let admin = Router::new()
        .route(
            "/api/v1/runs/{run}",
            axum::routing::delete(handlers::delete_run),
        )
        .route("/api/v1/retention", post(handlers::retention))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            admission::admit,
        ))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::admin,
        ));
    let read = Router::new()
        .route("/api/v1/runs", get(handlers::runs))
        .route("/api/v1/runs/{run}/export", get(handlers::export))
        .route("/api/v1/runs/{run}/catalog", get(handlers::catalog))
        .route("/api/v1/runs/{run}/series", get(handlers::series))
        .route("/api/v1/runs/{run}/heatmap", get(handlers::heatmap))
        .route("/api/v1/runs/{run}/workers", get(handlers::workers))
        .route("/api/v1/runs/{run}/consistency", get(handlers::consistency))
        .route("/api/v1/alerts", get(handlers::alerts))
        // Acknowledging and silencing change no data, only who is told: the dashboard's
        // users do it with the read token, as Alertmanager's UI users do.
        .route("/api/v1/incidents", get(incidents::incidents))
        .route(
            "/api/v1/incidents/{id}/ack",
            post(incidents::acknowledge).delete(incidents::unacknowledge),
        )
        .route(
            "/api/v1/silences",
            get(incidents::silences).post(incidents::create_silence),
        )
        .route(
            "/api/v1/silences/{id}",
            axum::routing::delete(incidents::expire_silence),
        )
        .route("/api/v1/rules", get(handlers::rules))
        .route("/api/v1/sql", post(handlers::sql))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            admission::admit,
        ))
        // Not admitted: event streams live long and have their own cap, and a scrape of a
        // busy collector must still answer.
        .route("/api/v1/events", get(handlers::events))
        .route("/metrics", get(handlers::metrics))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::read,
        ));
    let open = Router::new()
        .route("/healthz", get(handlers::healthz))
        .route("/readyz", get(handlers::readyz))
        .route("/api/v1/openapi.json", get(handlers::openapi));
    Router::new()
        .merge(ingest)
        .merge(admin)
        .merge(read)
        .merge(open)
        .fallback(ui::fallback)
        .layer(compression())
        // Over everything, the dashboard's pages too: a rebinding page must not read them.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            browser::guard,
        ))
        .with_state(state)
}

/// Compressed answers for clients that ask (`Accept-Encoding`: browsers, Prometheus, curl
/// `--compressed`): the dashboard's JSON, `/metrics`, CSV exports. Not for what is already
/// compressed or must not wait for a compressor's buffer: Parquet exports (zstd inside),
/// server-sent events, the dashboard's stored copies (they carry their `Content-Encoding`
/// already), answers under 256 bytes. Level 1 of Brotli and gzip: on the dashboard's series
/// JSON it keeps 4.1x of level 4's 4.3x, and unlike level 4 (+90 ms) it costs a loopback page
/// load nothing measurable (`cargo xtask bench ui`, docs/performance.md § Dashboard).
fn compression()
-> tower_http::compression::CompressionLayer<impl tower_http::compression::Predicate> {
    use tower_http::compression::predicate::{NotForContentType, Predicate, SizeAbove};
    use tower_http::compression::{CompressionLayer, CompressionLevel};
    let predicate = SizeAbove::new(256)
        .and(NotForContentType::GRPC)
        .and(NotForContentType::IMAGES)
        .and(NotForContentType::SSE)
        .and(NotForContentType::const_new(
            "application/vnd.apache.parquet",
        ));
    CompressionLayer::new()
        .quality(CompressionLevel::Precise(1))
        .compress_when(predicate)
}
