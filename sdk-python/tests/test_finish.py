"""How a run ends is what the collector is told: `finish()` (or a `with` block left normally)
reports each rank `finished`, which resolves the run's alerts at once; a block left by an
exception reports nothing of the kind, so a crash never reads as a clean end. A run the
process never finished (the zero-code agent's always) is finished at the interpreter's exit,
by the same rule."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import Collector, sdk_env

import rankwatch


def finished_rows(collector: Collector, run: str) -> list[dict[str, Any]]:
    return collector.sql(f"SELECT rank, step, value FROM samples WHERE run = '{run}' AND metric = 'finished'")


def test_a_clean_end_reports_finished_and_a_crash_does_not(tmp_path: Path) -> None:
    collector = Collector(tmp_path / "data")
    try:
        with rankwatch.init("clean-end", collector.url, spool_dir=tmp_path / "spool", rank=0, world_size=1) as run:
            for step in range(3):
                run.log(step, loss=1.0)
        assert finished_rows(collector, "clean-end") == [{"rank": 0, "step": 2, "value": 1.0}]

        with pytest.raises(RuntimeError, match="boom"):
            with rankwatch.init("crashed", collector.url, spool_dir=tmp_path / "spool", rank=0, world_size=1) as run:
                run.log(0, loss=1.0)
                raise RuntimeError("boom")
        assert collector.sql("SELECT count(*) AS n FROM samples WHERE run = 'crashed' AND metric = 'loss'")[0]["n"] == 1
        assert finished_rows(collector, "crashed") == []
    finally:
        collector.stop()


def _job(tmp_path: Path, code: str, *args: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """`code` run as a script by a fresh interpreter that imports this tree's SDK (after
    `launcher`, a command that runs the script's command line, when given)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(code))
    env = sdk_env(RANKWATCH_SPOOL_DIR=str(tmp_path / "spool"))
    return subprocess.run([*launcher, sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=120)


def _count(collector: Collector, run: str, metric: str) -> int:
    return int(collector.sql(f"SELECT count(*) AS n FROM samples WHERE run = '{run}' AND metric = '{metric}'")[0]["n"])


@pytest.mark.parametrize("ending", ["clean", "uncaught", "exit1"])
def test_a_run_left_unfinished_is_finished_at_exit_and_a_crash_still_reads_as_one(tmp_path: Path, collector: Collector, ending: str) -> None:
    """No `finish()`: at the exit every value logged has reached the collector, and the rank
    reports `finished` when the script ended normally, and not when an uncaught exception or
    `sys.exit(1)` ended it."""
    done = _job(
        tmp_path,
        """
        import sys, rankwatch
        run = rankwatch.init("left-open", sys.argv[1], rank=0, world_size=1)
        for step in range(3):
            run.log(step, loss=1.0 + step)
        if sys.argv[2] == "uncaught":
            raise RuntimeError("the job died")
        if sys.argv[2] == "exit1":
            sys.exit(1)
        """,
        collector.url,
        ending,
    )
    assert done.returncode == (0 if ending == "clean" else 1), done.stderr[-3000:]
    # finish() returned before the process did: what it holds is there now, not eventually.
    assert _count(collector, "left-open", "loss") == 3, done.stderr[-3000:]
    expected = [{"rank": 0, "step": 2, "value": 1.0}] if ending == "clean" else []
    assert finished_rows(collector, "left-open") == expected, done.stderr[-3000:]


def test_the_zero_code_agent_finishes_its_run_when_the_job_exits(tmp_path: Path, collector: Collector) -> None:
    """`rankwatch run` has no place to call finish(): the exit does it, so every step the job
    trained reaches the collector and the rank reports its end (before, the last report left
    with the process only if the sender's timer fired first, and `finished` never came)."""
    launcher = (sys.executable, "-m", "rankwatch", "run", "--collector", collector.url, "--run", "zero-code-end", "--")
    done = _job(
        tmp_path,
        """
        import torch
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            loss = model(torch.ones(4, 2)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        """,
        launcher=launcher,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "watching Linear" in done.stderr, done.stderr[-3000:]
    # The agent starts at the end of the first optimizer step and logs the two after it.
    steps = collector.sql("SELECT step FROM samples WHERE run = 'zero-code-end' AND metric = 'loss' ORDER BY step")
    assert [r["step"] for r in steps] == [2, 3], done.stderr[-3000:]
    assert finished_rows(collector, "zero-code-end") == [{"rank": 0, "step": 3, "value": 1.0}]


def test_a_forked_child_leaves_its_parents_run_to_the_parent(tmp_path: Path, collector: Collector) -> None:
    """A child forked after `init` inherits the run and the exit hook but not the sender
    thread: its exit handlers must not finish the parent's run (no `finished` from it, no wait
    on a sender that is not there); the parent finishes it at its own exit."""
    done = _job(
        tmp_path,
        """
        import atexit, os, sys
        import rankwatch

        run = None
        # Registered before init registers rankwatch's, so it runs after it (exit handlers
        # run last in, first out): it shows the run as rankwatch's handler left it.
        atexit.register(lambda: print(f"{'child' if os.getpid() != parent else 'parent'} exits, run finished: {run.finished}", flush=True))
        parent = os.getpid()
        run = rankwatch.init("forked", sys.argv[1], rank=0, world_size=1)
        run.log(0, loss=1.0)
        pid = os.fork()
        if pid == 0:
            # The exit handlers, then out without finalization: finalizing the inherited copy of
            # the native agent could wait on a lock its sender thread (not forked) held.
            atexit._run_exitfuncs()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("child exit status:", status, flush=True)
        run.log(1, loss=2.0)
        """,
        collector.url,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "child exits, run finished: False" in out and "child exit status: 0" in out, out + done.stderr[-3000:]
    assert "parent exits, run finished: True" in out, out + done.stderr[-3000:]
    assert finished_rows(collector, "forked") == [{"rank": 0, "step": 1, "value": 1.0}], done.stderr[-3000:]
    assert _count(collector, "forked", "loss") == 2


def test_a_forked_child_that_logs_and_ends_normally_neither_hangs_nor_sends(tmp_path: Path, collector: Collector) -> None:
    """A child forked after `init` (a `multiprocessing` or `DataLoader` worker under fork)
    that calls `log` and `finish` and then ends by interpreter finalization, which drops the
    native agent it inherited: the calls are ignored with a warning (the run's sender stayed in
    the parent), the agent's copy is left alone rather than stopped (its sender and alert
    poller threads do not exist in the child: joining the poller waited forever), and the
    parent's run goes on untouched."""
    done = _job(
        tmp_path,
        """
        import os, sys, time, warnings
        import rankwatch

        run = rankwatch.init("forked-logs", sys.argv[1], rank=0, world_size=1)
        run.on_alert(lambda alert: None, poll_interval=0.2)  # a poller thread, which the child lacks
        run.log(0, loss=1.0)
        pid = os.fork()
        if pid == 0:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run.log(5, loss=9.0)
                stats = run.finish()
            print("child warned:", " | ".join(str(w.message) for w in caught), flush=True)
            print("child finish returned:", stats, flush=True)
            sys.exit(0)  # finalization: every inherited object, the native agent too, is dropped
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child exit status:", status, flush=True)
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            print("child hung", flush=True)
        run.log(1, loss=2.0)
        """,
        collector.url,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "child exit status: 0" in out, out + done.stderr[-3000:]
    # Stopping the inherited agent in the child panicked joining a thread it never had.
    assert "panicked" not in done.stderr and "PanicException" not in done.stderr, done.stderr[-3000:]
    assert "log() in a process forked from the one that called init() is ignored" in out, out
    assert "finish() in a process forked from the one that called init() is ignored" in out, out
    assert "child finish returned: {}" in out, out
    assert _count(collector, "forked-logs", "loss") == 2  # steps 0 and 1; the child's 5 is not sent
    assert finished_rows(collector, "forked-logs") == [{"rank": 0, "step": 1, "value": 1.0}], done.stderr[-3000:]


@pytest.mark.parametrize("outcome", ["returns", "raises"])
def test_a_spawned_worker_that_raises_reads_as_a_crash(tmp_path: Path, collector: Collector, outcome: str) -> None:
    """multiprocessing prints a spawned worker's exception itself and ends it with
    `sys.exit(1)`, so the interpreter never sees it uncaught: the exit code is what tells the
    crash from a clean end. Either way what the worker logged is delivered."""
    done = _job(
        tmp_path,
        """
        import multiprocessing, sys
        import rankwatch

        def worker(url, outcome):
            run = rankwatch.init("spawned", url, rank=0, world_size=1)
            for step in range(2):
                run.log(step, loss=1.0)
            if outcome == "raises":
                raise RuntimeError("the worker died")

        if __name__ == "__main__":
            p = multiprocessing.get_context("spawn").Process(target=worker, args=(sys.argv[1], sys.argv[2]))
            p.start()
            p.join(120)
            print("worker exit code:", p.exitcode, flush=True)
        """,
        collector.url,
        outcome,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"worker exit code: {0 if outcome == 'returns' else 1}" in done.stdout, done.stdout + done.stderr[-3000:]
    assert _count(collector, "spawned", "loss") == 2, done.stderr[-3000:]
    expected = [{"rank": 0, "step": 1, "value": 1.0}] if outcome == "returns" else []
    assert finished_rows(collector, "spawned") == expected, done.stderr[-3000:]


def test_sys_exit_is_wrapped_only_while_a_run_is_live(tmp_path: Path, collector: Collector) -> None:
    """The exit code is kept by wrapping `sys.exit` while a run is live; once the last run
    ends the job's own `sys.exit` is back, the same object. (A fresh process: runs another
    test left live would keep the wrapper in this one.)"""
    done = _job(
        tmp_path,
        """
        import sys
        import rankwatch

        original = sys.exit
        first = rankwatch.init("wrapped", sys.argv[1], rank=0, world_size=1)
        second = rankwatch.init("wrapped-too", sys.argv[1], rank=0, world_size=1)
        print("live:", sys.exit is not original and sys.exit.__wrapped__ is original)
        first.finish()
        print("one still live:", sys.exit is not original)
        second.finish()
        print("none live:", sys.exit is original)
        """,
        collector.url,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["live: True", "one still live: True", "none live: True"], done.stdout + done.stderr[-3000:]
