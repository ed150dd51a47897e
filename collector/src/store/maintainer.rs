//! The maintenance thread: flushes, compactions and deletions run on one thread of their own,
//! at a lower scheduling priority than ingest and the alert engine.
//!
//! # Why
//!
//! A flush of a full hot buffer is most of a second of CPU (sort, Parquet, rollups). On a
//! loaded core it competed as an equal with the runtime's worker, so the alert engine fell
//! behind while it ran: in `ingest-floor` (all on one pinned core) alert latency p99 was
//! 1,438 ms with flushes against 249 ms without (docs/performance.md). The flush is the one
//! duty here that can wait: its rows are durable in the log and readable in memory meanwhile.
//! So it runs niced ([`NICE`]), taking the CPU the others leave; its work is the same and
//! counted the same.
//!
//! It cannot be starved for good: at twice the hot budget ingest refuses new batches
//! (`admit`), which leaves the core to the flush until it ends.
//!
//! One thread is enough because maintenance is serialised anyway (`Store::under_maintenance`
//! holds its lock across a job). A job that panics is an error for its caller, and the thread
//! goes on with the next one. The thread ends when the store is dropped.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Mutex, mpsc};

use crate::error::{Error, Result};

/// The maintenance thread's nice value (Linux: 0 is the default, 19 the least priority). At
/// 10 a busy thread of the default priority gets about nine tenths of a shared core (CFS
/// weights 1024 against 110).
pub const NICE: i32 = 10;

type Job = Box<dyn FnOnce() + Send>;

/// The sending end of the maintenance thread's queue.
#[derive(Debug)]
pub(super) struct Maintainer {
    jobs: Mutex<mpsc::Sender<Job>>,
}

impl Maintainer {
    /// Starts the thread.
    pub(super) fn start() -> Result<Self> {
        let (jobs, queue) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("rankwatch-maintenance".into())
            .spawn(move || {
                lower_priority();
                // Ends when the store (the sender) is dropped.
                for job in queue {
                    job();
                }
            })
            .map_err(|e| Error::Unavailable(format!("starting the maintenance thread: {e}")))?;
        Ok(Maintainer {
            jobs: Mutex::new(jobs),
        })
    }

    /// Runs `work` on the maintenance thread; a panic in it is an error naming `what`.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        what: &str,
        work: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let (done, answer) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move || {
            let outcome = catch_unwind(AssertUnwindSafe(work));
            let _ = done.send(outcome);
        });
        let sent = self
            .jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .send(job);
        if sent.is_err() {
            return Err(Error::Unavailable(format!(
                "{what}: the maintenance thread has stopped"
            )));
        }
        match answer.await {
            Ok(Ok(result)) => result,
            Ok(Err(panic)) => Err(Error::Unavailable(format!(
                "{what} task failed: {}",
                panic_message(panic.as_ref())
            ))),
            Err(_) => Err(Error::Unavailable(format!(
                "{what}: the maintenance thread has stopped"
            ))),
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "it panicked".into())
}

/// Lowers the calling thread's priority to [`NICE`] unless it is lower already (a thread's own nice value on Linux,
/// where `setpriority` with a thread id affects that thread alone). Failing (a sandbox that
/// forbids it) costs alert latency under load, not correctness: a warning.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        let thread = rustix::thread::gettid();
        // A process started niced already keeps its own, lower priority.
        if current_nice().is_some_and(|nice| nice >= NICE) {
            return;
        }
        if let Err(e) = rustix::process::setpriority_process(Some(thread), NICE) {
            tracing::warn!(error = %e, nice = NICE, "could not lower the maintenance thread's priority");
        }
    }
}

/// The calling thread's nice value (Linux), for tests and diagnostics.
#[cfg(target_os = "linux")]
pub fn current_nice() -> Option<i32> {
    rustix::process::getpriority_process(Some(rustix::thread::gettid())).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn jobs_run_niced_and_a_panic_is_an_error_that_leaves_the_thread_serving() {
        let maintainer = Maintainer::start().expect("thread started");
        #[cfg(target_os = "linux")]
        {
            let ours = current_nice().expect("our nice value");
            let theirs = maintainer
                .run("probe", || Ok(current_nice()))
                .await
                .expect("ran");
            // Raising one's own nice value needs no privilege, so this holds for any user.
            assert_eq!(theirs, Some(NICE.max(ours)), "ours is {ours}");
        }
        let err = maintainer
            .run::<()>("flush", || panic!("a broken part"))
            .await
            .expect_err("a panic is an error");
        let text = err.to_string();
        assert!(
            text.contains("flush task failed") && text.contains("a broken part"),
            "{text}"
        );
        let name = maintainer
            .run("probe", || {
                Ok(std::thread::current().name().map(str::to_owned))
            })
            .await
            .expect("the thread still serves after a panic");
        assert_eq!(name.as_deref(), Some("rankwatch-maintenance"));
    }

    #[tokio::test]
    async fn a_job_gets_its_own_error_back() {
        let maintainer = Maintainer::start().expect("thread started");
        let err = maintainer
            .run::<()>("deletion", || Err(Error::Unavailable("disk gone".into())))
            .await
            .expect_err("the job's error");
        assert!(err.to_string().contains("disk gone"), "{err}");
    }
}
