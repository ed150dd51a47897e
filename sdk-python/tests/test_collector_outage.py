"""The training job comes first: a collector that dies, comes back, or never existed.

A real training loop (NanoGPT on CPU, every probe on) logs to the real `rankwatch` binary.
The collector is killed with SIGKILL in the middle of the run and restarted on the same port
and data directory later; afterwards every sample of every step is in the collector exactly
once. A run whose collector never starts completes, warns, and leaves its data in the spool,
from where `rankwatch.sync` delivers it.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import rankwatch
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

from conftest import Collector

STEPS = 60


def _train(run: rankwatch.Run, steps: range, on_step: Callable[[int], None] | None = None) -> list[float]:
    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run.watch(model, opt)
    times = []
    for step in steps:
        x = torch.randint(0, 40, (4, 16))
        _, loss = model(x, torch.roll(x, -1, 1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        started = time.perf_counter()
        run.log(step, loss=loss.detach(), tokens=x.numel(), lr=0.05)
        times.append(time.perf_counter() - started)
        if on_step is not None:
            on_step(step)
    return times


def test_a_collector_killed_mid_run_loses_nothing_and_duplicates_nothing(collector: Collector, tmp_path: Path) -> None:
    run = rankwatch.init(run="outage", collector=collector.url, spool_dir=tmp_path / "spool", every={"activations": 5, "spectral": 10})
    outage: dict[str, int] = {}

    def on_step(step: int) -> None:
        if step == 15:
            collector.kill()
            outage["from"] = step
        if step == 45:
            outage["spooled"] = run.stats()["spooled_batches"]
            collector.start()
        # A step's worth of "compute", so batches are sealed during the outage; longer steps
        # while it lasts, so it spans more than one of the SDK's 2 s health checks.
        time.sleep(0.15 if 15 <= step < 45 else 0.05)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        times = _train(run, range(STEPS), on_step)
        stats = run.finish(timeout=30)
    print(f"log() per step: median {statistics.median(times) * 1e6:.0f} µs, max {max(times) * 1e6:.0f} µs over {STEPS} steps, outage included")
    assert outage["spooled"] > 0, "batches sealed while the collector was down went to the spool"
    assert any("unreachable" in str(w.message) for w in caught), "the outage was reported as a warning"
    assert stats["dropped_rows"] == 0 and stats["backlog_batches"] == 0, stats

    rows = collector.sql("SELECT step, count(*) AS n FROM samples WHERE metric = 'loss' GROUP BY step ORDER BY step")
    assert [r["step"] for r in rows] == list(range(STEPS)), "every step's loss arrived"
    assert all(r["n"] == 1 for r in rows), "and exactly once"
    dupes = collector.sql("SELECT metric, layer, site, rank, step, count(*) AS n FROM samples GROUP BY metric, layer, site, rank, step HAVING count(*) > 1")
    assert dupes == []
    spectral = collector.sql("SELECT DISTINCT step FROM samples WHERE metric = 'spectral.ratio' ORDER BY step")
    assert [r["step"] for r in spectral] == list(range(0, STEPS, 10))
    assert not any((tmp_path / "spool").rglob("*.spool")), "the spool is empty once delivered"


def test_a_collector_that_never_starts_costs_a_warning_and_a_spool(tmp_path: Path) -> None:
    run = rankwatch.init(run="nobody-home", collector="http://127.0.0.1:9", spool_dir=tmp_path / "spool")
    with pytest.warns(rankwatch.RankwatchWarning, match="without reaching the collector"):
        _train(run, range(20))
        stats = run.finish(timeout=5)
    assert stats["spooled_batches"] > 0 and stats["dropped_rows"] == 0
    # Later, with a collector: everything arrives from the spool.
    collector = Collector(tmp_path / "data")
    try:
        report = rankwatch.sync(tmp_path / "spool" / "nobody-home", collector.url)
        assert report["remaining"] == 0 and report["rows"] > 0, report
        steps = collector.sql("SELECT count(DISTINCT step) AS n FROM samples WHERE metric = 'loss'")
        assert steps[0]["n"] == 20
    finally:
        collector.stop()


def test_a_missing_token_keeps_the_rows_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """401 is a configuration mistake, not a bad batch: nothing is dropped, the warning names
    the token, and the spool delivers everything once the token is given."""
    monkeypatch.delenv("RANKWATCH_INGEST_TOKEN", raising=False)
    collector = Collector(tmp_path / "data", extra_args=["--ingest-token", "s3cret"])
    try:
        run = rankwatch.init(run="no-token", collector=collector.url, spool_dir=tmp_path / "spool")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")

            def pause(step: int) -> None:
                if step == 9:
                    run.flush(timeout=3)
                    time.sleep(2.1)  # the health check looks at most every 2 s

            _train(run, range(12), on_step=pause)
            stats = run.finish(timeout=3)
        messages = " | ".join(str(w.message) for w in caught)
        assert "401" in messages and "ingest token" in messages, messages
        assert stats["dropped_rows"] == 0 and stats["refused_rows"] == 0, stats
        assert stats["spooled_batches"] > 0, stats
        report = rankwatch.sync(tmp_path / "spool" / "no-token", collector.url, token="s3cret")
        assert report["remaining"] == 0 and report["rows"] > 0, report
        steps = collector.sql("SELECT count(DISTINCT step) AS n FROM samples WHERE run = 'no-token' AND metric = 'loss'")
        assert steps[0]["n"] == 12
    finally:
        collector.stop()
