//! Start-up, background work and shutdown of the collector.
//!
//! Start-up order matters for durability: load the manifest (deleting files it does not list),
//! rebuild the run index from Parquet, replay the write-ahead log after the manifest's
//! `flushed_seq` into the hot buffer, and only then start the log writer and accept requests.
//! Shutdown stops accepting, lets in-flight requests finish, flushes the hot buffer to Parquet
//! and truncates the log, so a clean restart replays nothing.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use rankwatch_analytics::detect::DetectorsConfig;

use crate::alerting::actions::AlertActions;
use crate::alerting::incidents::RunIncidents;
use crate::alerting::rules::{self, RuleBook};
use crate::alerting::sinks::{SinkConfig, SinkMetrics, Sinks};
use crate::alerting::{ALIGNER_RANK, ALIGNER_SESSION, AlertEngine, EngineConfig, EngineMetrics};
use crate::api::{Alerting, AppState, Tokens, app};
use crate::clock::{SharedClock, SystemClock};
use crate::commit::Committer;
use crate::config::ServeConfig;
use crate::decode::{self, Entry, Limits};
use crate::disk::{RealDisk, SharedDisk};
use crate::error::Result;
use crate::idempotency::Key;
use crate::ingest::{IngestMetrics, Ingestor};
use crate::query::Queries;
use crate::retention::{Housekeeper, Policy};
use crate::store::backend::Backend;
use crate::store::{Store, StoreLimits};
use crate::telemetry::{Exporter, RequestMetrics, Sources};
use crate::wal::{self, WalHandle, WalMetrics};

/// An open collector: store, log writer, background tasks and the API state.
#[derive(Debug)]
pub struct Collector {
    state: AppState,
    alert_engine: Option<AlertEngine>,
    store: Arc<Store>,
    wal: WalHandle,
    wal_thread: Option<std::thread::JoinHandle<()>>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    /// Held for the collector's lifetime, and dropped last (fields drop in order): no second
    /// collector opens this data directory while anything of this one still writes there.
    _lock: crate::dirlock::DirLock,
}

impl Collector {
    /// Opens the data directory, recovers, and starts the background tasks. Components are
    /// built in dependency order — store, queries, log, alert engine, ingest, telemetry, API —
    /// each handed what it needs when it is made, so none holds a back-reference to a later one.
    pub async fn open(config: &ServeConfig) -> Result<Collector> {
        Collector::open_with_clock(config, SystemClock::shared()).await
    }

    /// [`Collector::open`] on a given clock: every time-dependent rule (step deadlines, stale
    /// ranks, idle runs, retention ages, the active-run window) reads this one.
    pub async fn open_with_clock(config: &ServeConfig, clock: SharedClock) -> Result<Collector> {
        Collector::open_on(config, clock, RealDisk::shared()).await
    }

    /// [`Collector::open_with_clock`] with the Parquet side written through `disk` (tests of
    /// a full or failing disk; see [`crate::disk`]).
    pub async fn open_on(
        config: &ServeConfig,
        clock: SharedClock,
        disk: SharedDisk,
    ) -> Result<Collector> {
        config.check()?;
        // Before anything in the directory is read, let alone deleted as a leftover.
        let lock = crate::dirlock::DirLock::acquire(&config.data_dir)?;
        let store = Arc::new(open_store(config, clock, disk.clone()).await?);
        let queries = Queries::new(
            store.clone(),
            config.query_timeout,
            crate::query::SqlLimits {
                max_rows: config.sql_max_rows,
                max_result_bytes: config.sql_max_result_bytes,
                max_running: config.max_concurrent_sql,
            },
            config.query_memory,
            config.read_cache_bytes,
        )?;
        queries.rebuild_index().await?;

        let base_rules = match &config.rules {
            Some(path) => rules::load_file(path)?,
            None => DetectorsConfig::default(),
        };
        let rule_book = Arc::new(RuleBook::open(base_rules, config.data_dir.join("rules"))?);
        let switches = Arc::new(crate::switches::ProbeSwitches::open(
            config.data_dir.join("probe-switches"),
        )?);

        let wal_metrics = Arc::new(WalMetrics::default());
        let Recovered {
            wal,
            wal_thread,
            replayed,
        } = recover_log(config, &store, wal_metrics.clone(), disk)?;
        let committer = Committer {
            store: store.clone(),
            wal: wal.clone(),
        };

        let actions = Arc::new(AlertActions::open(
            Some(config.data_dir.join("alert-actions.json")),
            store.clock().clone(),
        )?);
        let engine_metrics = Arc::new(EngineMetrics::default());
        let sink_metrics = Arc::new(SinkMetrics::default());
        let alert_engine = if config.no_alert_engine {
            None
        } else {
            let engine = start_alert_engine(
                config,
                committer.clone(),
                rule_book.clone(),
                actions.clone(),
                engine_metrics.clone(),
                sink_metrics.clone(),
            );
            // The log's batches first, then new ones: the engine sees the stream in order.
            let handle = engine.handle();
            let now_ms = store.now_ms();
            for (entry, derived) in replayed {
                handle.replay(entry, derived, now_ms).await;
            }
            handle.replay_done().await;
            Some(engine)
        };
        let handle = alert_engine.as_ref().map(AlertEngine::handle);

        let ingest_metrics = Arc::new(IngestMetrics::default());
        let ingestor = Ingestor {
            committer,
            metrics: ingest_metrics.clone(),
            limits: Limits {
                max_rows: config.max_batch_rows,
                max_world_size: config.max_world_size,
            },
            engine: handle.clone(),
        };
        let requests = Arc::new(RequestMetrics::default());
        let exporter = Exporter::new(
            store.clone(),
            Sources {
                ingest: &ingest_metrics,
                wal: &wal_metrics,
                engine: &engine_metrics,
                sinks: &sink_metrics,
                requests: &requests,
            },
            config.active_window,
            config.max_active_runs,
        );
        let state = AppState::new(
            ingestor,
            queries,
            requests,
            exporter,
            Tokens {
                ingest: config.ingest_token.clone(),
                read: config.read_token.clone(),
                admin: config.admin_token.clone(),
            },
            config.max_body_bytes,
            Alerting {
                rules: rule_book,
                engine: handle.clone(),
                actions,
            },
            config.retention(),
            switches,
            crate::api::browser::BrowserPolicy {
                extra_hosts: config.allowed_hosts.clone(),
                origins: config.allowed_origins.clone(),
            },
            config.admission(),
        );

        let (stop, stopped) = watch::channel(false);
        let mut tasks = vec![
            tokio::spawn(flusher(
                store.clone(),
                wal.clone(),
                config.flush_interval,
                stopped.clone(),
            )),
            tokio::spawn(compactor(
                store.clone(),
                config.compact_interval,
                stopped.clone(),
            )),
        ];
        let policy = config.retention();
        if policy.is_set() {
            tasks.push(tokio::spawn(retainer(
                Housekeeper::new(store.clone(), handle),
                policy,
                config.retention_interval,
                stopped,
            )));
        }
        Ok(Collector {
            state,
            alert_engine,
            store,
            wal,
            wal_thread: Some(wal_thread),
            stop,
            tasks,
            _lock: lock,
        })
    }

    /// The API router.
    pub fn app(&self) -> axum::Router {
        app(self.state.clone())
    }

    /// The API state.
    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// The write-ahead log (its failure state, its fault injector for tests and drills).
    pub fn wal(&self) -> &WalHandle {
        &self.wal
    }

    /// The store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Flushes the hot buffer now and truncates the log (tests, shutdown).
    pub async fn flush(&self) -> Result<()> {
        if let Some(seq) = self.store.flush().await? {
            self.wal.truncate(seq);
            self.wal.barrier().await;
        }
        Ok(())
    }

    /// Stops background work, flushes everything and closes the log.
    pub async fn shutdown(mut self) -> Result<()> {
        self.state.set_ready(false);
        let _ = self.stop.send(true);
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
        // Open steps close and their statistics are logged before the final flush.
        if let Some(engine) = self.alert_engine.take() {
            engine.shutdown().await;
        }
        let flushed = self.flush().await;
        drop(self.state);
        drop(self.wal);
        if let Some(thread) = self.wal_thread.take() {
            // The writer exits when the last handle is gone; the store's apply closures hold
            // none, so this returns once queued appends are done.
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        flushed
    }
}

/// Opens the store on its backend (local directory or object storage): the manifest, the run
/// tables, the key snapshot.
async fn open_store(config: &ServeConfig, clock: SharedClock, disk: SharedDisk) -> Result<Store> {
    let limits = StoreLimits {
        hot_budget_bytes: config.hot_budget_bytes,
        max_series_per_run: config.max_series_per_run,
        max_series: config.max_series,
        max_runs: config.max_runs,
        compact_small_rows: config.compact_small_rows,
        compact_max_rows: config.compact_max_rows,
        file_grace: config.query_timeout + Duration::from_secs(5),
        key_window: config.idempotency_window,
    };
    let backend = match config.remote_storage() {
        Some(url) => Backend::s3(url, &config.node_id(), &config.data_dir)?,
        None => Backend::local_on(&config.data_dir, disk),
    };
    tracing::info!(storage = %backend.describe(), "opening the store");
    // Opening reads the manifest and the run tables, over the network with object storage.
    let dir = config.data_dir.clone();
    let take_over = config.take_over_node;
    tokio::task::spawn_blocking(move || {
        // The node id first (with object storage): nothing is read or cleaned up under a
        // node id another collector holds.
        backend.claim(&dir, clock.now_ms(), take_over)?;
        Store::open(&dir, backend, limits, clock)
    })
    .await
    .map_err(|e| crate::error::Error::Unavailable(format!("opening the store: {e}")))?
}

/// The write-ahead log after recovery.
struct Recovered {
    wal: WalHandle,
    wal_thread: std::thread::JoinHandle<()>,
    /// The replayed batches, for the alert engine (`true`: the aligner's own statistics).
    replayed: Vec<(Entry, bool)>,
}

/// Replays the log's records after the manifest's `flushed_seq` into the hot buffer, then
/// starts the log writer and deletes segments wholly flushed before a crash.
fn recover_log(
    config: &ServeConfig,
    store: &Store,
    metrics: Arc<WalMetrics>,
    disk: SharedDisk,
) -> Result<Recovered> {
    let wal_dir = config.data_dir.join(wal::DIR);
    let report = wal::replay(&*disk, &wal_dir, store.flushed_seq())?;
    let mut records = 0usize;
    let mut replayed = Vec::new();
    for record in report.records {
        match decode::decode_entry(&record.payload) {
            Ok((key, entry)) => {
                let key = key.as_deref().map(Key::parse).transpose().ok().flatten();
                store.apply(
                    record.seq,
                    key.as_ref(),
                    &entry,
                    crate::store::Prepared::of(&entry)?,
                    0,
                )?;
                records += 1;
                if !config.no_alert_engine {
                    let derived =
                        key.is_some_and(|k| k.rank == ALIGNER_RANK && k.session == ALIGNER_SESSION);
                    replayed.push((entry, derived));
                }
            }
            Err(e) => {
                let kept =
                    wal::set_aside_entry(&wal_dir, record.seq, &record.payload, &e.to_string())?;
                metrics.set_aside.inc();
                tracing::error!(seq = record.seq, error = %e, kept = %kept.display(), "a write-ahead-log entry that does not decode was set aside");
            }
        }
    }
    metrics.set_aside.inc_by(report.damaged_ranges as u64);
    if records > 0 || report.torn_bytes > 0 || report.damaged_ranges > 0 {
        tracing::info!(
            replayed = records,
            torn_bytes = report.torn_bytes,
            damaged_ranges = report.damaged_ranges,
            damaged_bytes = report.damaged_bytes,
            "recovered from the write-ahead log"
        );
    }
    let (wal, wal_thread) = WalHandle::start(
        wal_dir,
        report.next_seq,
        config.wal_segment_bytes,
        metrics,
        disk,
    )?;
    wal.truncate(store.flushed_seq());
    Ok(Recovered {
        wal,
        wal_thread,
        replayed,
    })
}

/// Starts the alert sinks and the engine, which writes its derived statistics through
/// `committer` (never fed back to it).
fn start_alert_engine(
    config: &ServeConfig,
    committer: Committer,
    rules: Arc<RuleBook>,
    actions: Arc<AlertActions>,
    metrics: Arc<EngineMetrics>,
    sink_metrics: Arc<SinkMetrics>,
) -> AlertEngine {
    // Which firing alerts a silence holds back is decided once, for the sinks' reconciliation
    // and the engine alike (two reads could straddle a silence's end and lose one).
    let alerts = committer.store.alerts(None);
    let withheld: std::collections::HashMap<_, _> = alerts
        .iter()
        .filter(|a| {
            a.state == rankwatch_analytics::AlertState::Firing && actions.is_muted(&(*a).into())
        })
        .map(|a| (a.id.clone(), a.clone()))
        .collect();
    let sinks = Sinks::start(
        &SinkConfig {
            webhooks: config.webhook_urls.clone(),
            slack: config.slack_webhook_urls.clone(),
            alertmanagers: config.alertmanager_urls.clone(),
            resend_interval: config.alertmanager_resend,
            max_attempts: config.alert_max_attempts,
            external_url: config
                .external_url
                .clone()
                .unwrap_or_else(|| format!("http://{}", config.listen)),
            clock: committer.store.clock().clone(),
            state_dir: Some(config.data_dir.join("alert-delivery")),
        },
        sink_metrics,
        &alerts,
        &RunIncidents::every_run(&committer.store, &|alert| withheld.contains_key(&alert.id)),
        &|alert| withheld.contains_key(&alert.id),
    );
    AlertEngine::start(
        committer,
        rules,
        sinks,
        actions.clone(),
        withheld,
        EngineConfig {
            align_timeout: config.align_timeout,
            idle_evict: config.idle_evict,
            max_open_alerts_per_run: config.max_open_alerts_per_run,
        },
        metrics,
    )
}

async fn flusher(
    store: Arc<Store>,
    wal: WalHandle,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = store.flush_requested() => {}
            _ = stop.changed() => return,
        }
        match store.flush().await {
            Ok(Some(seq)) => wal.truncate(seq),
            Ok(None) => {}
            Err(e) => {
                tracing::error!(error = %e, "flush failed; the rows stay in memory and the log, retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

async fn compactor(store: Arc<Store>, every: Duration, mut stop: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        if let Err(e) = store.compact().await {
            tracing::error!(error = %e, "compaction failed; will retry");
        }
    }
}

/// Applies the retention policy at start and then every `every`.
async fn retainer(
    housekeeper: Housekeeper,
    policy: Policy,
    every: Duration,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        match housekeeper.retain(&policy, false).await {
            Ok(report) => {
                for d in &report.deleted {
                    tracing::info!(run = %d.run, reason = ?d.reason, bytes = d.bytes, "retention deleted a run");
                }
                if let Some(why) = &report.over_cap {
                    tracing::warn!("retention: {why}");
                }
            }
            Err(e) => tracing::error!(error = %e, "retention failed; will retry"),
        }
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
    }
}

/// Runs `rankwatch serve` until `shutdown` resolves. Prints the bound address (useful with
/// port 0) once requests are accepted.
pub async fn serve(
    mut config: ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    config.read_token_files()?;
    let collector = Collector::open(&config).await?;
    let listener = TcpListener::bind(config.listen).await?;
    serve_on(collector, listener, &config, shutdown).await
}

/// Serves an open collector on a bound listener until `shutdown` resolves, then shuts it
/// down (tests run the whole server in-process this way, on port 0).
pub async fn serve_on(
    collector: Collector,
    listener: TcpListener,
    config: &ServeConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let address: SocketAddr = listener.local_addr()?;
    tracing::info!(%address, data_dir = %config.data_dir.display(), "rankwatch collector listening");
    println!("rankwatch listening on http://{address}");
    if !crate::api::ui::built() {
        tracing::warn!(
            "this binary carries no dashboard (run `cargo xtask web`, then rebuild); the API works as usual"
        );
    }
    let state = collector.state().clone();
    let limits = crate::http::HttpLimits {
        max_connections: config.max_connections,
        max_connections_per_peer: config.max_connections_per_peer,
        header_timeout: config.header_timeout,
        write_timeout: config.write_timeout,
    };
    crate::http::serve(listener, collector.app(), limits, async move {
        shutdown.await;
        state.set_ready(false);
        tracing::info!("shutting down: finishing requests, flushing to Parquet");
    })
    .await;
    collector.shutdown().await
}
