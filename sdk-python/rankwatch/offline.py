"""What works without PyTorch: the settings every side shares, and `sync`.

`import rankwatch` must not need torch (the `rankwatch` command runs on nodes and in
environments without it, and a user without torch should hear which package is missing, not
see a traceback from inside the package). This module holds what those paths need: the
default collector and spool locations, as `init` reads them too, and `sync`, which sends a
spool through the native agent alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal, get_args

from . import _native

if TYPE_CHECKING:
    from ._native import SyncReport

DEFAULT_COLLECTOR = "http://127.0.0.1:7070"

# "online" streams (spooling while the collector is away), "offline" only spools, "disabled"
# reports nothing: `init` returns a `NoopRun`. Only the first two reach the native agent.
Mode = Literal["online", "offline", "disabled"]
AgentMode = Literal["online", "offline"]
MODES: tuple[Mode, ...] = get_args(Mode)


def parse_mode(text: str) -> Mode:
    """`text` as a mode; raises ValueError naming the modes when it is none of them."""
    for mode in MODES:
        if text == mode:
            return mode
    raise ValueError(f"rankwatch.init: mode must be 'online', 'offline' or 'disabled', got {text!r}")


def collector_url(given: str | None = None) -> str:
    """`given`, else `RANKWATCH_COLLECTOR`, else the local default."""
    return given or os.environ.get("RANKWATCH_COLLECTOR") or DEFAULT_COLLECTOR


def spool_root(given: str | os.PathLike[str] | None = None) -> Path:
    """Where runs spool: `given`, else `RANKWATCH_SPOOL_DIR`, else ~/.cache/rankwatch/spool."""
    return Path(given or os.environ.get("RANKWATCH_SPOOL_DIR") or Path.home() / ".cache" / "rankwatch" / "spool")


def sync(spool_dir: str | os.PathLike[str], collector: str | None = None, *, token: str | None = None) -> SyncReport:
    """Sends what an offline run (or a process that lost its collector) left in `spool_dir`.

    `spool_dir` may be one rank's directory or a run's (all its `rank-*` directories)."""
    collector = collector_url(collector)
    root = Path(spool_dir)
    dirs = sorted(p for p in root.glob("rank-*") if p.is_dir()) or [root]
    total: SyncReport = {"batches": 0, "rows": 0, "duplicates": 0, "refused_rows": 0, "set_aside_rows": 0, "corrupt": 0, "remaining": 0, "errors": []}
    for d in dirs:
        report = _native.sync(str(d), collector, token or os.environ.get("RANKWATCH_INGEST_TOKEN"))
        for key in ("batches", "rows", "duplicates", "refused_rows", "set_aside_rows", "corrupt", "remaining"):
            total[key] += report[key]
        total["errors"] += report["errors"]
    return total
