//! One HTTP POST of one batch, and what its answer means for the batch.
//!
//! The collector's answers sort into three outcomes: **delivered** (200, `stored` or
//! `duplicate` — a duplicate means an earlier attempt landed), **retry** (no connection,
//! timeouts, 408, 409 "same key in flight", 429 backpressure with its `Retry-After`, 5xx, and
//! 401/403/404), and **refused** (any other 4xx: the collector named a problem with the batch
//! itself, and sending it again cannot help). Refused batches are counted and their reason
//! kept, never silent.
//!
//! 401, 403 and 404 say nothing about the batch: a missing or wrong ingest token, or a URL that
//! is not a collector's. Dropping rows for a configuration mistake would lose a run that a
//! corrected token or address (or `rankwatch.sync` of the spool) can still deliver, so they are
//! kept like any other delivery failure, with a reason that says what to fix.

use std::time::Duration;

use crate::spool::Batch;

/// What happened to one attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    Delivered {
        duplicate: bool,
    },
    Retry {
        after: Option<Duration>,
        reason: String,
    },
    Refused {
        status: u16,
        reason: String,
    },
}

/// A reusable HTTP client for one collector.
#[derive(Debug)]
pub(crate) struct Transport {
    agent: ureq::Agent,
    /// Its base URL, without a trailing slash.
    collector: String,
    authorization: Option<String>,
}

impl Transport {
    pub(crate) fn new(
        collector: &str,
        token: Option<&str>,
        connect_timeout: Duration,
    ) -> Transport {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(connect_timeout))
            .max_idle_connections_per_host(2)
            .build()
            .into();
        Transport {
            agent,
            collector: collector.trim_end_matches('/').to_owned(),
            authorization: token.map(|t| format!("Bearer {t}")),
        }
    }

    /// Posts `batch`, giving up on the attempt after `timeout`.
    pub(crate) fn post(&self, batch: &Batch, timeout: Duration) -> Outcome {
        let mut request = self.agent.post(format!(
            "{}{}",
            self.collector,
            crate::wire::ingest_path(batch.table)
        ));
        // With the release and protocol, so that a collector of another release refuses the
        // batch by name instead of misreading it (the refused batch is kept, see `sender`).
        for (name, value) in crate::wire::headers(&batch.key) {
            request = request.header(name, value);
        }
        if let Some(auth) = &self.authorization {
            request = request.header("authorization", auth);
        }
        let response = request
            .config()
            .timeout_global(Some(timeout))
            .build()
            .send(&batch.body[..]);
        let mut response = match response {
            Ok(r) => r,
            Err(e) => {
                return Outcome::Retry {
                    after: None,
                    reason: format!("collector unreachable: {e}"),
                };
            }
        };
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let text = response
            .body_mut()
            .with_config()
            .limit(64 * 1024)
            .read_to_string()
            .unwrap_or_default();
        let reason = || {
            serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_owned))
                .unwrap_or_else(|| text.chars().take(300).collect())
        };
        match status {
            200..=299 => Outcome::Delivered {
                duplicate: text.contains("\"duplicate\""),
            },
            408 | 409 | 429 | 500..=599 => Outcome::Retry {
                after: retry_after,
                reason: format!("collector answered {status}: {}", reason()),
            },
            401 | 403 => Outcome::Retry {
                after: None,
                reason: format!(
                    "collector answered {status} ({}): set the ingest token (RANKWATCH_INGEST_TOKEN \
                     or token=); the rows are kept in the spool",
                    reason()
                ),
            },
            404 => Outcome::Retry {
                after: None,
                reason: format!(
                    "collector answered 404 for {}/api/v1/ingest: is the collector URL the \
                     collector's base address (e.g. http://127.0.0.1:7070)? The rows are kept in \
                     the spool",
                    self.collector
                ),
            },
            _ => Outcome::Refused {
                status,
                reason: format!("collector refused a batch ({status}): {}", reason()),
            },
        }
    }
}
