"""The user-facing run: `init`, `watch`, `log`, `finish`.

A `Run` owns one native agent (the Rust sender thread, queue and spool) and the torch probes
installed by `watch`. `log(step, ...)` is the only call on the training thread's hot path: it
passes plain numbers straight to the native agent, collects tensors (never reading them), lets
each probe add its device scalars when its cadence is due, and submits them all as one report
(see `report.py`). No call here raises into the training loop for something that is the
monitoring's problem — a missing collector, a bad value, a call after `finish` — it warns once
and carries on; mistakes in how rankwatch itself is configured (`init`, `watch`) raise.
"""

from __future__ import annotations

import math
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from . import _native
from .report import Reporter, SeriesKey

DEFAULT_COLLECTOR = "http://127.0.0.1:7070"
_RUN_ID = re.compile(r"[^A-Za-z0-9._-]+")
_VOCABULARY = {name: scope for name, scope, _ in _native.vocabulary()}


class RankwatchWarning(UserWarning):
    """Monitoring trouble that must not stop training (collector away, bad value, misuse)."""


@dataclass
class Cadence:
    """Steps between measurements, per probe (1 = every step). `0` turns a probe off."""

    grad: int = 1
    sketch: int = 10
    activations: int = 25
    spectral: int = 50

    @classmethod
    def parse(cls, every: int | Mapping[str, int] | Cadence | None) -> Cadence:
        if every is None:
            return cls()
        if isinstance(every, Cadence):
            return every
        if isinstance(every, bool) or not isinstance(every, (int, Mapping)):
            raise TypeError(f"rankwatch.init: every= takes an int, a dict of probe→steps or a Cadence, got {type(every).__name__}")
        if isinstance(every, int):
            if every < 1:
                raise ValueError(f"rankwatch.init: every= must be at least 1, got {every}")
            # One number sets the cadence of the expensive probes; the cheap ones stay per step.
            return cls(activations=every, spectral=every, sketch=every)
        names = {f.name for f in fields(cls)}
        unknown = set(every) - names
        if unknown:
            raise ValueError(f"rankwatch.init: unknown probe(s) in every=: {sorted(unknown)}; known: {sorted(names)}")
        for k, v in every.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"rankwatch.init: every[{k!r}] must be an int >= 0, got {v!r}")
        return cls(**dict(every))

    @staticmethod
    def due(every: int, step: int) -> bool:
        return every > 0 and step % every == 0


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"rankwatch.init: environment variable {name}={raw!r} is not an integer") from None


def _run_id(run: str | None) -> str:
    candidate = run or os.environ.get("RANKWATCH_RUN")
    if not candidate:
        elastic = os.environ.get("TORCHELASTIC_RUN_ID")
        candidate = elastic if elastic and elastic != "none" else None
    if not candidate:
        candidate = time.strftime("run-%Y%m%d-%H%M%S")
    cleaned = _RUN_ID.sub("-", candidate).strip(".-")[:128]
    if not cleaned:
        raise ValueError(f"rankwatch.init: run name {candidate!r} has no usable characters ([A-Za-z0-9._-])")
    return cleaned


class Run:
    """One rank's view of a monitored training run. Create it with `rankwatch.init`."""

    def __init__(
        self,
        run: str,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        collector: str,
        mode: str,
        cadence: Cadence,
        spool_dir: Path | None,
        token: str | None,
        tags: Mapping[str, str],
        dot_mode: bool,
        sketch_dim: int,
    ) -> None:
        self.id = run
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.collector = collector
        self.mode = mode
        self.cadence = cadence
        self.spool_dir = spool_dir
        self.tags = dict(tags)
        self.dot_mode = dot_mode
        self.sketch_dim = sketch_dim
        self._agent: Any = None
        if mode != "disabled":
            self._agent = _native.Agent(
                run,
                rank,
                collector,
                token=token,
                mode=mode,
                spool_dir=str(spool_dir) if spool_dir is not None else None,
            )
        self._finished = False
        self._warned: set[str] = set()
        self._reporter: Reporter | None = None
        self._device = torch.device("cpu")
        self._layout: Any = None
        self._spectral: Any = None
        self._activations: Any = None
        self._grad_state: Any = None
        self._optimizer_hook: Any = None
        self._local_grad_sq: torch.Tensor | None = None
        self._alert_callbacks: list[Callable[[dict[str, Any]], None]] = []
        self._last_health_check = 0.0
        self._last_step: int | None = None
        self.last_values: dict[SeriesKey, float] = {}
        self._announce(None)

    # -- setup ---------------------------------------------------------------------------

    def _announce(self, layout_info: dict[str, Any] | None) -> None:
        if self._agent is None:
            return
        import json

        layout = layout_info or {"family": "", "layers": []}
        self._agent.set_info(self.world_size, json.dumps(layout), {k: str(v) for k, v in self.tags.items()})

    def watch(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        mapping: Mapping[str, Any] | None = None,
        activations: bool = True,
        spectral: bool = True,
        gate: bool = False,
        ddp: torch.nn.parallel.DistributedDataParallel | None = None,
    ) -> Run:
        """Finds the model's blocks and installs the probes (and the DDP hook under DDP).

        Raises `rankwatch.DiscoveryError` when the model's layout cannot be found; pass
        `mapping=` to describe it. Call before `torch.compile` and before the first backward.
        `ddp=` names the DistributedDataParallel wrapper when `model` is the module inside it
        (frameworks that wrap a container module).
        """
        if self._agent is None:
            return self
        from .discovery import discover

        layout = discover(model, mapping=dict(mapping) if mapping is not None else None)
        self._layout = layout
        try:
            self._device = next(model.parameters()).device
        except StopIteration:
            raise ValueError("rankwatch.watch: the model has no parameters") from None
        self._reporter = Reporter(self._agent, self._device, self._remember)
        self._announce(layout.to_info())
        if spectral and self.cadence.spectral > 0 and layout.blocks:
            from .spectral import SpectralProbe

            # Weights are identical on every data-parallel rank: rank 0 measures for all.
            if self.rank == 0:
                self._spectral = SpectralProbe(layout)
        if activations and self.cadence.activations > 0:
            from .activations import ActivationProbe

            self._activations = ActivationProbe(model, layout, gate=gate)
            if Cadence.due(self.cadence.activations, 0):
                self._activations.arm()
        if ddp is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            ddp = model
        if ddp is not None and self.cadence.grad > 0:
            from .ddp import install

            self._grad_state = install(ddp, dot_mode=self.dot_mode, sketch_dim=self.sketch_dim, sketch_seed=_sketch_seed(self.id))
            self._grad_state.sketch_due = Cadence.due(self.cadence.sketch, 0)
        elif optimizer is not None and self.cadence.grad > 0:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self._local_grad_sq = torch.zeros((), dtype=torch.float64, device=self._device)

            def before_step(opt: Any, args: Any, kwargs: Any) -> None:
                grads = [p.grad for p in params if p.grad is not None]
                if grads and self._local_grad_sq is not None:
                    norms = torch._foreach_norm(grads)
                    self._local_grad_sq.copy_(torch.stack(norms).double().pow(2).sum())

            self._optimizer_hook = optimizer.register_step_pre_hook(before_step)
        return self

    # -- the hot path ----------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, Any] | None = None, /, loss: Any = None, tokens: Any = None, **scalars: Any) -> None:
        """Records this rank's values for `step`: `run.log(step, loss=l, tokens=n, lr=lr)`, or
        with a dict, `run.log(step, {"loss": l, "lr": lr})` (cheapest for many scalars: the
        dict is read as it is, never copied). Tensors are accepted and never read on the
        training thread; names outside the vocabulary are stored as `user/<name>`."""
        if self._agent is None:
            return
        if self._finished:
            self._warn("after-finish", "rankwatch: log() after finish() is ignored")
            return
        if self._alert_callbacks:
            self._deliver_alerts()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            self._warn(f"step-{type(step).__name__}", f"rankwatch: log() needs a step that is an int >= 0, got {step!r}; the call is ignored")
            return
        if loss is not None:
            scalars["loss"] = loss
        if tokens is not None:
            scalars["tokens"] = tokens
        if metrics is not None:
            if not isinstance(metrics, Mapping):
                self._warn("metrics-type", f"rankwatch: log(step, metrics) needs a dict of name → value, got {type(metrics).__name__}; ignored")
                return
            scalars = {**metrics, **scalars} if scalars else metrics  # type: ignore[assignment]
        try:
            others = self._agent.log(step, scalars if isinstance(scalars, dict) else dict(scalars)) if scalars else None
        except ValueError as e:
            self._warn(f"log-{e}", f"rankwatch: log(step={step}) ignored: {e}")
            return
        except RuntimeError as e:
            self._warn("closed", f"rankwatch: {e}")
            return
        keys: list[SeriesKey] = []
        values: list[torch.Tensor] = []
        if others:
            for name in others:
                self._take_other(name, scalars[name], keys, values)
        self._probe(step, keys, values)
        self._last_step = step
        self._health()

    def _take_other(self, name: str, value: Any, keys: list[SeriesKey], values: list[torch.Tensor]) -> None:
        metric = name if _VOCABULARY.get(name) == "rank" else (name if name.startswith("user/") else f"user/{name}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                self._warn(f"shape-{name}", f"rankwatch: log() value {name!r} is a tensor of shape {tuple(value.shape)}; only single-element tensors are logged")
                return
            if not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.bool)):
                self._warn(f"dtype-{name}", f"rankwatch: log() value {name!r} has dtype {value.dtype}; skipped")
                return
            keys.append((metric, None, None, False))
            values.append(value)
            if name == "loss":
                # nonfinite counts NaN/Inf in the loss (and, under DDP, the gradients).
                keys.append(("nonfinite", None, None, False))
                nonfinite = (~torch.isfinite(value.detach())).sum().double()
                if self._grad_state is not None:
                    nonfinite = nonfinite + self._grad_state.nonfinite
                values.append(nonfinite)
            return
        if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalars: host values
            try:
                number = float(value.item())
            except (TypeError, ValueError):
                pass
            else:
                keys.append((metric, None, None, False))
                values.append(torch.tensor(number, dtype=torch.float64))
                return
        self._warn(f"type-{name}", f"rankwatch: log() value {name!r} is a {type(value).__name__}; expected a number or a tensor, skipped")

    def _probe(self, step: int, keys: list[SeriesKey], values: list[torch.Tensor]) -> None:
        reporter = self._reporter
        if reporter is None:
            if values:
                # No watch(): tensors logged by hand still go through a CPU/device reporter.
                device = values[0].device
                self._reporter = reporter = Reporter(self._agent, device, self._remember)
            else:
                return
        sketch = None
        gs = self._grad_state
        if gs is not None and gs.steps_seen > 0:
            local = gs.local_sq.sqrt()
            mean = gs.mean_sq.sqrt()
            keys += [("grad_norm", None, None, False), ("grad_norm_mean", None, None, False)]
            values += [local, mean]
            if gs.dot_mode:
                keys.append(("cos_to_mean", None, None, False))
                values.append(gs.dot / (local * mean).clamp_min(1e-300))
            if gs.sketch_due:
                sketch = (gs.sketch.clone(), gs.sketch_seed)
            gs.reset()
            gs.sketch_due = Cadence.due(self.cadence.sketch, step + 1)
        elif self._local_grad_sq is not None:
            keys.append(("grad_norm", None, None, False))
            values.append(self._local_grad_sq.sqrt())
        if self._activations is not None:
            if self._activations.armed:
                for metric, layer, site, tensor in self._activations.collect():
                    keys.append((metric, layer, site, False))
                    values.append(tensor)
                self._activations.disarm()
            if Cadence.due(self.cadence.activations, step + 1):
                self._activations.arm()
        if self._spectral is not None and Cadence.due(self.cadence.spectral, step):
            for metric, layer, site, tensor in self._spectral.compute():
                keys.append((metric, layer, site, True))
                values.append(tensor)
        reporter.drain()
        if values or sketch is not None:
            reporter.submit(step, keys, values, sketch)

    def _remember(self, step: int, keys: Any, values: list[float]) -> None:
        for key, value in zip(keys, values):
            self.last_values[key] = value
            if key[0] == "loss" and not math.isfinite(value):
                self._warn("nonfinite-loss", f"rankwatch: loss is {value} at step {step} on rank {self.rank}; it is stored and counted (metric 'nonfinite')")

    # -- health and lifecycle ----------------------------------------------------------------

    def _health(self) -> None:
        now = time.monotonic()
        if now - self._last_health_check < 2.0:
            return
        self._last_health_check = now
        stats = self._agent.stats()
        if self.mode == "online" and not stats["connected"] and stats["retries"] > 0:
            where = f"; spooling to {self.spool_dir}" if self.spool_dir else ""
            self._warn("unreachable", f"rankwatch: collector {self.collector} unreachable ({stats['last_error']}){where}. Training continues.")
        if stats["dropped_rows"] > 0:
            self._warn("dropped", f"rankwatch: {stats['dropped_rows']} values dropped so far ({stats['last_error']}); the count is reported to the collector as 'dropped'")

    def _warn(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, RankwatchWarning, stacklevel=3)

    def on_alert(self, callback: Callable[[dict[str, Any]], None], *, poll_interval: float = 2.0) -> None:
        """Registers a function called with each alert the collector raises for this run: when
        it fires, escalates, and resolves. The agent polls the collector every `poll_interval`
        seconds on a thread of its own; callbacks run on the training thread, inside the next
        `log()` (or `finish()`), so they may checkpoint, or raise to stop the job. The dict is
        the collector's alert as of that poll: id, rule, severity, state, layer, rank,
        outlier_ranks, value, threshold, first_step, last_step, fired_at_ms, explanation, ...
        An alert that fired and resolved between two polls arrives once, resolved, with
        `fired_at_ms` set: test `fired_at_ms`, not `state`, to ask "did it fire". An exception in a callback is
        reported as a warning unless it is meant to stop the job (SystemExit,
        KeyboardInterrupt, or an exception the callback raises with `stop=True` set)."""
        if not callable(callback):
            raise TypeError("rankwatch: on_alert needs a callable")
        self._alert_callbacks.append(callback)
        if self._agent is not None and not self._finished:
            if not self._agent.watch_alerts(poll_interval):
                self._warn("alerts-offline", "rankwatch: on_alert has no effect in offline mode (no collector to hear alerts from)")

    def _deliver_alerts(self) -> None:
        """Calls the on_alert callbacks with what the feed brought since the last call."""
        if not self._alert_callbacks or self._agent is None:
            return
        texts = self._agent.take_alerts()
        if not texts:
            return
        import json

        for text in texts:
            alert = json.loads(text)
            for callback in self._alert_callbacks:
                try:
                    callback(alert)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except Exception as e:  # noqa: BLE001 - a broken callback must not end the job
                    if getattr(e, "stop", False):
                        raise
                    self._warn(f"callback-{id(callback)}", f"rankwatch: on_alert callback {callback!r} raised {e!r}; further alerts are still delivered")

    def stats(self) -> dict[str, Any]:
        """The agent's counters: sent, retried, spooled, dropped, last error."""
        return dict(self._agent.stats()) if self._agent is not None else {}

    def flush(self, timeout: float = 10.0) -> bool:
        """Delivers what was logged so far, waiting at most `timeout` seconds."""
        if self._agent is None or self._finished:
            return True
        if self._reporter is not None:
            self._reporter.drain(wait=True)
        return bool(self._agent.flush(timeout))

    def finish(self, timeout: float = 10.0) -> dict[str, Any]:
        """Ends the run: removes the probes, delivers what it can within `timeout`, spools the
        rest. Calling it twice is harmless (the second call warns and returns the stats)."""
        if self._agent is None:
            return {}
        if self._finished:
            self._warn("finish-twice", "rankwatch: finish() called twice; the second call does nothing")
            return dict(self._agent.stats())
        self._deliver_alerts()
        self._finished = True
        if self._reporter is not None:
            try:
                self._reporter.drain(wait=True)
            except Exception as e:  # noqa: BLE001 - finishing must not raise into the job
                self._warn("drain", f"rankwatch: could not read back the last report: {e}")
        if self._activations is not None:
            self._activations.remove()
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
        stats = dict(self._agent.shutdown(timeout))
        if self.mode == "online" and not stats["ever_connected"]:
            where = f" They wait in {self.spool_dir}; send them with rankwatch.sync({str(self.spool_dir)!r})." if stats["spooled_batches"] else ""
            self._warn("never-connected", f"rankwatch: the run finished without reaching the collector at {self.collector}.{where}")
        elif self.mode == "online" and stats["backlog_batches"]:
            self._warn("undelivered", f"rankwatch: {stats['backlog_batches']} batches were not delivered before finish(); they are spooled in {self.spool_dir}")
        return stats

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.finish()


def _sketch_seed(run: str) -> int:
    """The same seed on every rank of a run, and a different one per run."""
    import zlib

    return zlib.crc32(run.encode())


def init(
    run: str | None = None,
    collector: str | None = None,
    *,
    mode: str | None = None,
    every: int | Mapping[str, int] | Cadence | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    token: str | None = None,
    tags: Mapping[str, Any] | None = None,
    dot_mode: bool = True,
    sketch_dim: int = 1024,
) -> Run:
    """Starts monitoring this process's rank of a training run.

    Rank and world size come from the torchrun environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    `TORCHELASTIC_RUN_ID` names the run when `run` is not given). `mode` is "online" (stream to
    `collector`, spooling to disk while it is away), "offline" (spool only; send later with
    `rankwatch.sync`) or "disabled" (every call is a no-op). Settings also come from
    `RANKWATCH_COLLECTOR`, `RANKWATCH_MODE`, `RANKWATCH_RUN`, `RANKWATCH_INGEST_TOKEN` and
    `RANKWATCH_SPOOL_DIR`.
    """
    mode = mode or os.environ.get("RANKWATCH_MODE", "online")
    if mode not in ("online", "offline", "disabled"):
        raise ValueError(f"rankwatch.init: mode must be 'online', 'offline' or 'disabled', got {mode!r}")
    run_id = _run_id(run)
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rankwatch.init: rank {rank} is not within world size {world_size}")
    collector = collector or os.environ.get("RANKWATCH_COLLECTOR") or DEFAULT_COLLECTOR
    if mode != "disabled" and not collector.startswith("http://"):
        raise ValueError(f"rankwatch.init: collector must be an http:// URL, got {collector!r}")
    if sketch_dim < 1:
        raise ValueError("rankwatch.init: sketch_dim must be at least 1")
    spool: Path | None = None
    if mode != "disabled":
        root = spool_dir or os.environ.get("RANKWATCH_SPOOL_DIR") or Path.home() / ".cache" / "rankwatch" / "spool"
        spool = Path(root) / run_id / f"rank-{rank}"
    return Run(
        run_id,
        rank=rank,
        world_size=world_size,
        local_rank=_env_int("LOCAL_RANK", 0),
        collector=collector,
        mode=mode,
        cadence=Cadence.parse(every),
        spool_dir=spool,
        token=token or os.environ.get("RANKWATCH_INGEST_TOKEN"),
        tags=tags or {},
        dot_mode=dot_mode,
        sketch_dim=sketch_dim,
    )


def sync(spool_dir: str | os.PathLike[str], collector: str | None = None, *, token: str | None = None) -> dict[str, Any]:
    """Sends what an offline run (or a process that lost its collector) left in `spool_dir`.

    `spool_dir` may be one rank's directory or a run's (all its `rank-*` directories)."""
    collector = collector or os.environ.get("RANKWATCH_COLLECTOR") or DEFAULT_COLLECTOR
    root = Path(spool_dir)
    dirs = sorted(p for p in root.glob("rank-*") if p.is_dir()) or [root]
    total: dict[str, Any] = {"batches": 0, "rows": 0, "duplicates": 0, "refused_rows": 0, "corrupt": 0, "remaining": 0, "errors": []}
    for d in dirs:
        report = _native.sync(str(d), collector, token or os.environ.get("RANKWATCH_INGEST_TOKEN"))
        for k, v in report.items():
            total[k] = total[k] + v
    return total
