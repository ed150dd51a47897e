//! The alert feed: the collector's alerts for this run, brought back to the training process.
//!
//! A thread of its own polls `GET /api/v1/runs/<run>/alerts/feed?after=<revision>` (with the
//! ingest token) every `interval` and queues each alert change worth telling — an alert that
//! fires, escalates, or resolves after firing; pending ones stay in the collector — for the
//! training thread to take at its own pace ([`AlertFeed::take`]; the SDK calls the user's
//! callbacks from `run.log`). The training thread never waits on the network: taking is a lock
//! and a swap. A collector that is away costs a failed poll and a retry at the next interval.
//! A restarted collector numbers its revisions afresh (a new `epoch`): the feed starts again
//! from zero and skips what it already told, by (id, state, severity). The queue is bounded;
//! when the training thread does not take, the oldest changes are dropped and counted.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rankwatch_api::{Alert, AlertState, Severity};

/// Alert changes kept for the training thread before the oldest are dropped.
const QUEUE: usize = 1024;

#[derive(Debug, Default)]
struct Shared {
    queue: Mutex<VecDeque<Alert>>,
    stop: Mutex<bool>,
    wake: Condvar,
    dropped: AtomicU64,
    polls_failed: AtomicU64,
    connected: AtomicBool,
}

/// A running feed.
#[derive(Debug)]
pub struct AlertFeed {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl AlertFeed {
    /// Starts polling `collector` for `run`'s alerts.
    pub fn start(
        collector: &str,
        run: &str,
        token: Option<&str>,
        interval: Duration,
    ) -> std::io::Result<AlertFeed> {
        let shared = Arc::new(Shared::default());
        let poller = Poller {
            url: format!(
                "{}/api/v1/runs/{run}/alerts/feed",
                collector.trim_end_matches('/')
            ),
            authorization: token.map(|t| format!("Bearer {t}")),
            interval,
            shared: shared.clone(),
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(Duration::from_secs(5)))
                .build()
                .into(),
        };
        let thread = std::thread::Builder::new()
            .name("rankwatch-alerts".into())
            .spawn(move || poller.run())?;
        Ok(AlertFeed {
            shared,
            thread: Some(thread),
        })
    }

    /// The alert changes received since the last call, oldest first.
    pub fn take(&self) -> Vec<Alert> {
        let mut queue = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        queue.drain(..).collect()
    }

    /// Changes dropped because nobody took them in time.
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Relaxed)
    }

    /// Polls that failed (collector away, refused, unreadable answer).
    pub fn failed_polls(&self) -> u64 {
        self.shared.polls_failed.load(Relaxed)
    }

    /// Whether the last poll succeeded.
    pub fn connected(&self) -> bool {
        self.shared.connected.load(Relaxed)
    }

    /// Stops the thread (it finishes its current poll, at most a few seconds).
    pub fn stop(&mut self) {
        *self.shared.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.shared.wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for AlertFeed {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Poller {
    url: String,
    authorization: Option<String>,
    interval: Duration,
    shared: Arc<Shared>,
    agent: ureq::Agent,
}

impl Poller {
    fn run(self) {
        let mut epoch: Option<i64> = None;
        let mut after = 0u64;
        let mut told: HashSet<(String, AlertState, Severity)> = HashSet::new();
        loop {
            match self.poll(after) {
                Ok(answer) => {
                    self.shared.connected.store(true, Relaxed);
                    let this_epoch = Some(answer.epoch);
                    if this_epoch != epoch {
                        epoch = this_epoch;
                        if after != 0 {
                            // Revisions started again: read from the beginning once more.
                            after = 0;
                            continue;
                        }
                    }
                    after = answer.revision;
                    for alert in answer.alerts {
                        self.offer(alert, &mut told);
                    }
                }
                Err(_) => {
                    self.shared.connected.store(false, Relaxed);
                    self.shared.polls_failed.fetch_add(1, Relaxed);
                }
            }
            let stop = self.shared.stop.lock().unwrap_or_else(|p| p.into_inner());
            let (stop, _) = self
                .shared
                .wake
                .wait_timeout_while(stop, self.interval, |s| !*s)
                .unwrap_or_else(|p| p.into_inner());
            if *stop {
                return;
            }
        }
    }

    fn poll(&self, after: u64) -> Result<rankwatch_api::AlertFeed, String> {
        let mut request = self.agent.get(format!("{}?after={after}", self.url));
        if let Some(auth) = &self.authorization {
            request = request.header("authorization", auth);
        }
        let mut response = request.call().map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("collector answered {}", response.status()));
        }
        response
            .body_mut()
            .read_json::<rankwatch_api::AlertFeed>()
            .map_err(|e| e.to_string())
    }

    fn offer(&self, alert: Alert, told: &mut HashSet<(String, AlertState, Severity)>) {
        let untold = match alert.state {
            AlertState::Pending => false,
            // A pending alert that cleared never fired: nothing to tell.
            AlertState::Resolved => alert.has_fired(),
            AlertState::Firing => true,
        };
        if !untold || !told.insert((alert.id.clone(), alert.state, alert.severity)) {
            return;
        }
        let mut queue = self.shared.queue.lock().unwrap_or_else(|p| p.into_inner());
        if queue.len() >= QUEUE {
            queue.pop_front();
            self.shared.dropped.fetch_add(1, Relaxed);
        }
        queue.push_back(alert);
    }
}
