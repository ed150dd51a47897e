//! What the API takes on at once, so that no client — slow, greedy or hostile — can starve
//! the others or the collector's own work (flushes, the alert engine).
//!
//! Every bounded resource is a semaphore, and a request that finds one exhausted is answered
//! with 429 `busy` and a `Retry-After`, never queued without end:
//!
//! - **requests**: handlers running at once (event streams aside). A burst waits up to
//!   `queue_wait` for a slot, as VictoriaMetrics' `-maxConcurrentInserts` does, then is refused.
//! - **body bytes**: ingest bodies being read, decoded and committed at once, counted by their
//!   declared length before a byte is read. Decoding inflates a body several-fold, so this is
//!   what bounds ingest's transient memory whatever the number of ranks; the hot buffer has
//!   its own budget after that.
//! - **event streams**, **exports** and **SQL queries**: long-lived or heavy, so refused at
//!   once when all slots are taken rather than made to wait.
//!
//! Time is bounded too: a request body must arrive within `body_timeout` (408 `timeout`), the
//! request head within the server's header timeout (the connection is closed), and an export
//! whose client takes no data for `body_timeout` ends. Permits are held by the work itself —
//! moved into an export's thread, an event stream's closure — so they free exactly when the
//! work ends, however it ends.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::AppState;
pub use crate::config::AdmissionLimits;
use crate::error::{Error, Result};
use crate::telemetry::AdmissionGauges;

/// One bounded resource: its permits, the gauge of those in use, and the flag that sizes it.
#[derive(Debug)]
struct Pool {
    permits: Arc<Semaphore>,
    gauge: Gauge,
    /// What a refusal says is taken, e.g. "256 requests are being handled
    /// (--max-concurrent-requests)".
    full: String,
}

impl Pool {
    fn new(size: usize, gauge: &Gauge, full: String) -> Pool {
        // tokio's semaphore holds at most usize::MAX >> 3 permits.
        Pool {
            permits: Arc::new(Semaphore::new(size.min(Semaphore::MAX_PERMITS))),
            gauge: gauge.clone(),
            full,
        }
    }

    fn slot(&self, permit: OwnedSemaphorePermit, amount: usize) -> Slot {
        let amount = i64::try_from(amount).unwrap_or(i64::MAX);
        self.gauge.inc_by(amount);
        Slot {
            _permit: permit,
            gauge: self.gauge.clone(),
            amount,
        }
    }

    /// `amount` permits, waiting up to `wait` for them.
    async fn wait(&self, amount: usize, wait: Duration) -> Result<Slot> {
        let permits = u32::try_from(amount).unwrap_or(u32::MAX);
        let acquire = self.permits.clone().acquire_many_owned(permits);
        match tokio::time::timeout(wait, acquire).await {
            Ok(Ok(permit)) => Ok(self.slot(permit, amount)),
            // Closed: never happens (nothing closes these), but a refusal is the safe answer.
            Ok(Err(_)) | Err(_) => Err(Error::Busy(format!("{}; waited {wait:?}", self.full))),
        }
    }

    /// One permit, now or never.
    fn try_take(&self) -> Result<Slot> {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => Ok(self.slot(permit, 1)),
            Err(_) => Err(Error::Busy(self.full.clone())),
        }
    }
}

/// The API's bounded resources.
#[derive(Debug)]
pub(crate) struct Admission {
    limits: AdmissionLimits,
    requests: Pool,
    bytes: Pool,
    streams: Pool,
    exports: Pool,
    sql: Pool,
}

/// A held slot; its gauge goes back down when it is dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
    amount: i64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.dec_by(self.amount);
    }
}

impl Admission {
    /// The pools of `limits`, counting their slots in use on `gauges` (and event streams on
    /// `streams`).
    pub(crate) fn new(limits: AdmissionLimits, gauges: &AdmissionGauges, streams: &Gauge) -> Self {
        let l = limits;
        Admission {
            limits,
            requests: Pool::new(
                l.max_requests,
                &gauges.requests,
                format!(
                    "{} requests are being handled (--max-concurrent-requests)",
                    l.max_requests
                ),
            ),
            bytes: Pool::new(
                l.max_inflight_bytes,
                &gauges.body_bytes,
                format!(
                    "ingest bodies of {} bytes in all are being processed (--max-inflight-bytes)",
                    l.max_inflight_bytes
                ),
            ),
            streams: Pool::new(
                l.max_event_streams,
                streams,
                format!(
                    "{} event streams are open (--max-event-streams)",
                    l.max_event_streams
                ),
            ),
            exports: Pool::new(
                l.max_exports,
                &gauges.exports,
                format!(
                    "{} exports are running (--max-concurrent-exports)",
                    l.max_exports
                ),
            ),
            sql: Pool::new(
                l.max_sql,
                &gauges.sql,
                format!(
                    "{} SQL queries are running (--max-concurrent-sql)",
                    l.max_sql
                ),
            ),
        }
    }

    pub(crate) fn limits(&self) -> &AdmissionLimits {
        &self.limits
    }

    /// A handler slot, waiting up to `queue_wait` for one.
    pub(crate) async fn request(&self) -> Result<Slot> {
        self.requests.wait(1, self.limits.queue_wait).await
    }

    /// Room for an ingest body of `bytes`, waiting up to `queue_wait` for it.
    pub(crate) async fn body_bytes(&self, bytes: usize) -> Result<Slot> {
        let wanted = bytes.clamp(1, self.limits.max_inflight_bytes);
        self.bytes.wait(wanted, self.limits.queue_wait).await
    }

    /// An event-stream slot, now or never.
    pub(crate) fn event_stream(&self) -> Result<Slot> {
        self.streams.try_take()
    }

    /// An export slot, now or never.
    pub(crate) fn export(&self) -> Result<Slot> {
        self.exports.try_take()
    }

    /// A SQL slot, now or never.
    pub(crate) fn sql(&self) -> Result<Slot> {
        self.sql.try_take()
    }
}

/// Middleware: the request runs only while it holds a handler slot. The slot is released
/// when the handler has answered; a streamed body (an export) is bounded by its own slot.
pub(super) async fn admit(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let shared = &state.inner;
    match shared.admission.request().await {
        Ok(slot) => {
            let response = next.run(request).await;
            drop(slot);
            response
        }
        Err(e) => {
            shared.requests.reject(&e);
            e.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn limits() -> AdmissionLimits {
        AdmissionLimits {
            max_requests: 2,
            queue_wait: Duration::from_millis(50),
            max_inflight_bytes: 1000,
            max_event_streams: 1,
            max_exports: 1,
            max_sql: 1,
            body_timeout: Duration::from_secs(1),
        }
    }

    /// The pools of `limits()`, all counted on one gauge.
    fn admission() -> (Admission, Gauge) {
        let gauge = Gauge::default();
        let gauges = AdmissionGauges {
            requests: gauge.clone(),
            body_bytes: gauge.clone(),
            exports: gauge.clone(),
            sql: gauge.clone(),
        };
        (Admission::new(limits(), &gauges, &gauge), gauge)
    }

    #[tokio::test]
    async fn a_request_over_the_limit_waits_then_is_refused_naming_the_flag() {
        let (admission, gauge) = admission();
        let a = admission.request().await.unwrap();
        let _b = admission.request().await.unwrap();
        assert_eq!(gauge.get(), 2);
        let err = admission.request().await.unwrap_err();
        assert!(
            err.to_string().contains("--max-concurrent-requests"),
            "{err}"
        );
        assert_eq!(err.status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
        // A slot freed while a request waits is taken by it.
        let waiting = tokio::spawn(async move {
            let admission = admission;
            admission.request().await.map(|_| ())
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(a);
        waiting.await.unwrap().unwrap();
        assert_eq!(gauge.get(), 1, "the finished waiter's slot is back");
    }

    #[tokio::test]
    async fn body_bytes_are_counted_by_size_and_a_huge_claim_is_capped_at_the_budget() {
        let (admission, gauge) = admission();
        let a = admission.body_bytes(800).await.unwrap();
        assert_eq!(gauge.get(), 800);
        let err = admission.body_bytes(300).await.unwrap_err();
        assert!(err.to_string().contains("--max-inflight-bytes"), "{err}");
        let _b = admission.body_bytes(200).await.unwrap();
        drop(a);
        assert_eq!(gauge.get(), 200);
        // A claim over the whole budget waits for all of it, rather than for ever.
        let c = admission.body_bytes(0).await;
        assert!(c.is_ok(), "an empty body still takes one byte of room");
        drop(c);
        drop(_b);
        let _all = admission.body_bytes(1 << 40).await.unwrap();
        assert_eq!(gauge.get(), 1000);
    }

    #[test]
    fn streams_exports_and_sql_are_refused_at_once_when_taken() {
        let (admission, gauge) = admission();
        let s = admission.event_stream().unwrap();
        assert!(admission.event_stream().is_err());
        let e = admission.export().unwrap();
        let err = admission.export().unwrap_err();
        assert!(
            err.to_string().contains("--max-concurrent-exports"),
            "{err}"
        );
        let q = admission.sql().unwrap();
        assert!(admission.sql().is_err());
        drop((s, e, q));
        assert_eq!(gauge.get(), 0);
        assert!(admission.event_stream().is_ok());
    }
}
