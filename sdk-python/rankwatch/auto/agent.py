"""The zero-code agent: one per process, installed by `rankwatch run`'s `sitecustomize` or
injected into a running process by `rankwatch attach --pid`.

It hangs on one global optimizer step post-hook (`torch.optim.optimizer.
register_optimizer_step_post_hook`), so a process that never steps an optimizer — the
torchrun agent, a data-loader worker, a tokenizer script — never sees it do anything. The
first optimizer to step is the one the agent follows; each of its steps advances the count
(dormant or not), which is the step number every rank shares.

States, changed only at the end of an optimizer step (between two steps, where no backward is
under way and no hook is half-run):

    dormant ──activate──▶ starting ──end of a step: find, init, watch──▶ watching
       ▲                                                                    │
       └──────────────────── deactivate (or any failure) ◀─────────────────┘

A request (the collector's switch, `attach`/`detach --pid`) takes effect at a step every rank of
the job agrees on (`agreement.py`): probes that issue collectives of their own must start and
stop together. A launched agent that is not dormant starts at the end of the job's first step
on every rank, which needs no agreement.

While watching, each step's end logs this rank's loss for the step (`rankwatch.losses`) and
lets the run's probes report; deactivating finishes the run, which removes every hook, and
restores what was patched. Anything that goes wrong inside the agent deactivates it and is
reported once: the job goes on as if it had never been watched.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..losses import BackwardLoss, TokenLoss
from ..offline import parse_mode
from ..run import RankwatchWarning, Run, live_runs
from ..scaling import listen
from ..settings import init
from .agreement import Agreement, Switch
from .find import Found, model_of, steps_done


@dataclass
class Settings:
    """What the agent starts with: from `rankwatch run`'s environment or an injection."""

    run: str | None = None
    collector: str | None = None
    mode: str | None = None
    every: Any = None  # an int or a dict of probe → steps, as `rankwatch.init(every=)`
    dormant: bool = False
    status_dir: str | None = None  # where an injected agent reports what it found
    injected: bool = False  # by `attach --pid`: its step count starts mid-run
    spool_dir: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    mapping: dict[str, Any] | None = None  # `--mapping`: the model's layout, where discovery cannot read it

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        every: Any = env.get("RANKWATCH_EVERY")
        if every:
            every = json.loads(every)
        return cls(
            run=env.get("RANKWATCH_RUN") or None,
            collector=env.get("RANKWATCH_COLLECTOR") or None,
            mode=env.get("RANKWATCH_MODE") or None,
            every=every or None,
            dormant=env.get("RANKWATCH_DORMANT", "") in ("1", "true"),
            status_dir=env.get("RANKWATCH_STATUS_DIR") or None,
            spool_dir=env.get("RANKWATCH_SPOOL_DIR") or None,
            mapping=json.loads(env["RANKWATCH_MAPPING"]) if env.get("RANKWATCH_MAPPING") else None,
        )


DORMANT, STARTING, WATCHING = "dormant", "starting", "watching"


class AutoAgent:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = DORMANT
        self.steps = 0  # optimizer steps of the followed optimizer seen by this agent
        # Added to `steps` for the step number every rank shares (None: not known, for an
        # injected agent whose optimizer keeps no step count): what the ranks agree on.
        self.shared_base: int | None = None if settings.injected else 0
        self._switch: Switch | None = None
        self._last_step_end: float | None = None
        self._step_seconds: float | None = None
        self.offset = 0  # added to `steps` to give the step number (a framework's, say)
        self.run: Run | None = None
        self.found: Found | None = None
        self.error: str | None = None
        self._optimizer: Any = None  # weakref to the followed optimizer
        self._hook: Any = None
        # Launched watching, a request from the start; injected, the payload makes the request.
        self._requested: str | None = None if settings.dormant or settings.injected else "activate"
        # `attach/detach --pid`: the request waits for the go file, written once every rank is
        # injected, so that every rank reads it within a step of the others.
        self._gated: tuple[Path, str] | None = None
        self._token_loss = TokenLoss()
        self._backward_loss = BackwardLoss()
        self._patched: list[tuple[Any, str, Any]] = []
        self._stop_scaled: Any = None  # `scaling.listen`'s stop, while the loss is watched
        self._model_hook: Any = None
        self._lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._seen_revision = 0
        self.poll_interval = float(os.environ.get("RANKWATCH_SWITCH_POLL_S", "2"))

    # -- installation ---------------------------------------------------------------------

    def install(self) -> None:
        """The global step hook; from then on the agent acts at the end of optimizer steps."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._hook = register_optimizer_step_post_hook(self._after_step)

    def uninstall(self) -> None:
        self._stop("uninstalled")
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def request(self, action: str) -> None:
        """`activate` or `deactivate` at the end of the next optimizer step (any thread), at a
        step the ranks agree on with the collector poll's lead."""
        if action not in ("activate", "deactivate"):
            raise ValueError(f"unknown action {action!r}")
        with self._lock:
            self._requested, self._gated = action, None

    def request_once(self, go: Path, action: str) -> None:
        """`action` from the end of the first optimizer step at which the file `go` exists, with
        no lead beyond the minimum: every rank checks for it at each of its step ends."""
        if action not in ("activate", "deactivate"):
            raise ValueError(f"unknown action {action!r}")
        with self._lock:
            self._gated = (go, action)

    # -- the collector's switch ---------------------------------------------------------------

    def _start_poller(self) -> None:
        """From the first optimizer step on (so only training processes poll), a daemon thread
        reads the run's probe switch at the collector; a new revision becomes a request that
        the next step's end carries out. No port is opened on the training node."""
        settings = self.settings
        mode = settings.mode or os.environ.get("RANKWATCH_MODE", "online")
        if mode != "online" or not settings.run:
            self._poller = threading.current_thread()  # nothing to poll: never try again
            return
        from ..offline import collector_url

        base = collector_url(settings.collector).rstrip("/")
        from urllib.parse import quote

        url = f"{base}/api/v1/runs/{quote(settings.run, safe='')}/probes"
        token = os.environ.get("RANKWATCH_INGEST_TOKEN")
        self._poller = threading.Thread(target=self._poll_loop, args=(url, token), name="rankwatch-switch", daemon=True)
        self._poller.start()

    def _poll_loop(self, url: str, token: str | None) -> None:
        import urllib.request

        warned = False
        while self._hook is not None:
            try:
                request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
                with urllib.request.urlopen(request, timeout=5) as answer:
                    switch = json.loads(answer.read())
                revision = int(switch.get("revision") or 0)
                if revision > self._seen_revision and switch.get("on") is not None:
                    self._seen_revision = revision
                    self.request("activate" if switch["on"] else "deactivate")
            except Exception as e:  # noqa: BLE001 - a missing collector is a warning, once
                if not warned:
                    warned = True
                    print(f"rankwatch: cannot read the run's probe switch at {url} ({e}); will keep trying", file=sys.stderr)
            time.sleep(self.poll_interval)

    # -- the step hook --------------------------------------------------------------------

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            followed = self._optimizer() if self._optimizer is not None else None
            if followed is None:
                self._optimizer = weakref.ref(optimizer)
                followed = optimizer
            if optimizer is not followed:
                return  # another optimizer of the same loop (a GAN's second, say)
            first = self.steps == 0
            self.steps += 1
            self._time_step()
            if self._poller is None:
                self._start_poller()
            with self._lock:
                requested, self._requested = self._requested, None
                lead: float | None = None  # the collector poll's
                if self._gated is not None and self._gated[0].exists():
                    (_, requested), lead, self._gated = self._gated, 0.0, None
            if first and requested == "activate" and not self.settings.injected and not self.settings.dormant:
                # Launched watching: every rank starts at the end of the job's first step. (A
                # dormant job's switch, heard by the poller this first step started, is agreed
                # on like any other: the other ranks may not have heard it yet.)
                self.state = STARTING
            else:
                self._follow_switch(optimizer, None if requested is None else requested == "activate", lead)
            if self.state == STARTING:
                self._start(optimizer)
            elif self.state == WATCHING:
                self._log()
        except Exception as e:  # noqa: BLE001 - the job must never see the agent fail
            self._fail(e)

    def _time_step(self) -> None:
        now = time.monotonic()
        if self._last_step_end is not None:
            took = now - self._last_step_end
            self._step_seconds = took if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * took
        self._last_step_end = now

    def _follow_switch(self, optimizer: torch.optim.Optimizer, wanted: bool | None, lead_seconds: float | None) -> None:
        """Hands a new request (`wanted`, on or off, with its own lead or None for the poll's)
        to the switch, and carries out the pending one at the step the ranks agree on."""
        if self._switch is None:
            if wanted is None:
                return  # nothing asked yet: no store is touched
            if self.shared_base is None:
                done = steps_done(optimizer, None)
                self.shared_base = None if done is None else done - self.steps
            lead = self.poll_interval + 1.0  # every rank polls the collector within one interval
            self._switch = Switch(Agreement.of_job(lead) if self.shared_base is not None else None)
        switch = self._switch
        if wanted is not None:
            switch.wanted, switch.lead_seconds = wanted, lead_seconds
        target = switch.end_of_step(self.steps + (self.shared_base or 0), self.state != DORMANT, self._step_seconds)
        if switch.gave_up is not None:
            self.error = switch.gave_up
            self._report("not-watching")  # printed, and the answer an attaching command waits for
        if target is True and self.state == DORMANT:
            self.state = STARTING
        elif target is False:
            self._stop("detached")

    def _start(self, optimizer: torch.optim.Optimizer) -> None:
        """Find the model, start the run, install the probes; they measure from the next step."""
        own = live_runs()
        if own:
            # The script calls rankwatch itself: two sets of probes would report the job twice.
            self.state = DORMANT
            self.error = f"this process already reports to rankwatch as run {own[0].id!r} (rankwatch.init in the script); the agent stands aside"
            self._report("not-watching")
            return
        found = model_of(optimizer)
        done = steps_done(optimizer, found.framework)
        if done is not None:
            self.offset = done - self.steps
        settings = self.settings
        run = init(
            run=settings.run,
            collector=settings.collector,
            mode=parse_mode(settings.mode) if settings.mode else None,  # settings come as text
            every=settings.every,
            spool_dir=settings.spool_dir,
            tags={"attached": "auto", **settings.tags},
        )
        # The loss scaler is found by the gradient probe itself: the one whose scale() ran.
        run.watch_or_warn(found.model, optimizer, mapping=settings.mapping)
        inner = getattr(found.model, "module", found.model)
        self._model_hook = inner.register_forward_hook(self._token_loss.capture, with_kwargs=True)
        self._patch()
        self.run, self.found, self.state = run, found, WATCHING
        self._report("watching")

    def _log(self) -> None:
        run = self.run
        assert run is not None
        step = self.steps + self.offset
        tokens = self._token_loss.take() if self._token_loss.seen else None
        if tokens is not None:
            run.log(step, loss=tokens[0], tokens=tokens[1])
            self._backward_loss.take()
        else:
            loss = self._backward_loss.take()
            if loss is not None:
                run.log(step, loss=loss)
            else:
                run.log(step)

    # -- loss sources -----------------------------------------------------------------------

    def _patch(self) -> None:
        """Wraps `torch.autograd.backward` (which `Tensor.backward` calls) and listens to
        `GradScaler.scale` (`scaling.py`) to see the loss. Each wrapper calls the original with
        the same arguments."""
        if self._patched:
            return
        agent = self
        original_backward = torch.autograd.backward

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                agent._backward_loss.backward(tensors)
            except Exception as e:  # noqa: BLE001
                agent._fail(e)
            return original_backward(tensors, *args, **kwargs)

        self._patched.append((torch.autograd, "backward", original_backward))
        torch.autograd.backward = backward

        def scaled(scaler: Any, outputs: Any, result: Any) -> None:
            try:
                agent._backward_loss.scaled(outputs, result)
            except Exception as e:  # noqa: BLE001
                agent._fail(e)

        self._stop_scaled = listen(scaled)

    def _unpatch(self) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched = []
        if self._stop_scaled is not None:
            self._stop_scaled()
            self._stop_scaled = None

    # -- stopping -----------------------------------------------------------------------------

    def _stop(self, why: str) -> None:
        self._unpatch()
        if self._model_hook is not None:
            self._model_hook.remove()
            self._model_hook = None
        run, self.run = self.run, None
        was = self.state
        self.state = DORMANT
        self._token_loss = TokenLoss()
        self._backward_loss = BackwardLoss()
        if run is not None:
            run.finish(timeout=5.0)
        if was != DORMANT:
            self._report(why)

    def _fail(self, error: BaseException) -> None:
        self.error = f"the agent stopped itself ({type(error).__name__}: {error})"
        warnings.warn(f"rankwatch: {self.error}; training goes on unwatched", RankwatchWarning, stacklevel=2)
        try:
            self._stop("failed")
        except Exception:  # noqa: BLE001 - nothing more to undo
            pass

    # -- reporting ----------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        run = self.run
        return {
            "pid": os.getpid(),
            "state": self.state,
            "step": self.steps + self.offset,
            "run": run.id if run is not None else self.settings.run,
            "rank": run.rank if run is not None else None,
            "world_size": run.world_size if run is not None else None,
            "model": self.found.describe() if self.found is not None else None,
            "error": self.error,
            "time": time.time(),
        }

    def _report(self, event: str) -> None:
        info = {**self.describe(), "event": event}
        if self.settings.status_dir:
            self._write_status(self.settings.status_dir, info)
        if event == "watching":
            print(f"rankwatch: watching {info['model']} as rank {info['rank']} of {info['world_size']} in run {info['run']!r} from step {info['step'] + 1}", file=sys.stderr)
        elif event in ("failed", "not-watching"):
            print(f"rankwatch: {self.error}", file=sys.stderr)


    @staticmethod
    def _write_status(directory: str, info: dict[str, Any]) -> None:
        path = Path(directory) / f"{os.getpid()}.json"
        part = path.with_suffix(".part")
        part.write_text(json.dumps(info))
        part.replace(path)  # whole or not at all: the attaching command polls this file


_agent: AutoAgent | None = None


def agent() -> AutoAgent | None:
    """This process's agent, if one was started."""
    return _agent


def start(settings: Settings) -> AutoAgent:
    """Starts (once per process) the agent; torch must be imported."""
    global _agent
    if _agent is None:
        _agent = AutoAgent(settings)
        _agent.install()
    return _agent


def remote(config: dict[str, Any]) -> None:
    """The entry point of `rankwatch attach/detach --pid`'s payload, in the target process."""
    action = config["action"]
    status_dir = config["status_dir"]
    current = _agent
    if action == "attach":
        if current is None:
            settings = {k: v for k, v in config.get("settings", {}).items() if v is not None}
            current = start(Settings(**settings, status_dir=status_dir, injected=True))
        else:
            current.settings.status_dir = status_dir
        current.request_once(Path(status_dir) / "go", "activate")
        current._report("injected")
    elif action == "detach":
        if current is None or current.state == DORMANT:
            info = current.describe() if current is not None else {"pid": os.getpid(), "state": DORMANT}
            AutoAgent._write_status(status_dir, {**info, "event": "not-watching", "error": "rankwatch is not watching this process"})
            return
        current.settings.status_dir = status_dir
        current.request_once(Path(status_dir) / "go", "deactivate")
        current._report("injected")
    else:
        raise ValueError(f"unknown action {action!r}")
