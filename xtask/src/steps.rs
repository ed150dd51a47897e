//! Running commands and keeping count: each step echoed, timed and recorded for the stage
//! table; cargo's and pytest's result lines tallied; independent suites' failures gathered.

use super::*;

/// Test counts summed over runners.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Tally {
    pub(crate) passed: u64,
    pub(crate) failed: u64,
    pub(crate) skipped: u64,
}

impl Tally {
    /// Adds another runner's counts.
    pub(crate) fn merge(&mut self, other: Tally) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.skipped += other.skipped;
    }

    /// Adds the counts of a pytest summary line (`==== 5 passed, 1 skipped in 3.2s ====`).
    pub(crate) fn add_pytest_line(&mut self, line: &str) {
        let line = line.trim().trim_matches('=').trim();
        if !line.contains(" in ") {
            return;
        }
        for part in line.split(',') {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next())
                && let Ok(n) = n.parse::<u64>()
            {
                match what {
                    "passed" => self.passed += n,
                    "failed" | "error" | "errors" => self.failed += n,
                    "skipped" | "xfailed" => self.skipped += n,
                    _ => {}
                }
            }
        }
    }

    /// Adds the counts of a cargo `test result: ok. 9 passed; 0 failed; 1 ignored; ...` line.
    pub(crate) fn add_cargo_line(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split([';', '.']) {
            let mut words = part.split_whitespace();
            if let (Some(n), Some(what)) = (words.next(), words.next())
                && let Ok(n) = n.parse::<u64>()
            {
                match what {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    "ignored" => self.skipped += n,
                    _ => {}
                }
            }
        }
    }
}

/// Runs `cmd`, echoing it, and fails with its exit status. With a tally, its stdout is passed
/// through line by line and cargo's test result lines are counted.
pub(crate) fn run_with(step: &str, cmd: Command, tally: Option<&mut Tally>) -> Result<()> {
    run_counting(step, cmd, tally, Tally::add_cargo_line)
}

pub(crate) fn run_counting(
    step: &str,
    cmd: Command,
    tally: Option<&mut Tally>,
    count: fn(&mut Tally, &str),
) -> Result<()> {
    match tally {
        Some(tally) => run_reading(
            step,
            cmd,
            Some(&mut |line: &str| {
                count(tally, line);
                true
            }),
        ),
        None => run_reading(step, cmd, None),
    }
}

/// Runs `cmd`, echoing it, and fails with its exit status. With `read`, its stdout is read
/// line by line: each line goes to `read`, and is passed through when `read` says so.
pub(crate) fn run_reading(
    step: &str,
    mut cmd: Command,
    mut read: Option<&mut dyn FnMut(&str) -> bool>,
) -> Result<()> {
    // A step on a side lane runs beside the main line: its output is held and printed in one
    // block when it ends, so the two never interleave line by line.
    let side = on_side_lane();
    let mut held = String::new();
    let mut say = |line: &str| {
        if side {
            held.push_str(line);
            held.push('\n');
        } else {
            println!("{line}");
        }
    };
    say(&format!("\n==> {step}: {cmd:?}"));
    let started = Instant::now();
    if read.is_some() || side {
        cmd.stdout(Stdio::piped());
    }
    let mut child = cmd
        .spawn()
        .with_context(|| format!("{step}: could not start {cmd:?}"))?;
    let mut explaining = FailureLines::default();
    if let Some(stdout) = child.stdout.take() {
        // Lossy: a line that is not UTF-8 must not end the reading early, which would leave
        // the child running beside the next step.
        for line in BufReader::new(stdout).split(b'\n') {
            let Ok(bytes) = line else { break };
            let line = String::from_utf8_lossy(bytes.strip_suffix(b"\r").unwrap_or(&bytes));
            explaining.read(&line);
            if read.as_mut().is_none_or(|read| read(&line)) {
                say(&line);
            }
        }
    }
    let status = child.wait()?;
    let seconds = started.elapsed().as_secs_f64();
    record_stage(step, seconds, status.success());
    if status.success() {
        say(&format!("==> {step}: ok in {seconds:.1}s"));
    }
    if side {
        print!("{held}");
    }
    if !status.success() {
        record_failure(step, &explaining);
        bail!("{step} failed ({status})");
    }
    Ok(())
}

/// One step this process ran, for the stage table.
pub(crate) struct Stage {
    name: String,
    /// Seconds into the run when it started.
    start: f64,
    seconds: f64,
    ok: bool,
}

/// Every step this process ran.
pub(crate) static STAGES: Mutex<Vec<Stage>> = Mutex::new(Vec::new());

/// When the run started: stages are placed against it, so the table shows which ran beside
/// which (two lanes on two cores; a stage that waits leaves a core to the other lane).
pub(crate) static RUN_STARTED: std::sync::LazyLock<Instant> =
    std::sync::LazyLock::new(Instant::now);

/// Background steps (run while the main line compiles) are marked, and left out of the sum.
pub(crate) const BACKGROUND: &str = "(background) ";

/// Whether this thread is a side lane (anything but the main thread): its steps run beside
/// the main line.
pub(crate) fn on_side_lane() -> bool {
    std::thread::current().name() != Some("main")
}

pub(crate) fn record_stage(step: &str, seconds: f64, ok: bool) {
    let name = if on_side_lane() {
        format!("{BACKGROUND}{step}")
    } else {
        step.to_owned()
    };
    let start = (RUN_STARTED.elapsed().as_secs_f64() - seconds).max(0.0);
    if let Ok(mut stages) = STAGES.lock() {
        stages.push(Stage {
            name,
            start,
            seconds,
            ok,
        });
    }
}

/// The stage table: where the run's time went, up to now.
pub(crate) fn print_stages() {
    let total = RUN_STARTED.elapsed().as_secs_f64();
    let Ok(stages) = STAGES.lock() else {
        return;
    };
    let width = stages
        .iter()
        .map(|s| s.name.len())
        .max()
        .unwrap_or(5)
        .max(5);
    println!(
        "\n{:<width$}  {:>7}  {:>8}  {:>6}",
        "stage", "from s", "seconds", "share"
    );
    for Stage {
        name,
        start,
        seconds,
        ok,
    } in stages.iter()
    {
        let mark = if *ok { "" } else { "  FAILED" };
        println!(
            "{name:<width$}  {start:>7.0}  {seconds:>8.1}  {:>5.1}%{mark}",
            100.0 * seconds / total.max(1e-9)
        );
    }
    let counted: f64 = stages
        .iter()
        .filter(|s| !s.name.starts_with(BACKGROUND))
        .map(|s| s.seconds)
        .sum();
    println!(
        "{:<width$}  {:>7}  {:>8.1}  {:>5.1}%",
        "(between stages)",
        "",
        total - counted,
        100.0 * (total - counted) / total.max(1e-9)
    );
    println!("{:<width$}  {:>7}  {total:>8.1}", "total", "");
    if let Some(cpu) = children_cpu_seconds() {
        println!(
            "CPU used by the steps: {cpu:.0} s, {:.2} cores on average",
            cpu / total.max(1e-9)
        );
    }
}

/// User and system CPU seconds of every finished child process, with theirs (Linux's
/// `/proc/self/stat`, fields 16–17): set beside the wall time, it says whether the run kept
/// the cores busy, which decides what can make it shorter.
fn children_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces; fields after it follow its closing paren.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Field 3 (state) is the first after the name: cutime is field 16, cstime 17.
    let ticks: f64 = fields.get(13)?.parse::<f64>().ok()? + fields.get(14)?.parse::<f64>().ok()?;
    let per_second = Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .unwrap_or(100.0);
    Some(ticks / per_second)
}

pub(crate) fn run(step: &str, cmd: Command) -> Result<()> {
    run_with(step, cmd, None)
}

/// Independent suites' outcomes, gathered so that one failing suite does not keep the ones
/// after it from running: a run then shows every suite that fails, not only the first.
#[derive(Default)]
pub(crate) struct Failures(Vec<anyhow::Error>);

impl Failures {
    pub(crate) fn note(&mut self, outcome: Result<()>) {
        if let Err(e) = outcome {
            self.0.push(e);
        }
    }

    /// Ok when nothing failed, else one error naming every failure.
    pub(crate) fn into_result(self) -> Result<()> {
        if self.0.is_empty() {
            return Ok(());
        }
        let each: Vec<String> = self.0.iter().map(|e| format!("{e:#}")).collect();
        Err(anyhow::anyhow!("{}", each.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finished_childs_cpu_time_is_counted() {
        let before = children_cpu_seconds().expect("/proc/self/stat is readable");
        // About half a second of CPU in a child, reaped by `status()`.
        let status = Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"])
            .status()
            .unwrap();
        assert!(status.success());
        let after = children_cpu_seconds().unwrap();
        assert!(after - before >= 0.05, "{before} → {after}");
    }
}
