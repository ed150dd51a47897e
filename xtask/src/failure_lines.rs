//! What a failed step said about its failures, printed again at the end of the run.
//!
//! A side lane's output is printed when its step ends, often many minutes before the run does,
//! and a reader of the end of the log (CI shows its last lines) saw only the stage table and
//! the test names. So each step's output is read as it passes for the lines that explain a
//! failure — cargo's `failures:` section (the panic and its message), pytest's failure headers,
//! `E` lines and short summary — and a failed step's lines are repeated under the stage table,
//! each cut to [`MAX_CHARS`] and at most [`MAX_LINES`] a step (a property test's minimal input
//! can be a megabyte on one line).

use std::sync::Mutex;

/// Lines kept a step.
pub(crate) const MAX_LINES: usize = 60;
/// Characters kept a line.
pub(crate) const MAX_CHARS: usize = 400;

/// The explaining lines of one step's output, gathered as it is read.
#[derive(Debug, Default)]
pub(crate) struct FailureLines {
    /// Inside cargo's `failures:` section (every line kept).
    in_cargo: bool,
    /// Inside pytest's `FAILURES`/`ERRORS` section (headers and `E` lines kept).
    in_pytest: bool,
    kept: Vec<String>,
    /// Lines that would have been kept past [`MAX_LINES`].
    over: usize,
}

impl FailureLines {
    /// Reads one line of the step's output.
    pub(crate) fn read(&mut self, line: &str) {
        let banner = line.starts_with('=') && line.ends_with('=');
        if line == "failures:" {
            // cargo prints it twice: before the details and before the list of names.
            self.in_cargo = true;
            return;
        }
        if line.starts_with("test result:") {
            self.in_cargo = false;
        }
        if banner {
            self.in_pytest = line.contains(" FAILURES ") || line.contains(" ERRORS ");
            return;
        }
        let keep = if self.in_cargo {
            !line.trim().is_empty() && !line.starts_with("note: run with `RUST_BACKTRACE")
        } else if self.in_pytest {
            // `_____ test_name _____`, `E   assert ...`, `path.py:12: AssertionError`.
            line.starts_with("_ ")
                || line.starts_with("__")
                || line.starts_with("E ")
                || line.trim_end().ends_with("Error")
                || line.trim_end().ends_with("Failed")
        } else {
            // pytest's short summary, wherever it stands.
            line.starts_with("FAILED ") || line.starts_with("ERROR ")
        };
        if keep {
            self.keep(line);
        }
    }

    fn keep(&mut self, line: &str) {
        if self.kept.len() >= MAX_LINES {
            self.over += 1;
            return;
        }
        let mut cut: String = line.chars().take(MAX_CHARS).collect();
        if cut.len() < line.len() {
            cut.push_str(" …");
        }
        self.kept.push(cut);
    }

    /// The kept lines, with a last line counting those left out.
    pub(crate) fn lines(&self) -> Vec<String> {
        let mut lines = self.kept.clone();
        if self.over > 0 {
            lines.push(format!("… and {} more lines", self.over));
        }
        lines
    }
}

/// Each failed step's explaining lines, in the order the steps ended.
static FAILED: Mutex<Vec<(String, Vec<String>)>> = Mutex::new(Vec::new());

/// Keeps what `step` said, when it failed and said something.
pub(crate) fn record_failure(step: &str, lines: &FailureLines) {
    let lines = lines.lines();
    if lines.is_empty() {
        return;
    }
    if let Ok(mut failed) = FAILED.lock() {
        failed.push((step.to_owned(), lines));
    }
}

/// Prints every failed step's explaining lines (nothing when none failed).
pub(crate) fn print_failures() {
    let Ok(failed) = FAILED.lock() else { return };
    if failed.is_empty() {
        return;
    }
    println!("\nwhat the failed steps said (repeated from their output above, cut):");
    for (step, lines) in failed.iter() {
        println!("\n--- {step}");
        for line in lines {
            println!("{line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(output: &str) -> Vec<String> {
        let mut f = FailureLines::default();
        output.lines().for_each(|l| f.read(l));
        f.lines()
    }

    #[test]
    fn cargo_failures_keep_the_panic_and_its_message_not_the_passing_tests() {
        let out = "running 3 tests\ntest a ... ok\ntest b ... FAILED\n\nfailures:\n\n---- b stdout ----\n\
thread 'b' panicked at src/x.rs:3:5:\nassertion `left == right` failed: series loss\n  left: 1\n right: 2\n\
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\n\n\nfailures:\n    b\n\n\
test result: FAILED. 1 passed; 1 failed; 0 ignored\n";
        assert_eq!(
            read(out),
            [
                "---- b stdout ----",
                "thread 'b' panicked at src/x.rs:3:5:",
                "assertion `left == right` failed: series loss",
                "  left: 1",
                " right: 2",
                "    b",
            ]
        );
    }

    #[test]
    fn pytest_failures_keep_headers_error_lines_and_the_summary_not_the_source() {
        let out = "..F.\n=================== FAILURES ===================\n\
_____ test_x _____\n\n    def test_x():\n>       assert 1 == 2\nE       assert 1 == 2\n\n\
tests/t.py:3: AssertionError\n==== costliest 25 tests by CPU ====\n  4.00s cpu  tests/t.py::test_x\n\
=========== short test summary info ============\nFAILED tests/t.py::test_x - assert 1 == 2\n\
1 failed, 3 passed in 1.0s\n";
        assert_eq!(
            read(out),
            [
                "_____ test_x _____",
                "E       assert 1 == 2",
                "tests/t.py:3: AssertionError",
                "FAILED tests/t.py::test_x - assert 1 == 2",
            ]
        );
    }

    #[test]
    fn a_passing_run_keeps_nothing() {
        let out = "running 2 tests\ntest a ... ok\ntest b ... ok\n\ntest result: ok. 2 passed; 0 failed\n\
=== 5 passed in 2.0s ===\n";
        assert!(read(out).is_empty());
    }

    #[test]
    fn long_lines_are_cut_and_lines_past_the_cap_counted() {
        let long = "x".repeat(MAX_CHARS * 3);
        let mut out = format!("failures:\nthread 't' panicked at a.rs:1:1:\n{long}\n");
        for i in 0..MAX_LINES + 5 {
            out.push_str(&format!("line {i}\n"));
        }
        let lines = read(&out);
        assert_eq!(lines.len(), MAX_LINES + 1);
        assert_eq!(
            lines[1].chars().count(),
            MAX_CHARS + 2,
            "cut, with the mark"
        );
        assert_eq!(lines.last().unwrap(), "… and 7 more lines");
    }
}
