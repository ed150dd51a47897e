//! The alert engine: cross-worker statistics and the detectors, on the live stream.
//!
//! Every batch the collector acknowledges is also handed to one engine task (a bounded
//! channel: when the engine falls behind, ingest waits rather than the engine losing rows).
//! The task keeps a [`watch::RunWatch`] per run — a step aligner and the seven detectors
//! `docs/detection.md` describes — and never re-reads Parquet: detection is as fresh as ingest. Once a
//! second (and after each batch) it closes the steps that are ready and checks for stale ranks.
//!
//! A closed step's all-ranks statistics are written like any batch (log, then hot buffer, then
//! Parquet) under the idempotency key `run/4294967295/aligner/<last step>`. That key marks
//! them on replay: after a crash, the log's batches are fed again *without* closing steps until
//! the replay is over, and steps the log already holds statistics for are not written twice.
//!
//! Alerts go to the store (the `alerts` table and the SSE stream, at once), to the configured
//! [`sinks`], and count on `/metrics`. Alerts that were open when the collector stopped are
//! restored with the store and stay open: a detector that raises the same alert again (same
//! run, rule, layer, site and rank) continues it under its old id, and it resolves when that
//! detector clears it or when the run goes quiet. Alerts already resolved stay resolved: when
//! the replay raises one of them again (same id), that echo is counted
//! (`rankwatch_alert_replay_echoes_total`) and goes no further. (Detector baselines are not persisted: a
//! fault that persists across a restart becomes part of the new baseline, so quiet detectors
//! are no evidence that it is gone.)

pub mod actions;
pub mod aligner;
pub mod incidents;
pub mod replay;
pub mod rules;
pub mod sinks;
pub mod watch;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rankwatch_analytics::alert::AlertKey;
use rankwatch_analytics::schema::{samples, sketches};
use rankwatch_analytics::{Alert, AlertState, RunId};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::commit::Committer;
use crate::entry::Entry;
use crate::error::{Error, Result};
use crate::idempotency::Key;
use crate::instrument::Labels;
use actions::AlertActions;
use incidents::RunIncidents;
use rules::RuleBook;
use sinks::Sinks;
use watch::{Output, RunWatch};

/// The rank number that marks the aligner's own batches in idempotency keys.
pub const ALIGNER_RANK: u32 = u32::MAX;
/// The session name of the aligner's batches.
pub const ALIGNER_SESSION: &str = "aligner";
/// How long the engine waits, in all, for room for a derived batch refused for backpressure
/// before it gives that batch up (counted in its errors).
const DERIVED_PATIENCE: Duration = Duration::from_secs(30);

/// Engine settings.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// A step closes at the latest this long after its first row.
    pub align_timeout: Duration,
    /// Runs silent for this long are dropped from memory (their open steps closed first).
    pub idle_evict: Duration,
    /// Most alerts one run may have open (pending or firing); more are counted, not raised.
    pub max_open_alerts_per_run: usize,
}

/// What the engine counts.
#[derive(Debug, Default)]
pub struct EngineMetrics {
    /// Batches taken in (ingest's accepted batches minus these: the engine's backlog).
    pub batches: Counter,
    pub alert_transitions: Family<Labels, Counter>,
    pub aligner_steps: Family<Labels, Counter>,
    pub aligner_late_rows: Counter,
    pub derived_samples: Counter,
    pub errors: Counter,
    /// Alerts not raised because their run had the most open alerts allowed, by rule.
    pub suppressed: Family<Labels, Counter>,
    /// States the log's replay raised again for alerts the journal already holds resolved.
    pub replay_echoes: Counter,
    /// Firing states held back from receivers because a silence matched, by rule.
    pub silenced: Family<Labels, Counter>,
    /// Runs retired because every rank reported `finished`.
    pub runs_finished: Counter,
}

impl EngineMetrics {
    /// Adds these metrics to a registry, with their names and help texts.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "alert_engine_batches",
            "Batches the alert engine has taken in, replayed ones included",
            self.batches.clone(),
        );
        r.register(
            "alert_transitions",
            "Alert state changes raised by the alert engine, by rule, state and severity",
            self.alert_transitions.clone(),
        );
        // Both outcomes shown from the start, at zero.
        for outcome in ["complete", "timeout"] {
            let _ = self
                .aligner_steps
                .get_or_create(&vec![("outcome", outcome)]);
        }
        r.register(
            "aligner_steps",
            "Steps the aligner closed, by how (complete: every rank moved on; timeout)",
            self.aligner_steps.clone(),
        );
        r.register(
            "aligner_late_rows",
            "Rows that arrived after their step had closed (stored, not in the step's statistics)",
            self.aligner_late_rows.clone(),
        );
        r.register(
            "derived_samples",
            "All-ranks samples the aligner computed and stored",
            self.derived_samples.clone(),
        );
        r.register(
            "alerts_suppressed",
            "Alerts not raised because their run already had --max-open-alerts-per-run open, by rule",
            self.suppressed.clone(),
        );
        r.register(
            "alert_replay_echoes",
            "Alert states the log's replay raised again for alerts already resolved before the restart (not raised or told again)",
            self.replay_echoes.clone(),
        );
        r.register(
            "alerts_silenced",
            "Firing alert states not told to receivers because a silence matched them (told once it ends), by rule",
            self.silenced.clone(),
        );
        r.register(
            "runs_finished",
            "Runs whose every rank reported finished: their steps closed and open alerts resolved at once",
            self.runs_finished.clone(),
        );
        r.register(
            "alert_engine_errors",
            "Batches or derived writes the alert engine could not process (logged)",
            self.errors.clone(),
        );
    }
}

enum Msg {
    /// A batch, whether it is the aligner's own (replayed), and when it arrived.
    Entry(Entry, bool, i64),
    ReplayDone,
    Reset(RunId),
    Forget(RunId, oneshot::Sender<()>),
    Stop(oneshot::Sender<()>),
}

/// The sending side, held by the ingest path.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Msg>,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Msg::Entry(..) => "Entry",
            Msg::ReplayDone => "ReplayDone",
            Msg::Reset(_) => "Reset",
            Msg::Forget(..) => "Forget",
            Msg::Stop(_) => "Stop",
        })
    }
}

impl EngineHandle {
    /// Hands over an acknowledged batch that arrived at `arrived_ms` (waits while the engine's
    /// queue is full). Deadlines and silences count from the arrival, not from when the engine
    /// gets to the batch, so a busy engine does not stretch them.
    pub async fn feed(&self, entry: Entry, arrived_ms: i64) {
        let _ = self.tx.send(Msg::Entry(entry, false, arrived_ms)).await;
    }

    /// Hands over a batch replayed from the log at start-up; `derived` when it was the
    /// aligner's own.
    pub async fn replay(&self, entry: Entry, derived: bool, now_ms: i64) {
        let _ = self.tx.send(Msg::Entry(entry, derived, now_ms)).await;
    }

    /// Ends the replay: steps may close from now on.
    pub async fn replay_done(&self) {
        let _ = self.tx.send(Msg::ReplayDone).await;
    }

    /// Restarts a run's detectors under its new rules.
    pub async fn reset(&self, run: RunId) {
        let _ = self.tx.send(Msg::Reset(run)).await;
    }

    /// Drops everything the engine holds about a run (it is being deleted): its detectors,
    /// open steps and restored alerts, without raising or resolving anything. Resolves once
    /// done, so the deletion that follows cannot race a late alert of the run.
    pub async fn forget(&self, run: RunId) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Msg::Forget(run, done)).await.is_ok() {
            let _ = wait.await;
        }
    }
}

/// The running engine.
#[derive(Debug)]
pub struct AlertEngine {
    handle: EngineHandle,
    task: JoinHandle<()>,
}

impl AlertEngine {
    /// Starts the engine task. It writes the statistics it derives through `writer`, which
    /// never feeds them back to it. `withheld`: the firing alerts a silence kept from the
    /// receivers at start (the same set `Sinks::start` skipped), told when it ends.
    pub fn start(
        writer: Committer,
        rules: Arc<RuleBook>,
        sinks: Sinks,
        actions: Arc<AlertActions>,
        withheld: HashMap<String, Alert>,
        config: EngineConfig,
        metrics: Arc<EngineMetrics>,
    ) -> AlertEngine {
        let (tx, rx) = mpsc::channel(256);
        let started_ms = writer.store.now_ms();
        // Alerts open when the collector last stopped: restored, and counted against the cap.
        let mut restored = HashMap::new();
        let mut settled = HashMap::new();
        let mut open: HashMap<RunId, std::collections::HashSet<String>> = HashMap::new();
        for alert in writer.store.alerts(None) {
            if alert.state == AlertState::Resolved {
                settled.insert(alert.id.clone(), alert.run.clone());
            } else {
                open.entry(alert.run.clone())
                    .or_default()
                    .insert(alert.id.clone());
                restored.insert(alert.key(), alert);
            }
        }
        let task = Engine {
            writer,
            metrics,
            rules,
            sinks: Some(sinks),
            config,
            runs: BTreeMap::new(),
            replaying: true,
            stopping: false,
            derived_through: HashMap::new(),
            restored,
            settled,
            continued: HashMap::new(),
            outgoing: Vec::new(),
            started_ms,
            open,
            actions,
            withheld,
        };
        AlertEngine {
            handle: EngineHandle { tx },
            task: tokio::spawn(task.run(rx)),
        }
    }

    /// A handle for the ingest path.
    pub fn handle(&self) -> EngineHandle {
        self.handle.clone()
    }

    /// Closes every open step, writes its statistics, and stops (sinks deliver what they
    /// hold, within their retry budget).
    pub async fn shutdown(self) {
        let (done, wait) = oneshot::channel();
        if self.handle.tx.send(Msg::Stop(done)).await.is_ok() {
            let _ = wait.await;
        }
        let _ = self.task.await;
    }
}

struct Engine {
    writer: Committer,
    metrics: Arc<EngineMetrics>,
    rules: Arc<RuleBook>,
    sinks: Option<Sinks>,
    config: EngineConfig,
    runs: BTreeMap<RunId, RunWatch>,
    replaying: bool,
    stopping: bool,
    /// Last step whose statistics the log already holds, per run (from replay).
    derived_through: HashMap<RunId, u64>,
    /// Alerts open when the collector last stopped, not yet raised again.
    restored: HashMap<AlertKey, Alert>,
    /// Restored alerts a detector raised again: detector id → the restored alert it continues.
    continued: HashMap<String, Alert>,
    /// Alerts resolved when the collector started (id → run). The log's replay feeds the
    /// detectors the batches that raised and ended them, and they raise them again under the
    /// same id (an id names its first step); that echo is history, not news.
    settled: HashMap<String, RunId>,
    /// Alert states raised by the current step of the loop: journaled, then told (`release`).
    outgoing: Vec<Alert>,
    /// When this engine started (the collector's clock).
    started_ms: i64,
    /// Open (pending or firing) alert ids per run, for the per-run cap.
    open: HashMap<RunId, std::collections::HashSet<String>>,
    /// Acknowledgements and silences.
    actions: Arc<AlertActions>,
    /// Alerts whose firing a silence kept from the receivers, at their latest state.
    withheld: HashMap<String, Alert>,
}

impl Engine {
    async fn run(mut self, mut rx: mpsc::Receiver<Msg>) {
        let mut ticker = tokio::time::interval(Duration::from_secs(1));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(Msg::Entry(entry, derived, arrived_ms)) => {
                        let run = entry.run.clone();
                        self.metrics.batches.inc();
                        self.entry(entry, derived, arrived_ms);
                        if !self.replaying {
                            self.tick_run(&run, false).await;
                            self.retire_if_finished(&run).await;
                        }
                    }
                    Some(Msg::ReplayDone) => {
                        self.replaying = false;
                        self.tick_all(false).await;
                    }
                    Some(Msg::Reset(run)) => {
                        if let Some(mut old) = self.runs.remove(&run) {
                            // Open alerts are handed over like restored ones: the new
                            // detectors continue them on their first breach.
                            for alert in old.open_alerts() {
                                self.restored.insert(alert.key(), alert);
                            }
                            let world = self.writer.store.world_size(&run);
                            let store = &self.writer.store;
                            let out = old.tick(world, store.now_ms(), true, &|| {
                                store.replica_tensors(&run)
                            });
                            self.publish(&run, out).await;
                        }
                    }
                    Some(Msg::Forget(run, done)) => {
                        self.runs.remove(&run);
                        self.open.remove(&run);
                        self.withheld.retain(|_, alert| alert.run != run);
                        self.derived_through.remove(&run);
                        self.restored.retain(|key, _| key.run != run);
                        self.settled.retain(|_, of| *of != run);
                        self.continued.retain(|_, alert| alert.run != run);
                        // Receivers hear that its firing alerts are over (Alertmanager would
                        // otherwise be re-sent them for ever); the store forgets them next.
                        if let Some(sinks) = &self.sinks {
                            let now = self.writer.store.now_ms();
                            let labels = self.incidents_now(&run).incident_of();
                            for mut alert in self.writer.store.alerts(Some(&run)) {
                                if alert.state == AlertState::Firing {
                                    alert.resolve(now, Some("the run was deleted"));
                                    sinks.send(&alert, labels.get(&alert.id).map(String::as_str));
                                }
                            }
                            sinks.send_incidents(&RunIncidents::none(run.clone()));
                        }
                        let _ = done.send(());
                    }
                    Some(Msg::Stop(done)) => {
                        self.replaying = false;
                        self.stopping = true;
                        self.tick_all(true).await;
                        self.release().await;
                        if let Some(sinks) = self.sinks.take() {
                            let _ = tokio::task::spawn_blocking(move || sinks.shutdown()).await;
                        }
                        let _ = done.send(());
                        return;
                    }
                    None => return,
                },
                _ = ticker.tick(), if !self.replaying => self.tick_all(false).await,
            }
            self.release().await;
        }
    }

    /// Makes the alert states raised since the last call durable (the store's journal, one
    /// fsync for all of them), and only then hands them to the receivers: a receiver never
    /// hears of a state a crash could take back, and after a restart the receivers' own record
    /// of what they were told (see `sinks`) keeps them from hearing it twice.
    async fn release(&mut self) {
        if self.outgoing.is_empty() {
            return;
        }
        let alerts = std::mem::take(&mut self.outgoing);
        let store = self.writer.store.clone();
        let journaled = alerts.clone();
        let durable = tokio::task::spawn_blocking(move || store.journal_alerts(&journaled)).await;
        if !matches!(durable, Ok(Ok(()))) {
            // Told anyway: a receiver that misses an alert is worse than one that might hear
            // it again after a crash.
            tracing::error!(?durable, "alert states could not be journaled");
            self.metrics.errors.inc();
        }
        if self.sinks.is_none() {
            return;
        }
        // Incidents change with held-back states too (a silenced one is marked, not told).
        let runs = alerts.iter().map(|a| a.run.clone()).collect();
        let mut told = Vec::new();
        for alert in alerts {
            if alert.state != AlertState::Resolved && self.actions.is_muted(&(&alert).into()) {
                let newly = self
                    .withheld
                    .get(&alert.id)
                    .is_none_or(|held| held.state != AlertState::Firing);
                if alert.state == AlertState::Firing && newly {
                    self.metrics
                        .silenced
                        .get_or_create(&vec![("rule", alert.rule.as_str())])
                        .inc();
                }
                self.withheld.insert(alert.id.clone(), alert);
                continue;
            }
            self.withheld.remove(&alert.id);
            told.push(alert);
        }
        self.tell(&told, runs);
    }

    /// The incidents of `run` now, those a silence mutes marked.
    fn incidents_now(&self, run: &RunId) -> RunIncidents {
        RunIncidents::of(&self.writer.store, run, &|a| self.actions.is_muted(a))
    }

    /// Tells the receivers: Alertmanager each of `alerts`, labelled with its incident; webhooks
    /// and Slack the incidents of `runs` as they are now.
    fn tell(&self, alerts: &[Alert], runs: std::collections::BTreeSet<RunId>) {
        let Some(sinks) = &self.sinks else {
            return;
        };
        if sinks.is_empty() {
            return;
        }
        let mut labels = HashMap::new();
        for run in runs {
            let now = self.incidents_now(&run);
            labels.extend(now.incident_of());
            sinks.send_incidents(&now);
        }
        for alert in alerts {
            sinks.send(alert, labels.get(&alert.id).map(String::as_str));
        }
    }

    /// Tells the receivers of held-back alerts no silence matches any more (it expired or was
    /// deleted), at their latest state.
    fn release_unsilenced(&mut self) {
        let free: Vec<String> = self
            .withheld
            .values()
            .filter(|a| !self.actions.is_muted(&(*a).into()))
            .map(|a| a.id.clone())
            .collect();
        let freed: Vec<Alert> = free
            .iter()
            .filter_map(|id| self.withheld.remove(id))
            .collect();
        if !freed.is_empty() {
            let runs = freed.iter().map(|a| a.run.clone()).collect();
            self.tell(&freed, runs);
        }
    }

    fn watch(&mut self, run: &RunId, now_ms: i64) -> Option<&mut RunWatch> {
        if !self.runs.contains_key(run) {
            let config = self.rules.for_run(run);
            match RunWatch::new(run.clone(), config, self.align_timeout_ms(), now_ms) {
                Ok(watch) => {
                    self.runs.insert(run.clone(), watch);
                }
                Err(e) => {
                    tracing::error!(%run, error = %e, "run not watched: its rules are invalid");
                    return None;
                }
            }
        }
        self.runs.get_mut(run)
    }

    fn align_timeout_ms(&self) -> i64 {
        self.config.align_timeout.as_millis() as i64
    }

    fn entry(&mut self, entry: Entry, derived: bool, now: i64) {
        if derived {
            if let Some(batch) = &entry.samples {
                let through = self.derived_through.entry(entry.run.clone()).or_insert(0);
                // Written by this engine before the crash: its schema was checked then.
                let _ = samples::try_for_each_row(batch, |row| {
                    *through = (*through).max(row.step);
                    Ok(())
                });
            }
            return;
        }
        let run = entry.run.clone();
        let mut alerts = Vec::new();
        let metrics = self.metrics.clone();
        let Some(watch) = self.watch(&run, now) else {
            return;
        };
        if let Some(batch) = &entry.samples {
            match watch.samples(batch, now) {
                Ok(changed) => alerts.extend(changed),
                Err(e) => {
                    tracing::error!(%run, error = %e, "alert engine could not read a samples batch");
                    metrics.errors.inc();
                }
            }
        }
        if let Some(batch) = &entry.sketches {
            match sketches::from_batch(batch) {
                Ok(rows) => rows.into_iter().for_each(|s| watch.sketch(s, now)),
                Err(e) => {
                    tracing::error!(%run, error = %e, "alert engine could not read a sketches batch");
                    metrics.errors.inc();
                }
            }
        }
        alerts.extend(watch.end_batch());
        for alert in alerts {
            self.raise(alert);
        }
    }

    /// Retires a run every rank of which reported `finished`: its last steps close and its
    /// open alerts resolve now, not an `--idle-evict` later (before, a finished run's alerts
    /// stayed firing for an hour). A run that reports again afterwards (a resume under the
    /// same name) starts a fresh watch.
    async fn retire_if_finished(&mut self, run: &RunId) {
        let Some(world) = self.writer.store.world_size(run) else {
            return;
        };
        if !self.runs.get(run).is_some_and(|w| w.all_finished(world)) {
            return;
        }
        self.metrics.runs_finished.inc();
        self.retire(run, "the run finished").await;
    }

    /// Closes a run's open steps, drops its watch and resolves its open alerts, `why`.
    async fn retire(&mut self, run: &RunId, why: &str) {
        self.tick_run(run, true).await;
        let now = self.writer.store.now_ms();
        if let Some(watch) = self.runs.remove(run) {
            for mut alert in watch.open_alerts() {
                alert.resolve(now, Some(why));
                self.raise(alert);
            }
        }
        self.resolve_restored(run, why);
    }

    async fn tick_all(&mut self, all: bool) {
        let now = self.writer.store.now_ms();
        let runs: Vec<RunId> = self.runs.keys().cloned().collect();
        for run in runs {
            let idle = self.runs.get(&run).is_some_and(|w| {
                now - w.last_activity_ms > self.config.idle_evict.as_millis() as i64
            });
            if idle {
                // Its open alerts end with it: nothing will ever clear them (before, a run
                // that stopped with an alert firing left it firing for ever).
                self.retire(&run, "the run stopped reporting").await;
            } else {
                self.tick_run(&run, all).await;
                self.retire_if_finished(&run).await;
            }
        }
        self.release_unsilenced();
        // Alerts restored for runs that have not reported since the restart: resolved once
        // the collector has run as long as a watched run may stay quiet (before, they stayed
        // firing for ever). A run that did report is watched, and resolves its own.
        if now - self.started_ms > self.config.idle_evict.as_millis() as i64 {
            let quiet: std::collections::BTreeSet<RunId> = self
                .restored
                .values()
                .filter(|a| !self.runs.contains_key(&a.run))
                .map(|a| a.run.clone())
                .collect();
            for run in quiet {
                self.resolve_restored(
                    &run,
                    "the run has not reported since before the collector restarted",
                );
            }
        }
    }

    async fn tick_run(&mut self, run: &RunId, all: bool) {
        let world = self.writer.store.world_size(run);
        let Some(watch) = self.runs.get_mut(run) else {
            return;
        };
        let store = &self.writer.store;
        let out = watch.tick(world, store.now_ms(), all, &|| store.replica_tensors(run));
        let late = watch.take_late_rows();
        self.metrics.aligner_late_rows.inc_by(late);
        self.publish(run, out).await;
    }

    async fn publish(&mut self, run: &RunId, out: Output) {
        let t = self.metrics.clone();
        // Most ticks close nothing (one a batch): no label set built for them.
        for (outcome, steps) in [
            ("complete", out.steps_complete),
            ("timeout", out.steps_timed_out),
        ] {
            if steps > 0 {
                t.aligner_steps
                    .get_or_create(&vec![("outcome", outcome)])
                    .inc_by(steps);
            }
        }
        for alert in out.alerts {
            self.raise(alert);
        }
        let through = self.derived_through.get(run).copied();
        let fresh: Vec<_> = out
            .derived
            .into_iter()
            .filter(|s| through.is_none_or(|t| s.step > t))
            .collect();
        if let Some(last) = fresh.iter().map(|s| s.step).max() {
            if let Err(e) = self.write_derived(run, last, &fresh).await {
                tracing::error!(%run, error = %e, "all-ranks statistics could not be stored");
                t.errors.inc();
            } else {
                t.derived_samples.inc_by(fresh.len() as u64);
            }
        }
    }

    async fn write_derived(
        &self,
        run: &RunId,
        last: u64,
        rows: &[rankwatch_analytics::Sample],
    ) -> Result<()> {
        let key = Key {
            run: run.clone(),
            rank: ALIGNER_RANK,
            session: ALIGNER_SESSION.to_owned(),
            seq: last,
        };
        let entry = Entry {
            run: run.clone(),
            samples: Some(samples::to_batch(rows)?),
            sketches: None,
            info: None,
        };
        // Backpressure (429) is the only refusal a derived batch can meet; wait it out (but not
        // while stopping: the final flush is about to empty the hot buffer anyway), woken by
        // the flush that takes the buffer. The engine reads no batch while it waits, so a
        // client's whole second of Retry-After here delayed every alert behind it by up to a
        // second after that flush, and a 50 ms poll by up to 50 ms (decisions 0116, 0119).
        let deadline = tokio::time::Instant::now() + DERIVED_PATIENCE;
        loop {
            match self.writer.commit(Some(&key), &entry, None, None).await {
                Err(Error::Backpressure { .. }) if !self.stopping => {
                    if tokio::time::Instant::now() >= deadline {
                        return Err(Error::Unavailable(
                            "the hot buffer stayed full for 30 s".into(),
                        ));
                    }
                    let _ = self.writer.store.room_until(deadline).await;
                }
                other => return other.map(|_| ()),
            }
        }
    }

    /// Continues a restored alert when a detector raises it again, then delivers.
    fn raise(&mut self, mut alert: Alert) {
        if self.settled.contains_key(&alert.id) {
            // Before, the echo flipped the stored alert back to firing, and a receiver already
            // told of its end (reconciled at start) could hear it fire and resolve again.
            self.metrics.replay_echoes.inc();
            return;
        }
        let key = alert.key();
        if let Some(old) = self.continued.get(&alert.id).cloned().or_else(|| {
            let old = self.restored.remove(&key)?;
            self.continued.insert(alert.id.clone(), old.clone());
            Some(old)
        }) {
            let detector_id = std::mem::replace(&mut alert.id, old.id.clone());
            alert.first_step = old.first_step;
            alert.started_at_ms = old.started_at_ms;
            if old.fired_at_ms.is_some() {
                alert.fired_at_ms = old.fired_at_ms;
                if alert.state == AlertState::Pending {
                    alert.state = AlertState::Firing;
                }
            }
            if alert.state == AlertState::Resolved {
                self.continued.remove(&detector_id);
            }
        }
        self.deliver(alert);
    }

    /// Counts, logs and stores one alert state; [`Engine::release`] journals it and tells the
    /// receivers. A run at its cap of open alerts raises no new one: a fault seen by every one
    /// of 1,024 ranks would otherwise be 1,024 alerts, each a page to someone.
    fn deliver(&mut self, alert: Alert) {
        let open = self.open.entry(alert.run.clone()).or_default();
        if alert.state == AlertState::Resolved {
            if !open.remove(&alert.id) {
                // The end of an alert that was never raised (suppressed by the cap).
                return;
            }
        } else if !open.contains(&alert.id) {
            if open.len() >= self.config.max_open_alerts_per_run {
                self.metrics
                    .suppressed
                    .get_or_create(&vec![("rule", alert.rule.as_str())])
                    .inc();
                tracing::warn!(run = %alert.run, rule = %alert.rule, cap = self.config.max_open_alerts_per_run, "alert not raised: its run has the most open alerts allowed (--max-open-alerts-per-run)");
                return;
            }
            open.insert(alert.id.clone());
        }
        self.metrics
            .alert_transitions
            .get_or_create(&vec![
                ("rule", alert.rule.as_str()),
                ("state", alert.state.as_str()),
                ("severity", alert.severity.as_str()),
            ])
            .inc();
        tracing::info!(run = %alert.run, rule = %alert.rule, state = %alert.state, severity = %alert.severity, "{}", alert.explanation);
        self.writer.store.upsert_alert(alert.clone());
        self.outgoing.push(alert);
    }

    fn resolve_restored(&mut self, run: &RunId, why: &str) {
        let keys: Vec<AlertKey> = self
            .restored
            .keys()
            .filter(|k| &k.run == run)
            .cloned()
            .collect();
        for key in keys {
            if let Some(mut alert) = self.restored.remove(&key) {
                alert.resolve(self.writer.store.now_ms(), Some(why));
                // Not through `raise`: that would look it up among the restored again.
                self.deliver(alert);
            }
        }
    }
}
