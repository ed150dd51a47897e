"""The test kit's rank launcher: it forks only where that is safe, and a forked job trains
exactly as a spawned one does (the suites' jobs are forked to save each rank a fresh import of
torch; that must not change what they train)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Collector

import rankwatch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
TESTKIT = Path(__file__).resolve().parent.parent / "testkit"
CRASHING = Path(__file__).resolve().parent / "spawn_crash_worker.py"


def launcher_env(method: str) -> dict[str, str]:
    """The environment of a job whose ranks the test kit starts by `method` ("fork" or "spawn")."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RANKWATCH_START_METHOD": method}


def fresh_start_method(before: str = "", **env: str) -> str:
    """`start_method()` as a fresh Python sees it after importing torch with one OpenMP thread
    (with more, importing torch starts a thread already) and running `before`."""
    code = f"import threading\n{before}\nfrom rankwatch_testkit.spawn import start_method\nprint(start_method())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        # Without an override from outside, which would decide for the check.
        env={**{k: v for k, v in os.environ.items() if k != "RANKWATCH_START_METHOD"}, "PYTHONPATH": str(TESTKIT), "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


@pytest.mark.skipif(sys.platform != "linux", reason="forking is chosen on Linux only")
def test_a_single_threaded_launcher_forks_and_the_environment_can_say_otherwise() -> None:
    assert fresh_start_method() == "fork"
    assert fresh_start_method(RANKWATCH_START_METHOD="spawn") == "spawn"


@pytest.mark.skipif(sys.platform != "linux", reason="forking is chosen on Linux only")
def test_a_launcher_with_another_thread_spawns() -> None:
    # A Python thread, and a native one: torch's OpenMP pool, started at import with more
    # than one OpenMP thread (a forked child would inherit a pool without its threads).
    assert fresh_start_method("threading.Thread(target=threading.Event().wait, daemon=True).start()") == "spawn"
    assert fresh_start_method(OMP_NUM_THREADS="2") == "spawn"


def test_forked_and_spawned_ranks_train_the_same_job_bit_for_bit(tmp_path: Path) -> None:
    losses = {}
    for method in ("fork", "spawn"):
        out = tmp_path / method
        out.mkdir()
        cmd = [sys.executable, str(EXAMPLE), "--monitor", "off", "--nproc", "2", "--steps", "12", "--result-dir", str(out),
               "--layers", "2", "--width", "32", "--seq", "16", "--batch", "4", "--vocab", "64", "--corpus", "256"]
        done = subprocess.run(cmd, env=launcher_env(method), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        losses[method] = [json.loads((out / f"rank-{r}.json").read_text())["final_loss"] for r in range(2)]
    assert losses["fork"] == losses["spawn"], losses
    # Two ranks on different shards: the comparison is of two real, different losses.
    assert losses["fork"][0] != losses["fork"][1], losses


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_rank_that_fails_before_finish_still_delivers_what_it_logged(tmp_path: Path, method: str) -> None:
    # A forked rank ends in os._exit, without the interpreter shutdown that would drop the
    # agent and deliver its last rows: the launcher ends the run itself, as a crash.
    spool = tmp_path / "spool"
    done = subprocess.run([sys.executable, str(CRASHING), str(spool)], env=launcher_env(method), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "fails before finish()" in done.stderr, done.stderr[-4000:]
    collector = Collector(tmp_path / "data")
    try:
        report = rankwatch.sync(spool / "crash-before-finish", collector.url)
        assert report["remaining"] == 0, report
        rows = collector.sql("SELECT rank, step, value FROM samples WHERE run = 'crash-before-finish' AND metric = 'loss' ORDER BY rank, step")
        assert [(r["rank"], r["step"], r["value"]) for r in rows] == [(rank, step, 10.0 * rank + step) for rank in range(2) for step in range(3)]
        # A crash, not an end: no rank reported that it finished.
        assert collector.sql("SELECT count(*) AS n FROM samples WHERE run = 'crash-before-finish' AND metric = 'finished'")[0]["n"] == 0
    finally:
        collector.stop()
