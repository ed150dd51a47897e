//! Alert delivery to the outside: a generic JSON webhook, Slack incoming webhooks and
//! Prometheus Alertmanager. (The UI's server-sent events and the training process's feed read
//! the store directly.)
//!
//! Each configured endpoint has its own thread and queue, so a slow or dead receiver delays
//! only itself and never ingest. The queue *coalesces*: it holds each alert at most once, at
//! its latest state, so it is bounded by the number of alerts and never drops one — the first
//! design's 1,024-slot channel dropped resolutions once 1,024 per-rank alerts fired at once. A
//! failed POST is retried with exponential backoff (0.5 s doubling to 30 s) up to
//! `max_attempts`; what still fails is counted and logged. Webhooks and Slack hear about an
//! alert when it fires, when it escalates while firing, and when a fired alert resolves
//! (pending alerts stay inside the collector; an alert that fires and resolves before its
//! receiver was told of it is not announced at all). Alertmanager expects to be told again
//! while an alert fires, so its thread keeps the firing set and re-posts it every
//! `resend_interval`; a resolution is posted with `endsAt`.
//!
//! **Across restarts.** What each receiver was told (its firing set) is kept on disk,
//! `DIR/alert-delivery/<kind>-<hash of the URL>.json`, rewritten after each delivery. At
//! start each receiver is reconciled with the store's alerts — which the engine journals
//! before it tells anyone (`store::alert_log`): an alert firing that the receiver never heard
//! of is announced, one it heard firing that has since resolved (or whose run was deleted) gets
//! its resolution, and one it already heard is not repeated when the log's replay raises it
//! again. So a `kill -9` neither loses a resolution nor re-posts to Slack.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rankwatch_analytics::{Alert, AlertState};
use serde_json::{Value, json};

use crate::Labels;
use crate::clock::SharedClock;
use crate::store::alert_log::StoredAlert;

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

/// The generic webhook body: version, the alert as the API returns it, and a one-line text.
pub fn webhook_payload(alert: &Alert) -> Value {
    json!({
        "version": 1,
        "source": "rankwatch",
        "status": alert.state.as_str(),
        "text": summary(alert),
        "alert": alert,
    })
}

/// One line that says what happened, where, and why.
pub fn summary(alert: &Alert) -> String {
    let state = match alert.state {
        AlertState::Resolved => "resolved",
        AlertState::Firing => "firing",
        AlertState::Pending => "pending",
    };
    format!(
        "[{}] {} {} on run {}: {}",
        state,
        alert.severity.as_str(),
        alert.rule.as_str(),
        alert.run,
        alert.explanation
    )
}

/// A Slack incoming-webhook body (`text` with mrkdwn, plus a colour-coded attachment).
pub fn slack_payload(alert: &Alert, external_url: &str) -> Value {
    let colour = match (alert.state, alert.severity) {
        (AlertState::Resolved, _) => "#2eb67d",
        (_, rankwatch_analytics::Severity::Critical) => "#e01e5a",
        (_, rankwatch_analytics::Severity::Warning) => "#ecb22e",
        _ => "#36c5f0",
    };
    let mut fields = vec![
        json!({"title": "run", "value": alert.run.as_str(), "short": true}),
        json!({"title": "steps", "value": format!("{}–{}", alert.first_step, alert.last_step), "short": true}),
    ];
    if let Some(layer) = alert.layer {
        fields.push(json!({"title": "layer", "value": layer.to_string(), "short": true}));
    }
    if let Some(rank) = alert.rank {
        fields.push(json!({"title": "rank", "value": rank.to_string(), "short": true}));
    }
    if !alert.outlier_ranks.is_empty() {
        let ranks: Vec<String> = alert.outlier_ranks.iter().map(u32::to_string).collect();
        fields.push(json!({"title": "outlier ranks", "value": ranks.join(", "), "short": true}));
    }
    json!({
        "text": format!("*rankwatch* {}", summary(alert)),
        "attachments": [{
            "color": colour,
            "title": format!("{} · {}", alert.rule.as_str(), alert.severity.as_str()),
            "title_link": format!("{}/runs/{}", external_url.trim_end_matches('/'), alert.run),
            "text": alert.explanation,
            "fields": fields,
        }],
    })
}

/// One Alertmanager alert (`POST /api/v2/alerts` takes an array of these).
pub fn alertmanager_alert(alert: &Alert, external_url: &str, now_ms: i64) -> Value {
    let mut labels = serde_json::Map::new();
    labels.insert(
        "alertname".into(),
        json!(format!("rankwatch_{}", alert.rule.as_str())),
    );
    labels.insert("run".into(), json!(alert.run.as_str()));
    labels.insert("rule".into(), json!(alert.rule.as_str()));
    labels.insert("severity".into(), json!(alert.severity.as_str()));
    if let Some(layer) = alert.layer {
        labels.insert("layer".into(), json!(layer.to_string()));
    }
    if let Some(site) = alert.site {
        labels.insert("site".into(), json!(site.as_str()));
    }
    if let Some(rank) = alert.rank {
        labels.insert("rank".into(), json!(rank.to_string()));
    }
    let started = alert.fired_at_ms.unwrap_or(alert.started_at_ms);
    let mut body = json!({
        "labels": labels,
        "annotations": {
            "summary": summary(alert),
            "description": alert.explanation,
            "value": alert.value.to_string(),
            "threshold": alert.threshold.to_string(),
            "steps": format!("{}-{}", alert.first_step, alert.last_step),
        },
        "startsAt": rfc3339(started),
        "generatorURL": format!("{}/runs/{}", external_url.trim_end_matches('/'), alert.run),
    });
    if alert.state == AlertState::Resolved {
        body["endsAt"] = json!(rfc3339(alert.resolved_at_ms.unwrap_or(now_ms)));
    }
    body
}

/// Milliseconds since the epoch as RFC 3339 UTC (what Alertmanager's `startsAt` takes).
fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Whether a webhook or Slack receiver should hear about this state of an alert.
fn worth_telling(alert: &Alert, told: Option<&Alert>) -> bool {
    match alert.state {
        AlertState::Pending => false,
        AlertState::Firing => {
            told.is_none_or(|t| t.state != AlertState::Firing || t.severity < alert.severity)
        }
        AlertState::Resolved => {
            alert.fired_at_ms.is_some() && told.is_some_and(|t| t.state == AlertState::Firing)
        }
    }
}

/// What the sinks count: one delivery outcome per alert and receiver.
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
            "Alert deliveries to webhooks, Slack and Alertmanager, by sink and outcome \
             (delivered, retried, failed)",
            self.notifications.clone(),
        );
    }
}

/// One receiver's queue: each alert at most once, at its latest state, oldest first.
#[derive(Debug, Default)]
struct Queue {
    state: Mutex<Queued>,
    ready: Condvar,
}

#[derive(Debug, Default)]
struct Queued {
    order: VecDeque<String>,
    latest: HashMap<String, Alert>,
    closed: bool,
}

enum Next {
    Alert(Box<Alert>),
    Timeout,
    Closed,
}

impl Queue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queued> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `alert`, replacing a state of it still waiting.
    fn push(&self, alert: Alert) {
        let mut q = self.lock();
        let id = alert.id.clone();
        if q.latest.insert(id.clone(), alert).is_none() {
            q.order.push_back(id);
        }
        self.ready.notify_one();
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }

    /// The oldest waiting alert; what is queued is delivered before `Closed` is reported.
    fn next(&self, wait: Duration) -> Next {
        let deadline = Instant::now() + wait;
        let mut q = self.lock();
        loop {
            if let Some(id) = q.order.pop_front() {
                if let Some(alert) = q.latest.remove(&id) {
                    return Next::Alert(Box::new(alert));
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

/// The running sinks.
#[derive(Debug)]
pub struct Sinks {
    queues: Vec<Arc<Queue>>,
    threads: Vec<JoinHandle<()>>,
}

impl Sinks {
    /// Starts one thread per configured receiver, each reconciled with `alerts` (the store's
    /// alerts now) against what it was told before the collector last stopped. Firing alerts
    /// `muted` picks (silenced) are not announced; the engine tells them when the silence ends.
    pub fn start(
        config: &SinkConfig,
        telemetry: Arc<SinkMetrics>,
        alerts: &[Alert],
        muted: &dyn Fn(&Alert) -> bool,
    ) -> Sinks {
        let mut queues = Vec::new();
        let mut threads = Vec::new();
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
                let told = record.as_deref().map(load_told).unwrap_or_default();
                let queue = Arc::new(Queue::default());
                for alert in reconcile(&told, alerts, config.clock.now_ms(), muted) {
                    queue.push(alert);
                }
                let worker = Worker {
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
                let rx = queue.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("rankwatch-{}", kind.as_str()))
                    .spawn(move || worker.run(&rx, told));
                match spawned {
                    Ok(handle) => {
                        threads.push(handle);
                        queues.push(queue);
                    }
                    Err(e) => {
                        tracing::error!(sink = kind.as_str(), error = %e, "could not start an alert sink")
                    }
                }
            }
        }
        Sinks { queues, threads }
    }

    /// Hands an alert to every sink without waiting.
    pub fn send(&self, alert: &Alert) {
        for queue in &self.queues {
            queue.push(alert.clone());
        }
    }

    /// Closes the queues and waits for the threads to deliver what they hold (each gives up
    /// after its attempts).
    pub fn shutdown(mut self) {
        for queue in self.queues.drain(..) {
            queue.close();
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// What a receiver must hear after a restart: alerts firing it was not told of, and the end of
/// those it was told fire that are resolved now or gone (their run deleted).
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

/// A receiver's record of what it was told; empty (with a warning) when missing or damaged.
fn load_told(path: &Path) -> BTreeMap<String, Alert> {
    let Ok(bytes) = std::fs::read(path) else {
        return BTreeMap::new();
    };
    match serde_json::from_slice::<Vec<StoredAlert>>(&bytes) {
        Ok(list) => list
            .into_iter()
            .map(StoredAlert::into_alert)
            .map(|a| (a.id.clone(), a))
            .collect(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "an alert receiver's record is unreadable; it may hear open alerts again");
            BTreeMap::new()
        }
    }
}

struct Worker {
    kind: SinkKind,
    url: String,
    config: SinkConfig,
    telemetry: Arc<SinkMetrics>,
    agent: ureq::Agent,
    /// Where what this receiver was told is kept.
    record: Option<PathBuf>,
}

impl Worker {
    fn run(self, rx: &Queue, mut told: BTreeMap<String, Alert>) {
        // What the receiver was last told, per alert id (Alertmanager: the firing set).
        let mut next_resend = Instant::now() + self.config.resend_interval;
        loop {
            let wait = next_resend.saturating_duration_since(Instant::now());
            match rx.next(wait) {
                Next::Alert(alert) => {
                    if self.deliver(*alert, &mut told) {
                        self.save(&told);
                    }
                }
                Next::Timeout => {
                    if self.kind == SinkKind::Alertmanager && !told.is_empty() {
                        let now = self.config.clock.now_ms();
                        let body: Vec<Value> = told
                            .values()
                            .map(|a| alertmanager_alert(a, &self.config.external_url, now))
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
    fn save(&self, told: &BTreeMap<String, Alert>) {
        let Some(path) = &self.record else {
            return;
        };
        let list: Vec<StoredAlert> = told.values().map(StoredAlert::new).collect();
        let written = serde_json::to_vec(&list)
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

    /// Delivers one alert state if the receiver should hear it; true when what it was told
    /// changed.
    fn deliver(&self, alert: Alert, told: &mut BTreeMap<String, Alert>) -> bool {
        match self.kind {
            SinkKind::Alertmanager => {
                let firing = alert.state == AlertState::Firing;
                let resolved = alert.state == AlertState::Resolved && told.contains_key(&alert.id);
                // Alertmanager deduplicates by labels itself: every firing state is posted.
                if !(firing || resolved) {
                    return false;
                }
                let body = alertmanager_alert(
                    &alert,
                    &self.config.external_url,
                    self.config.clock.now_ms(),
                );
                if !self.post(&json!([body])) {
                    return false;
                }
                if firing {
                    told.insert(alert.id.clone(), alert);
                } else {
                    told.remove(&alert.id);
                }
                true
            }
            SinkKind::Webhook | SinkKind::Slack => {
                if !worth_telling(&alert, told.get(&alert.id)) {
                    return false;
                }
                let body = match self.kind {
                    SinkKind::Slack => slack_payload(&alert, &self.config.external_url),
                    _ => webhook_payload(&alert),
                };
                if !self.post(&body) {
                    return false;
                }
                if alert.state == AlertState::Resolved {
                    told.remove(&alert.id);
                } else {
                    told.insert(alert.id.clone(), alert);
                }
                true
            }
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
            queue.push(alert(&format!("a{i}"), AlertState::Firing));
        }
        queue.push(alert("a5", AlertState::Resolved));
        queue.close();
        let mut seen = Vec::new();
        while let Next::Alert(a) = queue.next(Duration::from_millis(1)) {
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
    fn a_restarted_receiver_hears_what_it_missed_and_nothing_twice() {
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
        assert_eq!(
            out,
            [
                ("new-firing".to_owned(), AlertState::Firing),
                ("told-firing".to_owned(), AlertState::Firing),
                ("told-then-deleted".to_owned(), AlertState::Resolved),
                ("told-then-resolved".to_owned(), AlertState::Resolved),
            ]
        );
        // `told-firing` is queued, but a receiver told it already is not told again.
        assert!(!worth_telling(&now[0], told.get("told-firing")));
        assert!(worth_telling(&now[2], None));
    }

    #[test]
    fn the_record_of_what_was_told_round_trips_with_its_nan() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("webhook-0.json");
        let list = vec![StoredAlert::new(&alert("a", AlertState::Firing))];
        std::fs::write(&path, serde_json::to_vec(&list).unwrap()).unwrap();
        let told = load_told(&path);
        assert!(told["a"].value.is_nan());
        std::fs::write(&path, b"{damaged").unwrap();
        assert!(
            load_told(&path).is_empty(),
            "damaged: heard again rather than refused"
        );
        assert_ne!(fnv1a("https://a/x"), fnv1a("https://a/y"));
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

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_000_000_123), "2026-11-18T11:06:40.123Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }
}
