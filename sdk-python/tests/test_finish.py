"""How a run ends is what the collector is told: `finish()` (or a `with` block left normally)
reports each rank `finished`, which resolves the run's alerts at once; a block left by an
exception reports nothing of the kind, so a crash never reads as a clean end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Collector

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
