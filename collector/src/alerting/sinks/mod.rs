//! Alert delivery to the outside: a generic JSON webhook, Slack incoming webhooks and
//! Prometheus Alertmanager. (The UI's server-sent events and the training process's feed read
//! the store directly.)
//!
//! **Incidents, not alerts.** One fault raises many alerts (one per rank, layer and site); a
//! person wants one message. Webhooks and Slack hear *incidents* ([`told`]): opened, updated
//! (worse severity, a new kind of symptom, two incidents merged — under the surviving id), and
//! resolved, each with its ranks, layers, evidence and suggested action ([`payload`]).
//! Alertmanager, which groups and repeats on its own, gets every alert as before, labelled
//! `incident=<id>`, so that `group_by: [incident]` makes one notification per incident; an alert
//! whose incident id changes (a merge) has its old label set ended.
//!
//! Each configured endpoint has its own thread and queue, so a slow or dead receiver delays
//! only itself and never ingest. The queues *coalesce*: Alertmanager's holds each alert at most
//! once, at its latest state; a webhook's holds each run's incidents at most once, as they are
//! now. Both are bounded by what exists and never drop a change — the first design's 1,024-slot
//! channel dropped resolutions once 1,024 per-rank alerts fired at once. A failed POST is
//! retried with exponential backoff (0.5 s doubling to 30 s) up to `max_attempts`; what still
//! fails is counted and logged. Pending alerts stay inside the collector; an incident that
//! fires and resolves before its receiver was told of it is not announced at all. Alertmanager
//! expects to be told again while an alert fires, so its thread keeps the firing set and
//! re-posts it every `resend_interval`; a resolution is posted with `endsAt`.
//!
//! **Across restarts.** What each receiver was told (Alertmanager: its firing set; a webhook:
//! the incidents it heard firing) is kept on disk, `DIR/alert-delivery/<kind>-<hash of the
//! URL>.json`, rewritten after each delivery. At start each receiver is reconciled with the
//! store's alerts — which the engine journals before it tells anyone (`store::alert_log`): what
//! fires that the receiver never heard of is announced, what it heard firing that has since
//! resolved (or whose run was deleted) gets its resolution, and what it already heard is not
//! repeated when the log's replay raises it again. So a `kill -9` neither loses a resolution
//! nor re-posts to Slack.

pub mod payload;
pub mod told;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rankwatch_analytics::{Alert, AlertState};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::incidents::RunIncidents;
use crate::clock::SharedClock;
use crate::instrument::Labels;
use crate::store::alert_log::StoredAlert;
use told::{IncidentNote, Told};

/// The kinds of receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SinkKind {
    Webhook,
    Slack,
    Alertmanager,
}

impl SinkKind {
    /// The label used on `/metrics`.
    pub fn as_str(self) -> &'static str {
        match self {
            SinkKind::Webhook => "webhook",
            SinkKind::Slack => "slack",
            SinkKind::Alertmanager => "alertmanager",
        }
    }
}

/// Where and how alerts are delivered.
#[derive(Debug, Clone)]
pub struct SinkConfig {
    pub webhooks: Vec<String>,
    pub slack: Vec<String>,
    pub alertmanagers: Vec<String>,
    /// How often firing alerts are re-posted to Alertmanager.
    pub resend_interval: Duration,
    /// Attempts per delivery before it is given up (and counted as failed).
    pub max_attempts: u32,
    /// Base URL of the dashboard, for links in payloads.
    pub external_url: String,
    /// The collector's clock (resolution times, Alertmanager's `endsAt`).
    pub clock: SharedClock,
    /// Where each receiver's record of what it was told is kept; `None` keeps it in memory.
    pub state_dir: Option<PathBuf>,
}

/// What the sinks count: one delivery outcome per message and receiver.
#[derive(Debug, Default)]
pub struct SinkMetrics {
    pub notifications: Family<Labels, Counter>,
}

impl SinkMetrics {
    /// Counts one delivery outcome of an alert sink.
    pub fn notification(&self, sink: SinkKind, outcome: &'static str) {
        self.notifications
            .get_or_create(&vec![("sink", sink.as_str()), ("outcome", outcome)])
            .inc();
    }

    /// Adds these metrics to a registry, with their names and help texts.
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "alert_notifications",
            "Deliveries to webhooks and Slack (one per incident change) and Alertmanager \
             (alerts), by sink and outcome (delivered, retried, failed)",
            self.notifications.clone(),
        );
    }
}

/// One receiver's queue: each key at most once, at its latest value, oldest first.
#[derive(Debug)]
struct Queue<T> {
    state: Mutex<Queued<T>>,
    ready: Condvar,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Queue {
            state: Mutex::new(Queued {
                order: VecDeque::new(),
                latest: HashMap::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }
}

#[derive(Debug)]
struct Queued<T> {
    order: VecDeque<String>,
    latest: HashMap<String, T>,
    closed: bool,
}

enum Next<T> {
    Item(T),
    Timeout,
    Closed,
}

impl<T> Queue<T> {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queued<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `item` under `key`, replacing a value of it still waiting.
    fn push(&self, key: String, item: T) {
        let mut q = self.lock();
        if q.latest.insert(key.clone(), item).is_none() {
            q.order.push_back(key);
        }
        self.ready.notify_one();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// The oldest waiting item; what is queued is delivered before `Closed` is reported.
    fn next(&self, wait: Duration) -> Next<T> {
        let deadline = Instant::now() + wait;
        let mut q = self.lock();
        loop {
            if let Some(key) = q.order.pop_front() {
                if let Some(item) = q.latest.remove(&key) {
                    return Next::Item(item);
                }
                continue;
            }
            if q.closed {
                return Next::Closed;
            }
            let now = Instant::now();
            if now >= deadline {
                return Next::Timeout;
            }
            q = self
                .ready
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// An alert state for Alertmanager, with the incident it belongs to now.
type Labelled = (Alert, Option<String>);

/// The running sinks.
#[derive(Debug, Default)]
pub struct Sinks {
    /// Alertmanagers: alerts.
    alert_queues: Vec<Arc<Queue<Labelled>>>,
    /// Webhooks and Slack: each run's incidents.
    incident_queues: Vec<Arc<Queue<RunIncidents>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Sinks {
    /// Starts one thread per configured receiver, each reconciled with the store now (`alerts`
    /// and every run's `incidents`) against what it was told before the collector last
    /// stopped. Firing alerts `muted` picks (silenced) are not announced; the engine tells them
    /// when the silence ends.
    pub fn start(
        config: &SinkConfig,
        telemetry: Arc<SinkMetrics>,
        alerts: &[Alert],
        incidents: &[RunIncidents],
        muted: &dyn Fn(&Alert) -> bool,
    ) -> Sinks {
        let mut sinks = Sinks::default();
        let incident_of: HashMap<String, String> = incidents
            .iter()
            .flat_map(RunIncidents::incident_of)
            .collect();
        let targets = [
            (SinkKind::Webhook, &config.webhooks),
            (SinkKind::Slack, &config.slack),
            (SinkKind::Alertmanager, &config.alertmanagers),
        ];
        for (kind, urls) in targets {
            for url in urls {
                let record = config
                    .state_dir
                    .as_deref()
                    .map(|dir| dir.join(format!("{}-{:016x}.json", kind.as_str(), fnv1a(url))));
                let poster = Poster {
                    kind,
                    url: url.clone(),
                    config: config.clone(),
                    telemetry: telemetry.clone(),
                    agent: ureq::Agent::config_builder()
                        .timeout_global(Some(Duration::from_secs(10)))
                        .http_status_as_error(false)
                        .build()
                        .into(),
                    record,
                };
                let name = format!("rankwatch-{}", kind.as_str());
                let spawned = if kind == SinkKind::Alertmanager {
                    let told = poster
                        .record
                        .as_deref()
                        .map(load_alerts_told)
                        .unwrap_or_default();
                    let queue = Arc::new(Queue::default());
                    let told_alerts: BTreeMap<String, Alert> = told
                        .iter()
                        .map(|(id, (a, _))| (id.clone(), a.clone()))
                        .collect();
                    for alert in reconcile(&told_alerts, alerts, config.clock.now_ms(), muted) {
                        let incident = incident_of.get(&alert.id).cloned();
                        queue.push(alert.id.clone(), (alert, incident));
                    }
                    let rx = queue.clone();
                    std::thread::Builder::new()
                        .name(name)
                        .spawn(move || poster.alertmanager(&rx, told))
                        .map(|handle| (handle, Some(queue), None))
                } else {
                    let told = poster
                        .record
                        .as_deref()
                        .map(|p| load_incidents_told(p, incidents))
                        .unwrap_or_default();
                    let queue = Arc::new(Queue::default());
                    for now in incidents {
                        queue.push(now.run.to_string(), now.clone());
                    }
                    // Runs it heard of that have no alerts any more (deleted while it was down).
                    for note in told.values() {
                        if !incidents.iter().any(|i| i.run.as_str() == note.run)
                            && let Ok(run) = rankwatch_analytics::RunId::new(note.run.clone())
                        {
                            queue.push(note.run.clone(), RunIncidents::none(run));
                        }
                    }
                    let rx = queue.clone();
                    std::thread::Builder::new()
                        .name(name)
                        .spawn(move || poster.incidents(&rx, told))
                        .map(|handle| (handle, None, Some(queue)))
                };
                match spawned {
                    Ok((handle, alert_queue, incident_queue)) => {
                        sinks.threads.push(handle);
                        sinks.alert_queues.extend(alert_queue);
                        sinks.incident_queues.extend(incident_queue);
                    }
                    Err(e) => {
                        tracing::error!(sink = kind.as_str(), error = %e, "could not start an alert sink")
                    }
                }
            }
        }
        sinks
    }

    /// Whether no receiver is configured (nothing to group incidents for).
    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    /// Hands an alert state, and the incident it belongs to now, to every Alertmanager without
    /// waiting.
    pub fn send(&self, alert: &Alert, incident: Option<&str>) {
        for queue in &self.alert_queues {
            queue.push(
                alert.id.clone(),
                (alert.clone(), incident.map(str::to_owned)),
            );
        }
    }

    /// Hands a run's incidents as they are now to every webhook and Slack receiver without
    /// waiting.
    pub fn send_incidents(&self, now: &RunIncidents) {
        for queue in &self.incident_queues {
            queue.push(now.run.to_string(), now.clone());
        }
    }

    /// Closes the queues and waits for the threads to deliver what they hold (each gives up
    /// after its attempts).
    pub fn shutdown(mut self) {
        for queue in self.alert_queues.drain(..) {
            queue.close();
        }
        for queue in self.incident_queues.drain(..) {
            queue.close();
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// What Alertmanager must hear after a restart: alerts firing it was not told of, and the end
/// of those it was told fire that are resolved now or gone (their run deleted).
fn reconcile(
    told: &BTreeMap<String, Alert>,
    alerts: &[Alert],
    now_ms: i64,
    muted: &dyn Fn(&Alert) -> bool,
) -> Vec<Alert> {
    let mut out = Vec::new();
    let mut current: BTreeMap<&str, &Alert> = BTreeMap::new();
    for alert in alerts {
        current.insert(alert.id.as_str(), alert);
        let heard = told.contains_key(&alert.id);
        match alert.state {
            AlertState::Firing if !muted(alert) => out.push(alert.clone()),
            AlertState::Resolved if heard => out.push(alert.clone()),
            _ => {}
        }
    }
    for (id, was) in told {
        if !current.contains_key(id.as_str()) {
            let mut gone = was.clone();
            gone.resolve(
                now_ms,
                Some("the alert no longer exists: its run was deleted"),
            );
            out.push(gone);
        }
    }
    out
}

/// FNV-1a of the URL: names the receiver's record without writing its secret path to disk.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// An alert as Alertmanager was told of it, with its incident label (absent in records written
/// before incidents were labelled).
#[derive(Debug, Serialize, Deserialize)]
struct ToldAlert {
    #[serde(flatten)]
    alert: StoredAlert,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    incident: Option<String>,
}

/// A webhook's record: the incidents it heard firing.
#[derive(Debug, Serialize, Deserialize)]
struct IncidentRecord {
    incidents: Vec<IncidentNote>,
}

/// Reads a record; `None` (with a warning) when missing or damaged: the receiver may hear open
/// alerts again rather than miss one.
fn read_record<T: serde::de::DeserializeOwned>(path: &Path) -> Option<T> {
    let bytes = std::fs::read(path).ok()?;
    match serde_json::from_slice::<T>(&bytes) {
        Ok(record) => Some(record),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "an alert receiver's record is unreadable; it may hear open alerts again");
            None
        }
    }
}

/// Alertmanager's record of what it was told.
fn load_alerts_told(path: &Path) -> BTreeMap<String, Labelled> {
    read_record::<Vec<ToldAlert>>(path)
        .unwrap_or_default()
        .into_iter()
        .map(|t| {
            let alert = t.alert.into_alert();
            (alert.id.clone(), (alert, t.incident))
        })
        .collect()
}

/// A webhook's record of the incidents it heard firing. A record from before incidents (the
/// alerts it heard firing) counts the incidents now holding those alerts as heard, so an
/// upgrade does not announce them again.
fn load_incidents_told(path: &Path, now: &[RunIncidents]) -> Told {
    let Ok(bytes) = std::fs::read(path) else {
        return Told::new();
    };
    if let Ok(alerts) = serde_json::from_slice::<Vec<StoredAlert>>(&bytes) {
        let heard: std::collections::HashSet<String> =
            alerts.into_iter().map(|a| a.into_alert().id).collect();
        return now
            .iter()
            .flat_map(|run| &run.incidents)
            .filter(|i| i.state == AlertState::Firing)
            .filter(|i| i.alerts.iter().any(|a| heard.contains(&a.id)))
            .map(|i| (i.id.clone(), IncidentNote::from(i)))
            .collect();
    }
    read_record::<IncidentRecord>(path)
        .map(|r| r.incidents.into_iter().map(|n| (n.id.clone(), n)).collect())
        .unwrap_or_default()
}

/// One receiver's connection and record.
struct Poster {
    kind: SinkKind,
    url: String,
    config: SinkConfig,
    telemetry: Arc<SinkMetrics>,
    agent: ureq::Agent,
    /// Where what this receiver was told is kept.
    record: Option<PathBuf>,
}

impl Poster {
    /// A webhook or Slack receiver: tells each run's incident changes as they come.
    fn incidents(self, rx: &Queue<RunIncidents>, mut told: Told) {
        loop {
            match rx.next(Duration::from_secs(3600)) {
                Next::Item(now) => {
                    let mut changed = false;
                    for m in told::messages(&told, &now, self.config.clock.now_ms()) {
                        if m.event.is_some() {
                            let body = match self.kind {
                                SinkKind::Slack => {
                                    payload::slack_payload(&m, &self.config.external_url)
                                }
                                _ => payload::webhook_payload(&m, &self.config.external_url),
                            };
                            if !self.post(&body) {
                                // Not recorded: the next change of this run, or a restart,
                                // tells it again.
                                continue;
                            }
                        }
                        m.apply(&mut told);
                        changed = true;
                    }
                    if changed {
                        self.save(&IncidentRecord {
                            incidents: told.values().cloned().collect(),
                        });
                    }
                }
                Next::Timeout => {}
                Next::Closed => return,
            }
        }
    }

    /// An Alertmanager: every firing state is posted (it deduplicates by labels itself), the
    /// firing set re-posted every `resend_interval`, a resolution posted with `endsAt`.
    fn alertmanager(self, rx: &Queue<Labelled>, mut told: BTreeMap<String, Labelled>) {
        let url = self.config.external_url.clone();
        let mut next_resend = Instant::now() + self.config.resend_interval;
        loop {
            let wait = next_resend.saturating_duration_since(Instant::now());
            match rx.next(wait) {
                Next::Item((alert, incident)) => {
                    let firing = alert.state == AlertState::Firing;
                    let heard = told.get(&alert.id);
                    if !(firing || (alert.state == AlertState::Resolved && heard.is_some())) {
                        continue;
                    }
                    let now = self.config.clock.now_ms();
                    let mut bodies = Vec::new();
                    // Moved to another incident (a merge): its old label set ends, or
                    // Alertmanager would hold it until its own resolve_timeout.
                    if let Some((was, old)) = heard
                        && old.is_some()
                        && *old != incident
                    {
                        bodies.push(payload::alertmanager_alert(
                            was,
                            old.as_deref(),
                            &url,
                            Some(now),
                        ));
                    }
                    let ends = (!firing).then(|| alert.resolved_at_ms.unwrap_or(now));
                    bodies.push(payload::alertmanager_alert(
                        &alert,
                        incident.as_deref(),
                        &url,
                        ends,
                    ));
                    if !self.post(&Value::Array(bodies)) {
                        continue;
                    }
                    if firing {
                        told.insert(alert.id.clone(), (alert, incident));
                    } else {
                        told.remove(&alert.id);
                    }
                    self.save(
                        &told
                            .values()
                            .map(|(a, incident)| ToldAlert {
                                alert: StoredAlert::new(a),
                                incident: incident.clone(),
                            })
                            .collect::<Vec<_>>(),
                    );
                }
                Next::Timeout => {
                    if !told.is_empty() {
                        let body: Vec<Value> = told
                            .values()
                            .map(|(a, incident)| {
                                payload::alertmanager_alert(a, incident.as_deref(), &url, None)
                            })
                            .collect();
                        self.post(&Value::Array(body));
                    }
                    next_resend = Instant::now() + self.config.resend_interval;
                }
                Next::Closed => return,
            }
        }
    }

    /// Rewrites the record of what the receiver was told.
    fn save(&self, record: &impl Serialize) {
        let Some(path) = &self.record else {
            return;
        };
        let written = serde_json::to_vec(record)
            .map_err(crate::error::Error::from)
            .and_then(|bytes| {
                if let Some(dir) = path.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                crate::fsutil::write_atomic(path, &bytes)
            });
        if let Err(e) = written {
            tracing::warn!(sink = self.kind.as_str(), error = %e, "could not keep the record of delivered alerts");
        }
    }

    /// POSTs `body`, retrying with backoff; true when the receiver accepted it.
    fn post(&self, body: &Value) -> bool {
        let url = match self.kind {
            SinkKind::Alertmanager => format!("{}/api/v2/alerts", self.url.trim_end_matches('/')),
            _ => self.url.clone(),
        };
        // A webhook's path is its secret (Slack's `/services/T…/B…/…`): logs show the origin only.
        let shown = redact_url(&url);
        let mut delay = Duration::from_millis(500);
        for attempt in 1..=self.config.max_attempts.max(1) {
            let outcome = self
                .agent
                .post(&url)
                .header("content-type", "application/json")
                .send(body.to_string());
            let error = match outcome {
                Ok(response) if response.status().is_success() => {
                    self.telemetry.notification(self.kind, "delivered");
                    return true;
                }
                Ok(response) => format!("answered {}", response.status()),
                Err(e) => e.to_string().replace(&url, &shown),
            };
            if attempt == self.config.max_attempts.max(1) {
                tracing::error!(sink = self.kind.as_str(), url = %shown, %error, attempt, "alert delivery failed; giving up");
                break;
            }
            tracing::warn!(sink = self.kind.as_str(), url = %shown, %error, attempt, "alert delivery failed; retrying");
            self.telemetry.notification(self.kind, "retried");
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_secs(30));
        }
        self.telemetry.notification(self.kind, "failed");
        false
    }
}

/// `url` as logs may show it: scheme, host and port; no credentials, path or query (a Slack or
/// webhook URL's path is its secret).
pub fn redact_url(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let more = if end < rest.len() { "/…" } else { "" };
    if scheme.is_empty() {
        format!("{host}{more}")
    } else {
        format!("{scheme}://{host}{more}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alert(id: &str, state: AlertState) -> Alert {
        crate::store::alert_log::test_alert(id, "r", state, 1)
    }

    #[test]
    fn the_queue_keeps_every_alert_once_at_its_latest_state_and_drops_none() {
        let queue = Queue::default();
        // More alerts at once than the first design's 1,024-slot channel held.
        for i in 0..3000 {
            let a = alert(&format!("a{i}"), AlertState::Firing);
            queue.push(a.id.clone(), a);
        }
        queue.push("a5".into(), alert("a5", AlertState::Resolved));
        queue.close();
        let mut seen = Vec::new();
        while let Next::Item(a) = queue.next(Duration::from_millis(1)) {
            seen.push((a.id.clone(), a.state));
        }
        assert_eq!(seen.len(), 3000, "nothing dropped, nothing twice");
        assert_eq!(seen[0].0, "a0", "oldest first");
        assert_eq!(
            seen[5],
            ("a5".to_owned(), AlertState::Resolved),
            "latest state, first place"
        );
    }

    #[test]
    fn a_restarted_alertmanager_hears_what_it_missed() {
        let told: BTreeMap<String, Alert> = [
            ("told-firing", AlertState::Firing),
            ("told-then-resolved", AlertState::Firing),
            ("told-then-deleted", AlertState::Firing),
        ]
        .into_iter()
        .map(|(id, s)| (id.to_owned(), alert(id, s)))
        .collect();
        let now = vec![
            alert("told-firing", AlertState::Firing),
            alert("told-then-resolved", AlertState::Resolved),
            alert("new-firing", AlertState::Firing),
            alert("never-told-resolved", AlertState::Resolved),
            alert("pending", AlertState::Pending),
        ];
        let mut out: Vec<(String, AlertState)> = reconcile(&told, &now, 99, &|_| false)
            .into_iter()
            .map(|a| (a.id, a.state))
            .collect();
        out.sort();
        // Alertmanager is re-posted what fires anyway: `told-firing` goes again.
        assert_eq!(
            out,
            [
                ("new-firing".to_owned(), AlertState::Firing),
                ("told-firing".to_owned(), AlertState::Firing),
                ("told-then-deleted".to_owned(), AlertState::Resolved),
                ("told-then-resolved".to_owned(), AlertState::Resolved),
            ]
        );
    }

    #[test]
    fn the_records_round_trip_with_a_nan_and_read_the_formats_before_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("alertmanager-0.json");
        // Before incidents: a plain list of alerts.
        let list = vec![StoredAlert::new(&alert("a", AlertState::Firing))];
        std::fs::write(&path, serde_json::to_vec(&list).unwrap()).unwrap();
        let told = load_alerts_told(&path);
        assert!(told["a"].0.value.is_nan());
        assert_eq!(told["a"].1, None);
        let labelled = vec![ToldAlert {
            alert: StoredAlert::new(&told["a"].0),
            incident: Some("incident:a".into()),
        }];
        std::fs::write(&path, serde_json::to_vec(&labelled).unwrap()).unwrap();
        assert_eq!(
            load_alerts_told(&path)["a"].1.as_deref(),
            Some("incident:a")
        );
        std::fs::write(&path, b"{damaged").unwrap();
        assert!(
            load_alerts_told(&path).is_empty(),
            "damaged: heard again rather than refused"
        );
        assert_ne!(fnv1a("https://a/x"), fnv1a("https://a/y"));

        // A webhook's record from before incidents: the incident holding an alert it heard
        // counts as heard, so the upgrade announces nothing twice.
        let run = rankwatch_analytics::RunId::new("r").unwrap();
        let incidents = rankwatch_analytics::incident::group(
            vec![
                alert("a", AlertState::Firing),
                alert("b", AlertState::Firing),
            ],
            |_: &rankwatch_analytics::RunId| Some(4),
            100,
        );
        let now = [RunIncidents {
            run,
            incidents,
            muted: Default::default(),
        }];
        let hook = dir.path().join("webhook-0.json");
        std::fs::write(&hook, serde_json::to_vec(&list).unwrap()).unwrap();
        let told = load_incidents_told(&hook, &now);
        assert_eq!(told.len(), 1);
        assert!(
            told::messages(&told, &now[0], 5)
                .iter()
                .all(|m| m.event.is_none())
        );
        let record = IncidentRecord {
            incidents: told.values().cloned().collect(),
        };
        std::fs::write(&hook, serde_json::to_vec(&record).unwrap()).unwrap();
        assert_eq!(load_incidents_told(&hook, &[]), told);
    }

    #[test]
    fn urls_in_logs_keep_their_origin_only() {
        assert_eq!(
            redact_url("https://hooks.slack.com/services/T0001/B0001/h00k7oken9f2"),
            "https://hooks.slack.com/…"
        );
        assert_eq!(
            redact_url("https://user:pa55@hooks.example:8443/in?token=abc#x"),
            "https://hooks.example:8443/…"
        );
        assert_eq!(redact_url("http://127.0.0.1:9093"), "http://127.0.0.1:9093");
        assert_eq!(
            redact_url("http://[::1]:9093/api/v2/alerts"),
            "http://[::1]:9093/…"
        );
        for secret in ["h00k7oken9f2", "pa55", "abc", "services"] {
            assert!(!redact_url("https://u:pa55@h/services/h00k7oken9f2?t=abc").contains(secret));
        }
    }
}
