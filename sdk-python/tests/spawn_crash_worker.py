"""A 2-rank job launched by the test kit whose ranks log three steps, then fail before
`finish()` (usage: spawn_crash_worker.py SPOOL_DIR). What they logged must still be spooled."""

from __future__ import annotations

import sys

from rankwatch_testkit.spawn import spawn_ranks

import rankwatch


# Where a script keeps its run, as scripts do: a run held only by the rank's frame would be
# dropped, and so delivered, as the exception unwinds; one held here lives until the process
# ends, which for a forked rank is os._exit.
RUNS: list[rankwatch.Run] = []


def _rank(rank: int, spool: str) -> None:
    run = rankwatch.init(run="crash-before-finish", mode="offline", spool_dir=spool)
    RUNS.append(run)
    for step in range(3):
        run.log(step, loss=float(10 * rank + step))
    raise RuntimeError(f"rank {rank} fails before finish()")


if __name__ == "__main__":
    spawn_ranks(_rank, 2, sys.argv[1])
