"""Types of `rankwatch._native`, the Rust agent as a Python extension (`sdk-python/src/lib.rs`).

Kept by hand next to the PyO3 definitions: every `#[pyfunction]`, `#[pyclass]` and
`#[pymethods]` item there has its signature here, with the same argument names and defaults.
The dicts the module returns are `TypedDict`s that exist only for type checking; import them
under `typing.TYPE_CHECKING` (`stubtest-allowlist.txt` names them for `mypy.stubtest`, which
checks this file against the built module). Every refusal is a `ValueError`; a call on a
shut-down agent is a `RuntimeError`.
"""

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict, final

__all__ = ["VERSION", "WIRE_PROTOCOL", "Agent", "sync", "vocabulary"]

# The release (the workspace's version, also the wheel's) and the ingest wire protocol the agent speaks.
VERSION: str
WIRE_PROTOCOL: int

class AgentStats(TypedDict):
    """The agent's counters (`Agent.stats`, `Agent.shutdown`)."""

    accepted_rows: int
    queued_values: int
    sent_rows: int
    sent_batches: int
    duplicates: int
    retries: int
    dropped_rows: int
    dropped_queue_full: int
    dropped_spool_full: int
    refused_rows: int
    set_aside_rows: int
    backlog_batches: int
    spooled_batches: int
    spool_bytes: int
    spool_corrupt: int
    connected: bool
    ever_connected: bool
    last_error: str | None

class AlertFeedStats(TypedDict, total=False):
    """The alert feed's counters; empty until `Agent.watch_alerts` started the feed."""

    dropped: int
    failed_polls: int
    connected: bool

class SyncReport(TypedDict):
    """What `sync` sent from a spool directory."""

    batches: int
    rows: int
    duplicates: int
    refused_rows: int
    set_aside_rows: int
    corrupt: int
    remaining: int
    errors: list[str]

# `(metric, layer, site, all_ranks)`: one series of `Agent.register`.
SeriesSpec = tuple[str, int | None, str | None, bool]

@final
class Agent:
    """One rank's agent: the sender thread, queue and spool of one run."""

    def __new__(
        cls,
        run: str,
        rank: int,
        collector: str,
        *,
        token: str | None = None,
        mode: Literal["online", "offline"] = "online",
        spool_dir: str | os.PathLike[str] | None = None,
        queue_values: int = 2_000_000,
        batch_interval_s: float = 1.0,
        request_timeout_s: float = 10.0,
        session: str | None = None,
    ) -> Agent: ...
    @property
    def rank(self) -> int:
        """This agent's rank."""
    @property
    def session(self) -> str:
        """The session part of the idempotency keys."""
    @property
    def closed(self) -> bool:
        """Whether the agent was shut down."""
    def log(self, step: int, values: dict[str, Any]) -> list[str] | None:
        """Queues this rank's scalars for `step`. Any value is accepted: plain floats and ints
        are taken, and the names of the others (tensors, numpy scalars, mistakes) are returned
        for the caller to resolve, or None when all were taken. Must be a dict, not a Mapping."""
    def register(self, series: Sequence[SeriesSpec]) -> int:
        """Registers a fixed list of series and returns its id for `log_series`."""
    def log_series(self, step: int, series_id: int, values: Sequence[float]) -> bool:
        """Queues one value per series of `series_id` for `step`."""
    def sketch(self, step: int, kind: str, seed: int, norm: float, vector: Sequence[float]) -> bool:
        """Queues a gradient sketch of this rank."""
    def set_info(self, world_size: int, layout_json: str, tags: Mapping[str, str], started_at_ms: int | None = None) -> bool:
        """Announces the run: world size, the discovered layout (`ModelLayout` JSON) and tags."""
    def flush(self, timeout_s: float) -> bool:
        """Tries to deliver everything within `timeout_s`; whether the backlog is empty after."""
    def watch_alerts(self, interval_s: float = 2.0) -> bool:
        """Starts polling the collector for this run's alerts; False in offline mode."""
    def take_alerts(self) -> list[str]:
        """The alert changes received since the last call, as JSON texts, oldest first."""
    def alert_feed_stats(self) -> AlertFeedStats:
        """The alert feed's counters."""
    def shutdown(self, timeout_s: float) -> AgentStats:
        """Stops the agent (idempotent) and returns its final counters."""
    def stats(self) -> AgentStats:
        """The counters now."""

def sync(
    spool_dir: str | os.PathLike[str],
    collector: str,
    token: str | None = None,
    timeout_s: float = 10.0,
) -> SyncReport:
    """Sends a spool directory (an offline run, or what a crashed process left) to `collector`."""

def vocabulary() -> list[tuple[str, Literal["rank", "layer", "all_ranks"], list[str]]]:
    """The metric vocabulary: `(name, scope, sites)` for each metric."""
