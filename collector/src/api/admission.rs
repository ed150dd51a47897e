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

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::AppState;
pub use crate::config::AdmissionLimits;
use crate::error::{Error, Result};

/// The semaphores, and gauges of what holds them.
#[derive(Debug)]
pub(crate) struct Admission {
    limits: AdmissionLimits,
    requests: Arc<Semaphore>,
    bytes: Arc<Semaphore>,
    streams: Arc<Semaphore>,
    exports: Arc<Semaphore>,
    sql: Arc<Semaphore>,
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
    pub(crate) fn new(limits: AdmissionLimits) -> Self {
        // tokio's semaphore holds at most usize::MAX >> 3 permits.
        let bytes = limits.max_inflight_bytes.min(Semaphore::MAX_PERMITS);
        Admission {
            limits,
            requests: Arc::new(Semaphore::new(limits.max_requests)),
            bytes: Arc::new(Semaphore::new(bytes)),
            streams: Arc::new(Semaphore::new(limits.max_event_streams)),
            exports: Arc::new(Semaphore::new(limits.max_exports)),
            sql: Arc::new(Semaphore::new(limits.max_sql)),
        }
    }

    pub(crate) fn limits(&self) -> &AdmissionLimits {
        &self.limits
    }

    /// A handler slot, waiting up to `queue_wait` for one.
    pub(crate) async fn request(&self, gauge: &Gauge) -> Result<Slot> {
        self.wait(&self.requests, 1, gauge, || {
            format!(
                "{} requests are being handled (--max-concurrent-requests)",
                self.limits.max_requests
            )
        })
        .await
    }

    /// Room for an ingest body of `bytes`, waiting up to `queue_wait` for it.
    pub(crate) async fn body_bytes(&self, bytes: usize, gauge: &Gauge) -> Result<Slot> {
        let wanted = bytes.clamp(1, self.limits.max_inflight_bytes);
        self.wait(&self.bytes, wanted, gauge, || {
            format!(
                "ingest bodies of {} bytes in all are being processed (--max-inflight-bytes)",
                self.limits.max_inflight_bytes
            )
        })
        .await
    }

    /// An event-stream slot, now or never.
    pub(crate) fn event_stream(&self, gauge: &Gauge) -> Result<Slot> {
        try_take(&self.streams, gauge, || {
            format!(
                "{} event streams are open (--max-event-streams)",
                self.limits.max_event_streams
            )
        })
    }

    /// An export slot, now or never.
    pub(crate) fn export(&self, gauge: &Gauge) -> Result<Slot> {
        try_take(&self.exports, gauge, || {
            format!(
                "{} exports are running (--max-concurrent-exports)",
                self.limits.max_exports
            )
        })
    }

    /// A SQL slot, now or never.
    pub(crate) fn sql(&self, gauge: &Gauge) -> Result<Slot> {
        try_take(&self.sql, gauge, || {
            format!(
                "{} SQL queries are running (--max-concurrent-sql)",
                self.limits.max_sql
            )
        })
    }

    async fn wait(
        &self,
        semaphore: &Arc<Semaphore>,
        amount: usize,
        gauge: &Gauge,
        what: impl FnOnce() -> String,
    ) -> Result<Slot> {
        let permits = u32::try_from(amount).unwrap_or(u32::MAX);
        let acquire = semaphore.clone().acquire_many_owned(permits);
        match tokio::time::timeout(self.limits.queue_wait, acquire).await {
            Ok(Ok(permit)) => Ok(slot(permit, gauge, amount)),
            // Closed: never happens (nothing closes these), but a refusal is the safe answer.
            Ok(Err(_)) | Err(_) => Err(Error::Busy(format!(
                "{}; waited {:?}",
                what(),
                self.limits.queue_wait
            ))),
        }
    }
}

fn try_take(
    semaphore: &Arc<Semaphore>,
    gauge: &Gauge,
    what: impl FnOnce() -> String,
) -> Result<Slot> {
    match semaphore.clone().try_acquire_owned() {
        Ok(permit) => Ok(slot(permit, gauge, 1)),
        Err(_) => Err(Error::Busy(what())),
    }
}

fn slot(permit: OwnedSemaphorePermit, gauge: &Gauge, amount: usize) -> Slot {
    let amount = i64::try_from(amount).unwrap_or(i64::MAX);
    gauge.inc_by(amount);
    Slot {
        _permit: permit,
        gauge: gauge.clone(),
        amount,
    }
}

/// Middleware: the request runs only while it holds a handler slot. The slot is released
/// when the handler has answered; a streamed body (an export) is bounded by its own slot.
pub(super) async fn admit(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let shared = &state.inner;
    match shared
        .admission
        .request(&shared.requests.admission.requests)
        .await
    {
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

    #[tokio::test]
    async fn a_request_over_the_limit_waits_then_is_refused_naming_the_flag() {
        let admission = Admission::new(limits());
        let gauge = Gauge::default();
        let a = admission.request(&gauge).await.unwrap();
        let _b = admission.request(&gauge).await.unwrap();
        assert_eq!(gauge.get(), 2);
        let err = admission.request(&gauge).await.unwrap_err();
        assert!(
            err.to_string().contains("--max-concurrent-requests"),
            "{err}"
        );
        assert_eq!(err.status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
        // A slot freed while a request waits is taken by it.
        let waiting = tokio::spawn({
            let gauge = gauge.clone();
            async move {
                let admission = admission;
                admission.request(&gauge).await.map(|_| ())
            }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(a);
        waiting.await.unwrap().unwrap();
        assert_eq!(gauge.get(), 1, "the finished waiter's slot is back");
    }

    #[tokio::test]
    async fn body_bytes_are_counted_by_size_and_a_huge_claim_is_capped_at_the_budget() {
        let admission = Admission::new(limits());
        let gauge = Gauge::default();
        let a = admission.body_bytes(800, &gauge).await.unwrap();
        assert_eq!(gauge.get(), 800);
        let err = admission.body_bytes(300, &gauge).await.unwrap_err();
        assert!(err.to_string().contains("--max-inflight-bytes"), "{err}");
        let _b = admission.body_bytes(200, &gauge).await.unwrap();
        drop(a);
        assert_eq!(gauge.get(), 200);
        // A claim over the whole budget waits for all of it, rather than for ever.
        let c = admission.body_bytes(0, &gauge).await;
        assert!(c.is_ok(), "an empty body still takes one byte of room");
        drop(c);
        drop(_b);
        let _all = admission.body_bytes(1 << 40, &gauge).await.unwrap();
        assert_eq!(gauge.get(), 1000);
    }

    #[test]
    fn streams_exports_and_sql_are_refused_at_once_when_taken() {
        let admission = Admission::new(limits());
        let gauge = Gauge::default();
        let s = admission.event_stream(&gauge).unwrap();
        assert!(admission.event_stream(&gauge).is_err());
        let e = admission.export(&gauge).unwrap();
        let err = admission.export(&gauge).unwrap_err();
        assert!(
            err.to_string().contains("--max-concurrent-exports"),
            "{err}"
        );
        let q = admission.sql(&gauge).unwrap();
        assert!(admission.sql(&gauge).is_err());
        drop((s, e, q));
        assert_eq!(gauge.get(), 0);
        assert!(admission.event_stream(&gauge).is_ok());
    }
}
