//! Alert delivery to the outside: a generic JSON webhook, Slack incoming webhooks and
//! Prometheus Alertmanager. (The UI's server-sent events and the training process's feed read
//! the store directly.)
//!
//! Each configured endpoint has its own thread and bounded queue, so a slow or dead receiver
//! delays only itself and never ingest: the alert engine hands an alert over with a `try_send`,
//! and an alert that finds the queue full is dropped and counted. A failed POST is retried with
//! exponential backoff (0.5 s doubling to 30 s) up to `max_attempts`; what still fails is
//! counted and logged. Webhooks and Slack hear about an alert when it fires, when it escalates
//! while firing, and when a fired alert resolves (pending alerts stay inside the collector).
//! Alertmanager expects to be told again while an alert fires, so its thread keeps the firing
//! set and re-posts it every `resend_interval`; a resolution is posted with `endsAt`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rankwatch_analytics::{Alert, AlertState};
use serde_json::{Value, json};

use crate::Labels;
use crate::clock::SharedClock;

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
             (delivered, retried, failed, dropped)",
            self.notifications.clone(),
        );
    }
}

/// The running sinks.
#[derive(Debug)]
pub struct Sinks {
    queues: Vec<(SinkKind, String, SyncSender<Alert>)>,
    threads: Vec<JoinHandle<()>>,
    telemetry: Arc<SinkMetrics>,
}

const QUEUE: usize = 1024;

impl Sinks {
    /// Starts one thread per configured receiver.
    pub fn start(config: &SinkConfig, telemetry: Arc<SinkMetrics>) -> Sinks {
        let mut queues = Vec::new();
        let mut threads = Vec::new();
        let targets = [
            (SinkKind::Webhook, &config.webhooks),
            (SinkKind::Slack, &config.slack),
            (SinkKind::Alertmanager, &config.alertmanagers),
        ];
        for (kind, urls) in targets {
            for url in urls {
                let (tx, rx) = sync_channel(QUEUE);
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
                };
                let spawned = std::thread::Builder::new()
                    .name(format!("rankwatch-{}", kind.as_str()))
                    .spawn(move || worker.run(rx));
                match spawned {
                    Ok(handle) => {
                        threads.push(handle);
                        queues.push((kind, url.clone(), tx));
                    }
                    Err(e) => {
                        tracing::error!(sink = kind.as_str(), error = %e, "could not start an alert sink")
                    }
                }
            }
        }
        Sinks {
            queues,
            threads,
            telemetry,
        }
    }

    /// Hands an alert to every sink without waiting.
    pub fn send(&self, alert: &Alert) {
        for (kind, url, queue) in &self.queues {
            match queue.try_send(alert.clone()) {
                Ok(()) => {}
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                    let url = redact_url(url);
                    tracing::warn!(sink = kind.as_str(), %url, id = %alert.id, "alert sink queue full; alert dropped");
                    self.telemetry.notification(*kind, "dropped");
                }
            }
        }
    }

    /// Closes the queues and waits for the threads to deliver what they hold (each gives up
    /// after its attempts).
    pub fn shutdown(mut self) {
        self.queues.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

struct Worker {
    kind: SinkKind,
    url: String,
    config: SinkConfig,
    telemetry: Arc<SinkMetrics>,
    agent: ureq::Agent,
}

impl Worker {
    fn run(self, rx: Receiver<Alert>) {
        // What each receiver was last told, per alert id (Alertmanager: the firing set).
        let mut told: BTreeMap<String, Alert> = BTreeMap::new();
        let mut next_resend = Instant::now() + self.config.resend_interval;
        loop {
            let wait = next_resend.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(alert) => self.deliver(alert, &mut told),
                Err(RecvTimeoutError::Timeout) => {
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
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn deliver(&self, alert: Alert, told: &mut BTreeMap<String, Alert>) {
        match self.kind {
            SinkKind::Alertmanager => {
                let firing = alert.state == AlertState::Firing;
                let resolved = alert.state == AlertState::Resolved && told.contains_key(&alert.id);
                if !(firing || resolved) {
                    return;
                }
                let body = alertmanager_alert(
                    &alert,
                    &self.config.external_url,
                    self.config.clock.now_ms(),
                );
                self.post(&json!([body]));
                if firing {
                    told.insert(alert.id.clone(), alert);
                } else {
                    told.remove(&alert.id);
                }
            }
            SinkKind::Webhook | SinkKind::Slack => {
                if !worth_telling(&alert, told.get(&alert.id)) {
                    return;
                }
                let body = match self.kind {
                    SinkKind::Slack => slack_payload(&alert, &self.config.external_url),
                    _ => webhook_payload(&alert),
                };
                self.post(&body);
                if alert.state == AlertState::Resolved {
                    told.remove(&alert.id);
                } else {
                    told.insert(alert.id.clone(), alert);
                }
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
    use super::{redact_url, rfc3339};

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
