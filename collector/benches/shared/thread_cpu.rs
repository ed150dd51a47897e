//! Criterion's measurement on the bench thread's CPU time, printed as wall time is: on a shared
//! machine other processes stretch wall time, not the CPU the measured code itself uses.
//! Shared by the collector's benches (`#[path = "shared/thread_cpu.rs"] mod thread_cpu;`).

use std::time::Duration;

use criterion::measurement::{Measurement, ValueFormatter, WallTime};

/// The calling thread's CPU time.
fn thread_cpu() -> Duration {
    cpu_time::ThreadTime::now().as_duration()
}

/// Criterion's measurement on [`thread_cpu`].
pub(crate) struct ThreadCpu;

static WALL: WallTime = WallTime;

impl Measurement for ThreadCpu {
    type Intermediate = Duration;
    type Value = Duration;

    fn start(&self) -> Duration {
        thread_cpu()
    }
    fn end(&self, started: Duration) -> Duration {
        thread_cpu() - started
    }
    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, value: &Duration) -> f64 {
        value.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        WALL.formatter()
    }
}
