"""The user-facing run: `init`, `watch`, `log`, `finish`.

A `Run` owns one native agent (the Rust sender thread, queue and spool) and the torch probes
installed by `watch`. `log(step, ...)` is the only call on the training thread's hot path: it
passes plain numbers straight to the native agent, collects tensors (never reading them), lets
each probe add its device scalars when its cadence is due, and submits them all as one report
(see `report.py`). No call here raises into the training loop for something that is the
monitoring's problem — a missing collector, a bad value, a failing probe, a call after
`finish` — it warns once, counts, and carries on; mistakes in how rankwatch itself is
configured (`init`, `watch`) raise.

Its parts live beside it: when each probe is due (`cadence.py`), what `log` accepts
(`values.py`), the spectral probe's schedule and budget (`spectral_schedule.py`), alert
callbacks (`alert_feed.py`), and `init` with the settings it reads (`settings.py`).

A run the process never finished is finished at the interpreter's exit (`at_exit.py`, as
wandb does): without it the zero-code agent, which has no place to call `finish`, never told
the collector its ranks ended, and what the sender held when the process exited reached the
collector only if its timer fired first.

The agent is made on first use, not in `init`: `watch` may find that the data-parallel group
is a subgroup of the world, and then the run is that group's (see `topology.py`).

`init(mode="disabled")` returns a `NoopRun` instead: a `Run` whose every public method does
nothing, so that scripts, integrations and the zero-code agent call the same interface whether
or not the process reports, and `Run` itself never asks whether it is disabled (as wandb's
disabled mode hands out a run object that does nothing).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, SupportsFloat, TypedDict

import torch

from . import _native, at_exit
from .alert_feed import AlertCallback, AlertFeed
from .budget import StepClock
from .cadence import Cadence, ProbeSchedule
from .learning_rate import LearningRateProbe
from .report import Reporter, SeriesKey
from .sharding import check_sharding
from .topology import ReplicaGroup, clean_run_id
from .values import LoggedValues

if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import NoReturn, TypeAlias

    from torch.utils.hooks import RemovableHandle
    from typing_extensions import Unpack

    from ._native import AgentStats
    from .activations import ActivationProbe
    from .fingerprint import ReplicaFingerprint
    from .gradients import GradientProbe
    from .layout import Layout
    from .offline import AgentMode, Mode
    from .spectral_schedule import ScheduledSpectral
    from .structure import BlockCall, NeedsCall

    # What `stats()` and `finish()` return: the agent's counters, or `{}` from a `NoopRun`.
    RunStats: TypeAlias = AgentStats | dict[str, NoReturn]


class RankwatchWarning(UserWarning):
    """Monitoring trouble that must not stop training (collector away, bad value, misuse)."""


class WatchOptions(TypedDict, total=False):
    """`watch`'s keyword options, as `watch_or_warn` passes them on."""

    mapping: Mapping[str, object] | None
    activations: bool
    compiled_activations: bool
    spectral: bool
    gate: bool
    ddp: torch.nn.parallel.DistributedDataParallel | None
    scaler: torch.amp.GradScaler | None
    spectral_budget: float
    effective_rank_probes: int


# The process's unfinished runs: the zero-code agent stands aside where the script has its own.
_live_runs: weakref.WeakSet[Run] = weakref.WeakSet()


def live_runs() -> list[Run]:
    """The runs of this process that are not finished."""
    return [r for r in _live_runs if not r.finished]


def _finish_at_exit(failed: bool) -> None:
    """Finishes, at the interpreter's exit, each run this process made and left unfinished
    (see `at_exit.py`): what it holds is delivered within one deadline shared by all of them
    (the rest spooled), and unless the process is ending in failure, the collector is told the
    rank ended."""
    deadline = time.monotonic() + at_exit.EXIT_TIMEOUT_S
    for run in live_runs():
        if run._pid != os.getpid():
            continue  # a forked child's copy: its sender thread did not survive the fork
        try:
            run._crashed = run._crashed or failed
            run._end(max(0.0, deadline - time.monotonic()), exiting=True)
        except BaseException as e:  # noqa: BLE001 - an exit handler must not raise, and the next run still ends
            print(f"rankwatch: could not finish run {run.id!r} at exit: {e!r}", file=sys.stderr)


class Run:
    """One rank's view of a monitored training run. Create it with `rankwatch.init`."""

    # The public attributes (set by `_init_public`, for `Run` and `NoopRun` alike).
    id: str
    rank: int
    world_size: int
    global_rank: int
    global_world_size: int
    local_rank: int
    collector: str
    cadence: Cadence
    spool_dir: Path | None
    tags: dict[str, object]
    dot_mode: bool
    sketch_dim: int

    def __init__(
        self,
        run: str,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        collector: str,
        mode: AgentMode,
        cadence: Cadence,
        spool_dir: Path | None,
        token: str | None,
        tags: Mapping[str, object],
        dot_mode: bool,
        sketch_dim: int,
        replica_group: ReplicaGroup | None = None,
    ) -> None:
        self._init_public(run, rank, world_size, local_rank, collector, cadence, tags, dot_mode, sketch_dim)
        self.mode: Mode = mode
        self._agent_mode: AgentMode = mode
        self._spool_root = spool_dir
        self._token = token
        self._replica_group = replica_group
        self._agent: _native.Agent | None = None
        self._finished = False
        self._crashed = False
        self._warned: set[str] = set()
        self._reporter: Reporter | None = None
        self._device = torch.device("cpu")
        self._layout: Layout | None = None
        self._spectral: ScheduledSpectral | None = None
        self._activations: ActivationProbe | None = None
        self._gradients: GradientProbe | None = None
        self._fingerprint: ReplicaFingerprint | None = None
        self._optimizer_hook: RemovableHandle | None = None
        self._learning_rate: LearningRateProbe | None = None
        self._stop_scaler_listener: Callable[[], None] | None = None
        # Blocks traced on a real call: what to install, and the capturing hook; then the call
        # (or why it could not be captured).
        self._awaiting: tuple[_LayerProbes, RemovableHandle] | None = None
        self._block_call: BlockCall | BaseException | None = None
        self._schedule = ProbeSchedule()
        self._clock = StepClock()
        self._values = LoggedValues(self._warn)
        self._alerts = AlertFeed(self._warn)
        self._last_health_check = 0.0
        self.last_values: dict[SeriesKey, float] = {}
        self._pid = os.getpid()
        if replica_group is not None:
            self._join(replica_group)
        _live_runs.add(self)
        at_exit.watch(_finish_at_exit)

    # -- setup ---------------------------------------------------------------------------

    def _join(self, group: ReplicaGroup) -> None:
        """Makes this run the run of data-parallel `group` (before the agent exists)."""
        self._replica_group = group
        suffix = group.run_suffix(self.global_world_size)
        if suffix:
            self.id = clean_run_id(self.id + suffix)
            self.rank = group.rank_of(self.global_rank)
            self.world_size = len(group.ranks)
            self.tags["global_ranks"] = ",".join(map(str, group.ranks))

    def _connect(self) -> _native.Agent:
        """The native agent, made on first use."""
        if self._agent is None:
            if self._spool_root is not None:
                self.spool_dir = self._spool_root / self.id / f"rank-{self.rank}"
            self._agent = _native.Agent(
                self.id,
                self.rank,
                self.collector,
                token=self._token,
                mode=self._agent_mode,
                spool_dir=str(self.spool_dir) if self.spool_dir is not None else None,
            )
            self._announce(self._agent)
        return self._agent

    def _announce(self, agent: _native.Agent) -> None:
        layout = self._layout.to_info() if self._layout is not None else {"family": "", "layers": []}
        agent.set_info(self.world_size, json.dumps(layout), {k: str(v) for k, v in self.tags.items()})

    def _init_public(
        self,
        run: str,
        rank: int,
        world_size: int,
        local_rank: int,
        collector: str,
        cadence: Cadence,
        tags: Mapping[str, object],
        dot_mode: bool,
        sketch_dim: int,
    ) -> None:
        """The public attributes every run has, reporting or not (`NoopRun` shares them)."""
        self.id = run
        self.rank = rank
        self.world_size = world_size
        self.global_rank = rank
        self.global_world_size = world_size
        self.local_rank = local_rank
        self.collector = collector
        self.cadence = cadence
        self.spool_dir = None
        self.tags = dict(tags)
        self.dot_mode = dot_mode
        self.sketch_dim = sketch_dim

    def watch(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        mapping: Mapping[str, object] | None = None,
        activations: bool = True,
        compiled_activations: bool = False,
        spectral: bool = True,
        gate: bool = False,
        ddp: torch.nn.parallel.DistributedDataParallel | None = None,
        scaler: torch.amp.GradScaler | None = None,
        spectral_budget: float = 0.01,
        effective_rank_probes: int = 64,
    ) -> Run:
        """Finds the model's blocks and installs the probes.

        The probes that need no map of the model — the loss and the gradient probe (each
        rank's gradient norm, the averaged gradient's norm, the cosine between them, the
        sketch, non-finite counts) — are installed whatever the model looks like. The layer
        probes (spectral norms, activations) need its blocks: when discovery cannot find them,
        those two are off, with one warning that says why and how to describe the model
        (`mapping=` here, `--mapping` to `rankwatch run` / `rankwatch attach`), and the run's
        tags carry the same (`layer_probes`), for the dashboard. A `mapping` that does not fit
        the model raises `rankwatch.DiscoveryError` naming the path: that is a mistake in how
        rankwatch is configured. Call before `torch.compile` and before the first backward.
        `model` may be the DistributedDataParallel wrapper or the module inside it; `ddp=` names
        the wrapper when it wraps a container of `model` (a wrapper of `model` itself is found
        on its own, even one made after `watch`). `optimizer` lets activation maxima describe
        one optimizer step; `scaler` (a `torch.amp.GradScaler`) lets gradient norms be
        reported unscaled and skipped steps as `amp_skipped` (without it, the scaler whose
        `scale()` scaled the loss is found and used; see `scaling.py`). Every probe reads; none writes a
        gradient or draws from a random stream, and `finish()` removes them all.

        Sharded models (see docs/parallelism.md): under FSDP2 (`fully_shard`; call `watch`
        after it) the gradient probe adds one small all-reduce per reducing backward, and
        sharded or tensor-parallel weights are measured by every rank together, at the same
        optimizer steps — pass `optimizer`. FSDP1, DeepSpeed ZeRO and tensor-parallel
        gradients are refused here with a message saying what is supported. The spectral probe
        keeps its amortised cost under `spectral_budget` (a fraction of step time) by covering
        fewer layers per call. `effective_rank_probes` sets how many probe vectors estimate each
        block's `effective_rank` (exact up to that width; 0 turns the metric off).

        torch.compile: watched before compiling, the activation hooks are traced into the
        graphs but measure nothing there unless `compiled_activations=True` — observing an
        activation inside a compiled graph changes what inductor fuses, and so possibly the
        step's arithmetic. Opted in, arming costs one graph more (armed and disarmed), no graph
        break. A model compiled before `watch` never calls hooks added later: the activation
        probe is off there, said so. Every other probe runs in compiled jobs either way.
        """
        if self._gradients is not None or self._activations is not None or self._spectral is not None or self._awaiting is not None:
            raise RuntimeError("rankwatch.watch: this run already watches a model; call finish() first")

        wrapper = ddp
        given = model
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            wrapper, model = model, model.module
        params = list(model.parameters())
        if not params:
            raise ValueError("rankwatch.watch: the model has no parameters")
        want_spectral = spectral and self.cadence.spectral > 0
        fsdp = check_sharding(given, model, params, grad=self.cadence.grad > 0, spectral=want_spectral)
        # Accelerate (and others) wrap the optimizer: hooks belong on the torch optimizer inside,
        # and its loss scaler is the one the gradients were scaled with.
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            scaler = scaler if scaler is not None else getattr(optimizer, "scaler", None)
            optimizer = inner
        plan = _LayerProbes(
            model,
            optimizer,
            _compiled(given),
            want_spectral,
            activations and self.cadence.activations > 0,
            compiled_activations,
            gate,
            spectral_budget,
            effective_rank_probes,
        )
        layout = self._discover(plan, mapping)
        self._layout = layout
        self._device = params[0].device
        if wrapper is not None and self._agent is None and self._replica_group is None:
            group = ReplicaGroup.of(wrapper.process_group)
            if group is not None:
                self._join(group)
        elif wrapper is not None and self._agent is not None:
            group = ReplicaGroup.of(wrapper.process_group)
            if group is not None and group.run_suffix(self.global_world_size):
                self._warn(
                    "late-group",
                    "rankwatch: the data-parallel group is a subgroup, but this run already reported as the whole world; "
                    "call watch() before the first log() so the statistics compare replicas only",
                )
        if self._agent is not None:
            self._announce(self._agent)  # the run was announced before its layout was known
        agent = self._connect()
        self._reporter = Reporter(agent, self._device, self._remember)
        if layout is not None:
            self._install_layer_probes(plan, layout)
        self._watch_fingerprint(model, layout, sharded=fsdp is not None or _has_dtensor(params), ddp=wrapper, optimizer=optimizer)
        if optimizer is not None:
            self._learning_rate = LearningRateProbe(optimizer)
        if self.cadence.grad > 0:
            from .gradients import GradientProbe

            self._gradients = GradientProbe(
                params,
                wrapper=wrapper,
                find_wrapper_of=model,
                scaler=scaler,
                dot_mode=self.dot_mode,
                sketch_dim=self.sketch_dim,
                sketch_seed=_sketch_seed(self.id),
                fsdp=fsdp,
            )
            self._gradients.sketch_armed = self.cadence.sketch > 0
            if self._gradients.sketch_armed:
                self._gradients.warm_up_sketch()
            self._gradients.dot_armed = self.cadence.dot > 0
            from .scaling import listen

            self._stop_scaler_listener = listen(self._gradients.saw_scale)
        return self

    def _install_layer_probes(self, plan: _LayerProbes, layout: Layout) -> None:
        """The spectral and activation probes over `layout` (at `watch`, or at the first `log`
        after the blocks' first forward when they had to be traced on a real call)."""
        if plan.spectral and layout.blocks:
            from .spectral_schedule import ScheduledSpectral

            self._spectral = ScheduledSpectral(
                layout,
                run_id=self.id,
                rank=self.rank,
                world_size=self.world_size,
                device=self._device,
                optimizer=plan.optimizer,
                every=self.cadence.spectral,
                fraction=plan.budget,
                erank_probes=plan.erank_probes,
                step_ms=lambda: self._clock.ms,
                failed=lambda e: self._probe_failed("spectral", e),
            )
        if not plan.activations:
            return
        if plan.compiled:
            # Graphs compiled before a hook existed never call it (dynamo does not guard on
            # hooks by default): the probe would be armed and see nothing, silently.
            self.tags["activations"] = "off: the model was compiled before watch()"
            self._warn(
                "compiled",
                "rankwatch: activation probe off: the model is already compiled (torch.compile), and its graphs do not run hooks "
                "added after compiling; to measure activations, call watch(..., compiled_activations=True) before torch.compile. "
                "Every other probe runs.",
            )
            return
        from .activations import ActivationProbe

        self._activations = probe = ActivationProbe(plan.model, layout, gate=plan.gate, training_only=True, compiled=plan.compiled_activations)
        probe.arm()  # the first logged step, whichever it is
        if plan.optimizer is not None:
            self._optimizer_hook = plan.optimizer.register_step_post_hook(lambda *_: probe.new_step())

    def _compiled_activations_off(self) -> None:
        """The model was compiled after watch() and the hooks ran inside its graphs, not opted in."""
        self._set_tag("activations", "off in compiled graphs (opt in: watch(..., compiled_activations=True))")
        self._warn(
            "compiled-activations",
            "rankwatch: activation probe off inside torch.compile graphs: measuring activations there adds reductions that "
            "inductor fuses with the training step's own kernels, which can change its arithmetic. Modules that run eagerly are "
            "still measured; opt in with watch(model, ..., compiled_activations=True) (arming then costs at most two graphs, "
            "no graph break). Every other probe runs.",
        )

    def _discover(self, plan: _LayerProbes, mapping: Mapping[str, object] | None) -> Layout | None:
        """The model's layout. None when it cannot be found without a mapping: the layer probes
        are then off, said so once; or, for blocks whose forward wants arguments of its own,
        waiting for their first forward (`_await_call`)."""
        from .discovery import DiscoveryError, discover
        from .structure import NeedsCall

        if mapping is not None:
            layout = discover(plan.model, mapping=dict(mapping))
            self.tags["mapping"] = json.dumps(dict(mapping), sort_keys=True)
            return layout
        try:
            return discover(plan.model)
        except NeedsCall as e:
            if (plan.spectral or plan.activations) and not plan.compiled:
                self._await_call(plan, e)
                return None
            self._layer_probes_off(plan, e)
        except DiscoveryError as e:
            self._layer_probes_off(plan, e)
        except Exception as e:  # noqa: BLE001 - discovery's own failure must not end the job
            self._layer_probes_off(plan, RuntimeError(f"layer discovery failed ({type(e).__name__}: {e})"))
        return None

    def _layer_probes_off(self, plan: _LayerProbes, error: BaseException) -> None:
        off = [name for name, wanted in (("spectral", plan.spectral), ("activations", plan.activations)) if wanted]
        if not off:
            return
        self.tags["layer_probes"] = f"off ({', '.join(off)}): blocks not found"
        self._warn(
            "layer-probes-off",
            f"rankwatch: layer probes off ({', '.join(off)}): {error}. The loss and the gradient probe (grad_norm, "
            "grad_norm_mean, cos_to_mean, sketch, nonfinite) are on. To turn the layer probes on, describe the "
            "model: watch(model, mapping={'blocks': ..., 'q': ..., ...}) in the script, or "
            "`rankwatch run --mapping JSON -- ...` / `rankwatch attach --pid PID --mapping JSON` for a job you do not edit",
        )

    def _await_call(self, plan: _LayerProbes, error: NeedsCall) -> None:
        """A one-off forward pre-hook on the first block keeps meta copies of its arguments; the
        next `log()` traces the blocks on them and installs the layer probes. The hook only reads
        shapes and never raises into the forward."""
        from .structure import capture_call

        def capture(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
            try:
                if self._block_call is None:
                    self._block_call = capture_call(args, kwargs)
            except Exception as e:  # noqa: BLE001 - refused arguments end the wait, said at log()
                self._block_call = e
            handle = self._awaiting[1] if self._awaiting is not None else None
            if handle is not None:
                handle.remove()

        handle = error.block.register_forward_pre_hook(capture, with_kwargs=True)
        self._awaiting = (plan, handle)
        self.tags["layer_probes"] = "pending: the blocks are read at their first forward"

    def _resolve_call(self) -> None:
        """At the first `log()` after the blocks' first forward: trace them on its arguments."""
        from .discovery import DiscoveryError, discover

        assert self._awaiting is not None
        (plan, handle), self._awaiting = self._awaiting, None
        handle.remove()
        call, self._block_call = self._block_call, None
        self.tags.pop("layer_probes", None)
        try:
            if isinstance(call, BaseException):
                raise call
            layout = discover(plan.model, call=call)
        except DiscoveryError as e:
            self._layer_probes_off(plan, e)
            layout = None
        except Exception as e:  # noqa: BLE001 - inside log(): never into the training loop
            self._layer_probes_off(plan, RuntimeError(f"layer discovery failed ({type(e).__name__}: {e})"))
            layout = None
        if layout is not None:
            self._layout = layout
            try:
                self._install_layer_probes(plan, layout)
                if self._fingerprint is not None:  # now with its blocks
                    self._fingerprint.set_layout(layout)
            except Exception as e:  # noqa: BLE001 - inside log(): never into the training loop
                self._probe_failed("layer", e)
        if self._agent is not None:
            self._announce(self._agent)

    def _watch_fingerprint(
        self, model: torch.nn.Module, layout: Layout | None, *, sharded: bool, ddp: torch.nn.parallel.DistributedDataParallel | None, optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """The replica fingerprint of `model` (see fingerprint.py: it reports only once the
        ranks are known to be DDP replicas)."""
        from .fingerprint import ReplicaFingerprint

        if self.cadence.fingerprint <= 0 or self.world_size < 2:
            return  # off, or a single replica: nothing to compare
        replica = None  # HSDP: this rank's replica set
        if sharded:
            from .sharding import replica_set

            found = replica_set([p for p in model.parameters() if p.requires_grad])
            if isinstance(found, str):
                self._set_tag("replica_fingerprint", found)
                return
            replica = found
        self._fingerprint = ReplicaFingerprint(model, layout, ddp, optimizer, self.world_size, replica)

    def _report_fingerprint(self, fingerprint: ReplicaFingerprint, keys: list[SeriesKey], values: list[torch.Tensor], *, optimizer: bool) -> None:
        """The replica digests, when the ranks are replicas; why not, or what DDP leaves out,
        in the run's tags."""
        ready = fingerprint.ready(self._find_ddp)
        for name, value in (
            ("replica_fingerprint", fingerprint.off),
            ("replica_fingerprint_ignored", fingerprint.ignored),
            ("replica_fingerprint_tensors", fingerprint.tensors if ready else ""),
        ):
            if value and self.tags.get(name) != value:
                self._set_tag(name, value)
        if ready:
            fingerprint.report(keys, values, optimizer=optimizer)

    def _find_ddp(self, model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | bool | None:
        """`model`'s DDP wrapper: the gradient probe's, found at its first backward (None until
        then), or, with that probe off, looked for once here (False: none)."""
        if self._gradients is not None:
            return self._gradients.ddp_wrapper
        from .sharding import find_ddp_wrapper

        return find_ddp_wrapper(model) or False

    def _set_tag(self, name: str, value: str) -> None:
        """A tag the collector hears of at once (the dashboard's notices read them)."""
        self.tags[name] = value
        if self._agent is not None:
            self._announce(self._agent)

    # -- the hot path ----------------------------------------------------------------------

    def log(
        self,
        step: int,
        metrics: Mapping[str, SupportsFloat] | None = None,
        /,
        loss: SupportsFloat | None = None,
        tokens: SupportsFloat | None = None,
        **scalars: SupportsFloat,
    ) -> None:
        """Records this rank's values for `step`: `run.log(step, loss=l, tokens=n, lr=lr)`, or
        with a dict, `run.log(step, {"loss": l, "lr": lr})` (cheapest for many scalars: the
        dict is read as it is, never copied). Tensors are accepted and never read on the
        training thread; names outside the vocabulary are stored as `user/<name>`. Never
        raises for a value: a bad one is skipped, warned about once, and counted (`rejected`)."""
        if self._in_forked_child("log"):
            return
        if self._finished:
            self._warn("after-finish", "rankwatch: log() after finish() is ignored")
            return
        agent = self._connect()
        self._alerts.deliver(agent)
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
        values_in: dict[str, SupportsFloat]  # tensors, numpy scalars, numbers; other types are warned about
        if metrics is None:
            values_in = scalars
        elif scalars:
            values_in = {**metrics, **scalars}
        else:
            values_in = metrics if isinstance(metrics, dict) else dict(metrics)  # a dict is read as it is
        try:
            others = self._values.send(agent, step, values_in)
        except RuntimeError as e:
            self._warn("closed", f"rankwatch: {e}")
            return
        keys: list[SeriesKey] = []
        values: list[torch.Tensor] = []
        for name in others or ():
            self._values.take(name, values_in[name], keys, values)
        try:
            self._probe(agent, step, keys, values, learning_rate_logged="learning_rate" in values_in)
        except Exception as e:  # noqa: BLE001 - the step goes on without this report
            self._warn(f"report-{type(e).__name__}", f"rankwatch: the report of step {step} failed ({e!r}); training continues")
        self._clock.tick(step, self._schedule.last_step)
        self._schedule.logged(step)
        self._health(agent)

    def _probe(self, agent: _native.Agent, step: int, keys: list[SeriesKey], values: list[torch.Tensor], *, learning_rate_logged: bool = False) -> None:
        if self._awaiting is not None and self._block_call is not None:
            self._resolve_call()
        reporter = self._reporter
        if reporter is None:
            if values or self._values.unreported():
                # No watch(): tensors logged by hand still go through a CPU/device reporter.
                device = values[0].device if values else torch.device("cpu")
                self._reporter = reporter = Reporter(agent, device, self._remember)
            else:
                return
        self._values.report_rejected(keys, values)
        window = self._schedule.window(step)
        self._drop_failed_hooks()
        sketch = self._report_gradients(keys, values)
        if self._activations is not None:
            if self._activations.compiled_skipped and "activations" not in self.tags:
                self._compiled_activations_off()
            if self._activations.armed:
                self._activations.disarm()
                for metric, layer, site, tensor in self._activations.collect():
                    keys.append((metric, layer, site, False))
                    values.append(tensor)
            if window.next(self.cadence.activations):
                self._activations.arm()
        if self._spectral is not None and not self._spectral.collective and window.now(self.cadence.spectral):
            self._spectral.measure()
        if self._fingerprint is not None and window.now(self.cadence.fingerprint):
            # The optimizer state every tenth fingerprint: it is as large as the weights again, twice.
            try:
                self._report_fingerprint(self._fingerprint, keys, values, optimizer=window.now(10 * self.cadence.fingerprint))
            except Exception as e:  # noqa: BLE001 - inside log(): never into the training loop
                self._fingerprint = None
                self._probe_failed("replica fingerprint", e)
        if self._spectral is not None:
            for metric, layer, site, tensor in self._spectral.take():
                keys.append((metric, layer, site, True))
                values.append(tensor)
        host = self._costs()
        if self._learning_rate is not None and not learning_rate_logged:
            self._learning_rate.report(keys, values, host)
        if self._gradients is not None:
            self._gradients.armed = window.next(self.cadence.grad)
            self._gradients.sketch_armed = window.next(self.cadence.sketch)
            self._gradients.dot_armed = window.next(self.cadence.dot)
        reporter.drain()
        if values or sketch is not None or host:
            reporter.submit(step, keys, values, sketch, host=host)

    def _report_gradients(self, keys: list[SeriesKey], values: list[torch.Tensor]) -> tuple[torch.Tensor, int] | None:
        """Adds the last optimizer step's gradient record, if one finished since the last log."""
        probe = self._gradients
        if probe is None:
            return None
        if probe.scaler_note is not None:
            self._warn("scaler", probe.scaler_note)
        record = probe.take()
        if record is None:
            return None
        local = record.local_sq.sqrt()
        keys.append(("grad_norm", None, None, False))
        values.append(local)
        if record.mean_sq is not None:
            mean = record.mean_sq.sqrt()
            keys.append(("grad_norm_mean", None, None, False))
            values.append(mean)
            if record.dot is not None:
                keys.append(("cos_to_mean", None, None, False))
                values.append(record.dot / (local * mean).clamp_min(1e-300))
        if record.skipped is not None:
            keys.append(("amp_skipped", None, None, False))
            values.append(record.skipped)
        try:
            at = keys.index(("nonfinite", None, None, False))
        except ValueError:
            keys.append(("nonfinite", None, None, False))
            values.append(record.nonfinite)
        else:
            values[at] = values[at] + record.nonfinite
        return (record.sketch, probe.sketch_seed) if record.sketch is not None else None

    def _costs(self) -> list[tuple[SeriesKey, float]]:
        """probe_ms.*: what each probe cost this rank since the last report. Host numbers, so
        they go to the agent without visiting the device."""
        costs: list[tuple[SeriesKey, float]] = []
        for name, probe in (("grad", self._gradients), ("activations", self._activations), ("fingerprint", self._fingerprint)):
            if probe is not None and probe.elapsed > 0:
                costs.append(((f"probe_ms.{name}", None, None, False), probe.elapsed * 1000.0))
                probe.elapsed = 0.0
        spectral_ms = self._spectral.take_cost_ms() if self._spectral is not None else None
        if spectral_ms is not None:
            costs.append((("probe_ms.spectral", None, None, False), spectral_ms))
        return costs

    def watch_or_warn(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **kwargs: Unpack[WatchOptions]) -> Run:
        """`watch` for integrations and the zero-code agent, which run inside the training job:
        a mapping that does not fit is a warning (the model is then watched without it), a
        layout the probes cannot measure (FSDP1, DeepSpeed) too, and the run goes on logging."""
        from .discovery import DiscoveryError

        try:
            return self.watch(model, optimizer, **kwargs)
        except DiscoveryError as e:
            if kwargs.get("mapping") is None:
                raise  # watch() turns discovery's own failures into a warning: not reached
            self._warn("mapping", f"rankwatch: the mapping does not fit the model ({e}); watching it without the mapping")
            without = kwargs.copy()
            without["mapping"] = None
            return self.watch_or_warn(model, optimizer, **without)
        except ValueError as e:
            self._warn("watch", f"{e} — the run goes on without model probes")
            return self

    def _drop_failed_hooks(self) -> None:
        """Removes a hook-based probe whose hook failed (it recorded why and went quiet)."""
        for attr, name in (("_gradients", "gradient"), ("_activations", "activations")):
            probe = getattr(self, attr)
            if probe is not None and probe.error is not None:
                self._probe_failed(name, probe.error)
                if getattr(probe, "collective", False):
                    continue  # it keeps joining its collective, idle, until every rank unwatches
                probe.remove()
                setattr(self, attr, None)

    def _probe_failed(self, name: str, error: BaseException) -> None:
        self._warn(f"probe-{name}", f"rankwatch: the {name} probe failed ({error!r}) and turned itself off; training and the other probes go on")

    def _remember(self, step: int, keys: Sequence[SeriesKey], values: list[float]) -> None:
        for key, value in zip(keys, values, strict=True):
            self.last_values[key] = value
            if key[0] == "loss" and not math.isfinite(value):
                self._warn("nonfinite-loss", f"rankwatch: loss is {value} at step {step} on rank {self.rank}; it is stored and counted (metric 'nonfinite')")

    # -- health and lifecycle ----------------------------------------------------------------

    def _health(self, agent: _native.Agent) -> None:
        now = time.monotonic()
        if now - self._last_health_check < 2.0:
            return
        self._last_health_check = now
        stats = agent.stats()
        if self.mode == "online" and not stats["connected"] and stats["retries"] > 0:
            where = f"; spooling to {self.spool_dir}" if self.spool_dir else ""
            self._warn("unreachable", f"rankwatch: collector {self.collector} is not taking rows ({stats['last_error']}){where}. Training continues.")
        if stats["dropped_rows"] > 0:
            self._warn("dropped", f"rankwatch: {stats['dropped_rows']} values dropped so far ({stats['last_error']}); the count is reported to the collector as 'dropped'")
        if stats["set_aside_rows"] > 0:
            self._warn("set-aside", f"rankwatch: the collector refused {stats['set_aside_rows']} values so far; they are kept ({stats['last_error']}). Training continues.")

    def _in_forked_child(self, call: str) -> bool:
        """Whether this process was forked from the one that called `init` (a `multiprocessing`
        or `DataLoader` worker started by fork): the run's sender thread stayed in the parent,
        and a lock it held at the fork is held here for good, so the call is ignored, warned
        about once. A child that wants a run of its own calls `init` itself."""
        if self._pid == os.getpid():
            return False
        self._warn(
            f"forked-{call}",
            f"rankwatch: {call}() in a process forked from the one that called init() is ignored: "
            "the run's sender stayed in the parent (call rankwatch.init in the child for a run of its own)",
        )
        return True

    def _warn(self, key: str, message: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        warnings.warn(message, RankwatchWarning, stacklevel=3)

    def on_alert(self, callback: AlertCallback, *, poll_interval: float = 2.0) -> None:
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
        self._alerts.add(callback)
        if not self._finished:
            if not self._connect().watch_alerts(poll_interval):
                self._warn("alerts-offline", "rankwatch: on_alert has no effect in offline mode (no collector to hear alerts from)")

    @property
    def finished(self) -> bool:
        """Whether `finish()` was called."""
        return self._finished

    def stats(self) -> RunStats:
        """The agent's counters: sent, retried, spooled, dropped, last error."""
        return self._connect().stats()

    def flush(self, timeout: float = 10.0) -> bool:
        """Delivers what was logged so far, waiting at most `timeout` seconds."""
        if self._finished:
            return True
        agent = self._connect()
        if self._reporter is not None:
            self._reporter.drain(wait=True)
        return bool(agent.flush(timeout))

    def finish(self, timeout: float = 10.0) -> RunStats:
        """Ends the run: removes the probes, delivers what it can within `timeout`, spools the
        rest. Calling it again is harmless (the second call warns and returns the stats)."""
        return self._end(timeout, exiting=False)

    def _end(self, timeout: float, *, exiting: bool) -> RunStats:
        """`finish`; `exiting`: from the exit handler (`at_exit.py`), where the user's alert
        callbacks are not run (the job is over, its process group may be gone), and a crashed
        process does not wait on the device for its last report (a collective a dead peer never
        joined would hold it there)."""
        if self._in_forked_child("finish"):
            return {}
        agent = self._connect()
        if self._finished:
            self._warn("finish-twice", "rankwatch: finish() called twice; the second call does nothing")
            return agent.stats()
        if not exiting:
            self._alerts.deliver(agent)
        self._finished = True
        if self._reporter is not None:
            try:
                self._reporter.drain(wait=not (exiting and self._crashed))
                if self._reporter.pending:
                    self._warn("not-drained", f"rankwatch: the process ended on an error; the last {self._reporter.pending} reports were still on the device and are not sent")
            except Exception as e:  # noqa: BLE001 - finishing must not raise into the job
                self._warn("drain", f"rankwatch: could not read back the last report: {e}")
        self.unwatch()
        # Tells the collector this rank is done: once every rank of the world has, the run's
        # last steps close and its open alerts resolve now rather than an idle hour later.
        try:
            if not self._crashed:
                last = self._schedule.last_step
                agent.log(last if last is not None else 0, {"finished": 1.0})
        except Exception as e:  # noqa: BLE001 - finishing must not raise into the job
            self._warn("finished", f"rankwatch: could not report the end of the run: {e}")
        stats = agent.shutdown(timeout)
        if self.mode == "online" and not stats["ever_connected"]:
            where = f" They wait in {self.spool_dir}; send them with rankwatch.sync({str(self.spool_dir)!r})." if stats["spooled_batches"] else ""
            why = f" ({stats['last_error']})" if stats.get("last_error") else ""
            self._warn("never-connected", f"rankwatch: the run finished without reaching the collector at {self.collector}{why}.{where}")
        elif self.mode == "online" and stats["backlog_batches"]:
            self._warn("undelivered", f"rankwatch: {stats['backlog_batches']} batches were not delivered before finish(); they are spooled in {self.spool_dir}")
        if stats["set_aside_rows"]:
            self._warn("set-aside", f"rankwatch: the collector refused {stats['set_aside_rows']} values; they are kept ({stats['last_error']})")
        if not live_runs():
            at_exit.release()
        return stats

    def unwatch(self) -> None:
        """Removes every hook `watch` installed; training goes on exactly as if never watched."""
        if self._activations is not None:
            self._activations.remove()
            self._activations = None
        if self._gradients is not None:
            self._gradients.remove()
            self._gradients = None
        self._fingerprint = None
        if self._stop_scaler_listener is not None:
            self._stop_scaler_listener()
            self._stop_scaler_listener = None
        if self._awaiting is not None:
            self._awaiting[1].remove()
            self._awaiting = None
            self._block_call = None
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if self._learning_rate is not None:
            self._learning_rate.remove()
            self._learning_rate = None
        if self._spectral is not None:
            self._spectral.remove()
            self._spectral = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        # A block left by an exception is a crash, not an end: the collector is not told the
        # rank finished, so its alerts stay open (a NaN that killed the job must not read as
        # resolved); they resolve when the run goes quiet.
        self._crashed = exc[0] is not None
        self.finish()


class NoopRun(Run):
    """The run of `init(mode="disabled")`: `Run`'s public interface, every method a no-op.

    It overrides every public method of `Run` (a test holds it to that), so nothing of `Run`'s
    machinery — agent, probes, spool — is ever reached; it holds only the public attributes,
    for code that reads `run.rank` or `run.id` whether or not the process reports. It is not a
    live run: the zero-code agent does not stand aside for it.
    """

    def __init__(
        self,
        run: str,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        collector: str,
        cadence: Cadence,
        tags: Mapping[str, object],
        dot_mode: bool,
        sketch_dim: int,
        replica_group: ReplicaGroup | None = None,
    ) -> None:
        # Deliberately not Run.__init__: no agent state, and not registered as a live run.
        self._init_public(run, rank, world_size, local_rank, collector, cadence, tags, dot_mode, sketch_dim)
        self.mode = "disabled"
        self.last_values = {}
        self._finished = False
        if replica_group is not None:
            self._join(replica_group)

    def watch(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        mapping: Mapping[str, object] | None = None,
        activations: bool = True,
        compiled_activations: bool = False,
        spectral: bool = True,
        gate: bool = False,
        ddp: torch.nn.parallel.DistributedDataParallel | None = None,
        scaler: torch.amp.GradScaler | None = None,
        spectral_budget: float = 0.01,
        effective_rank_probes: int = 64,
    ) -> Run:
        return self

    def watch_or_warn(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, **kwargs: Unpack[WatchOptions]) -> Run:
        return self

    def log(
        self,
        step: int,
        metrics: Mapping[str, SupportsFloat] | None = None,
        /,
        loss: SupportsFloat | None = None,
        tokens: SupportsFloat | None = None,
        **scalars: SupportsFloat,
    ) -> None:
        return None

    def on_alert(self, callback: AlertCallback, *, poll_interval: float = 2.0) -> None:
        if not callable(callback):  # a mistake in the script, whether or not it reports
            raise TypeError("rankwatch: on_alert needs a callable")

    @property
    def finished(self) -> bool:
        return self._finished

    def stats(self) -> RunStats:
        return {}

    def flush(self, timeout: float = 10.0) -> bool:
        return True

    def finish(self, timeout: float = 10.0) -> RunStats:
        self._finished = True
        return {}

    def unwatch(self) -> None:
        return None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


@dataclass
class _LayerProbes:
    """What `watch` was asked for the layer probes, kept until the layout is known."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    compiled: bool  # the model already runs through torch.compile's graphs (hooks added now never run)
    spectral: bool
    activations: bool
    compiled_activations: bool  # opted in to activation hooks traced into compiled graphs
    gate: bool
    budget: float
    erank_probes: int


def _compiled(module: torch.nn.Module) -> bool:
    """Whether `module` (the DDP wrapper or model `watch` was given) or one of its submodules
    runs through torch.compile's graphs."""
    return any(type(m).__name__ == "OptimizedModule" or vars(m).get("_compiled_call_impl") is not None for m in module.modules())


def _has_dtensor(params: list[torch.nn.Parameter]) -> bool:
    return any(type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor" for p in params)


def _sketch_seed(run: str) -> int:
    """The same seed on every rank of a run, and a different one per run."""
    import zlib

    return zlib.crc32(run.encode())
