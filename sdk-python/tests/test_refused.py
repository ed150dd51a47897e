"""A collector limit refuses a run's batches, and nothing is lost.

A real `rankwatch serve` with a series limit below what the run logs answers `422` to every
batch. The agent keeps each refused batch beside its spool (`refused/`), warns once saying where
and how to resend, and counts them as set aside, not dropped. After the operator restarts the
collector with a higher limit, `rankwatch.sync` delivers every value exactly once.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from conftest import Collector

import rankwatch

STEPS = 12
SERIES = 6


def test_batches_over_the_series_limit_are_kept_and_delivered_once_the_limit_is_raised(tmp_path: Path) -> None:
    data = tmp_path / "data"
    spool = tmp_path / "spool"
    collector = Collector(data, extra_args=["--max-series-per-run", "3"])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = rankwatch.init("limited", collector.url, spool_dir=spool, rank=0, world_size=1)
            for step in range(STEPS):
                run.log(step, {f"user/m{i}": float(step * 10 + i) for i in range(SERIES)})
            stats = run.finish()
        assert stats["set_aside_rows"] >= STEPS * SERIES, stats
        assert stats["dropped_rows"] == 0 and stats["refused_rows"] == 0, stats
        kept = [str(w.message) for w in caught if "refused" in str(w.message)]
        assert kept and "kept in" in kept[0] and "rankwatch sync" in kept[0], kept
        assert (spool / "limited" / "rank-0" / "refused").is_dir()
        # Only finish()'s one `finished` row fits under the limit.
        assert collector.sql("SELECT count(*) AS n FROM samples WHERE run = 'limited' AND metric <> 'finished'")[0]["n"] == 0
    finally:
        collector.stop()

    raised = Collector(data, extra_args=["--max-series-per-run", "1000"])
    try:
        report = rankwatch.sync(spool / "limited", raised.url)
        assert report["set_aside_rows"] == 0 and report["refused_rows"] == 0, report
        assert report["rows"] >= STEPS * SERIES, report
        rows = raised.sql("SELECT metric, step, value FROM samples WHERE run = 'limited' AND metric LIKE 'user/%' ORDER BY metric, step")
        assert len(rows) == STEPS * SERIES, rows[:5]
        assert {(r["metric"], r["step"], r["value"]) for r in rows} == {(f"user/m{i}", s, float(s * 10 + i)) for i in range(SERIES) for s in range(STEPS)}
        again = rankwatch.sync(spool / "limited", raised.url)
        assert again["rows"] == 0, again
    finally:
        raised.stop()
