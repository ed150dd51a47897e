//! What each kind of receiver is sent: the generic webhook's JSON and Slack's message carry one
//! incident change each ([`Message`]); Alertmanager gets alerts, labelled with their incident so
//! that its own grouping (`group_by: [incident]`) makes one notification per incident.

use rankwatch_analytics::{Alert, AlertState, Severity};
use serde_json::{Value, json};

use super::told::{Event, Message};

/// The dashboard's page for a run, where the incident's bands and alerts are.
fn run_link(external_url: &str, run: &str) -> String {
    format!("{}/runs/{run}", external_url.trim_end_matches('/'))
}

/// One line: what happened to the incident, how bad, where, and why.
pub fn incident_line(m: &Message) -> String {
    let event = m.event.map_or("changed", Event::as_str);
    let n = &m.note;
    let mut line = format!(
        "[{event}] {} incident on run {}: {}",
        n.severity.as_str(),
        n.run,
        n.summary
    );
    if m.event == Some(Event::Updated) && !m.why.is_empty() {
        line.push_str(&format!(" ({})", m.why));
    }
    line
}

/// The generic webhook body (version 2): the event, the incident as told, the ids it absorbed,
/// a one-line text and a link.
pub fn webhook_payload(m: &Message, external_url: &str) -> Value {
    json!({
        "version": 2,
        "source": "rankwatch",
        "event": m.event.map_or("changed", Event::as_str),
        "status": m.note.state.as_str(),
        "text": incident_line(m),
        "why": m.why,
        "merged": m.merged,
        "incident": m.note,
        "url": run_link(external_url, &m.note.run),
    })
}

/// A Slack incoming-webhook body: the line, then a colour-coded attachment with where it struck,
/// the evidence and the suggested action.
pub fn slack_payload(m: &Message, external_url: &str) -> Value {
    let n = &m.note;
    let colour = match (n.state, n.severity) {
        (AlertState::Resolved, _) => "#2eb67d",
        (_, Severity::Critical) => "#e01e5a",
        (_, Severity::Warning) => "#ecb22e",
        _ => "#36c5f0",
    };
    let list = |values: &[u32]| {
        values
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut fields = vec![
        json!({"title": "run", "value": n.run, "short": true}),
        json!({"title": "steps", "value": format!("{}–{}", n.first_step, n.last_step), "short": true}),
    ];
    if n.every_rank {
        fields.push(json!({"title": "ranks", "value": "every rank", "short": true}));
    } else if !n.ranks.is_empty() {
        fields.push(json!({"title": "ranks", "value": list(&n.ranks), "short": true}));
    }
    if !n.layers.is_empty() {
        fields.push(json!({"title": "layers", "value": list(&n.layers), "short": true}));
    }
    fields.push(json!({"title": "evidence", "value": n.evidence, "short": false}));
    if n.state != AlertState::Resolved {
        fields.push(json!({"title": "what to do", "value": n.action, "short": false}));
    }
    if !m.merged.is_empty() {
        fields.push(json!({"title": "merged", "value": m.merged.join(", "), "short": false}));
    }
    let rules: Vec<&str> = n.rules.iter().map(|r| r.as_str()).collect();
    json!({
        "text": format!("*rankwatch* {}", incident_line(m)),
        "attachments": [{
            "color": colour,
            "title": format!("{} · {} · {} alert(s)", rules.join(" → "), n.severity.as_str(), n.alerts.len()),
            "title_link": run_link(external_url, &n.run),
            "text": n.summary,
            "fields": fields,
        }],
    })
}

/// One Alertmanager alert (`POST /api/v2/alerts` takes an array of these), labelled with the
/// incident it belongs to; `ends_at_ms` ends it (a resolution, or the old label set of an alert
/// that moved to another incident).
pub fn alertmanager_alert(
    alert: &Alert,
    incident: Option<&str>,
    external_url: &str,
    ends_at_ms: Option<i64>,
) -> Value {
    let mut labels = serde_json::Map::new();
    labels.insert(
        "alertname".into(),
        json!(format!("rankwatch_{}", alert.rule.as_str())),
    );
    labels.insert("run".into(), json!(alert.run.as_str()));
    labels.insert("rule".into(), json!(alert.rule.as_str()));
    labels.insert("severity".into(), json!(alert.severity.as_str()));
    if let Some(incident) = incident {
        labels.insert("incident".into(), json!(incident));
    }
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
            "summary": format!(
                "{} {} on run {}: {}",
                alert.severity.as_str(),
                alert.rule.as_str(),
                alert.run,
                alert.explanation
            ),
            "description": alert.explanation,
            "value": alert.value.to_string(),
            "threshold": alert.threshold.to_string(),
            "steps": format!("{}-{}", alert.first_step, alert.last_step),
        },
        "startsAt": rfc3339(started),
        "generatorURL": run_link(external_url, alert.run.as_str()),
    });
    if let Some(ends) = ends_at_ms {
        body["endsAt"] = json!(rfc3339(ends));
    }
    body
}

/// Milliseconds since the epoch as RFC 3339 UTC (what Alertmanager's `startsAt` takes).
pub(super) fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_000_000_123), "2026-11-18T11:06:40.123Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }
}
