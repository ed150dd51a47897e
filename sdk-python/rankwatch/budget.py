"""Keeping the spectral probe inside its share of the step.

Costs are measured where they are spent: the gradient and activation probes add up the host
time of their hooks; a spectral call is timed around the call (on a GPU, between two CUDA events
read only once they completed — never waited for). The spectral probe is the one whose work per
call can shrink without losing anything but freshness: it covers `layers_per_call` layers per
call, round-robin. Its amortised share of training time is

    share = call_ms / (every · step_ms)

and the budget keeps it under `fraction` (1 % by default): above it, layers per call halve
(down to one layer per call); under a quarter of it, they double back, up to every layer. A
layer is then measured every `every · layers / layers_per_call` steps instead of every `every`.

Under sharded weights every rank must cover the same layers in the same call (the call's
collectives depend on them), so the decision is taken from numbers every rank agrees on: the sums
over ranks of call time and step time, added up in the process group's store (host integers:
no collective, no device sync; the keys left behind are a few bytes per call). A rank adds its
measurement of call c−1 when it starts call c, and reads the sums at call c+1 — by then every
rank has passed call c's collectives, so every addition is in (the read waits on a key the
last adder sets, which in practice is already there).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class SpectralTimer:
    """Times spectral calls: wall time on the host, device time on CUDA (read when ready)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._events: tuple[Any, Any] | None = None
        self._host_ms: float | None = None
        self._started = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()
        if self._cuda:
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves Event.__init__ unannotated
            begin.record()
            self._events = (begin, None)

    def stop(self) -> None:
        self._host_ms = (time.perf_counter() - self._started) * 1000.0
        if self._cuda and self._events is not None:
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch leaves Event.__init__ unannotated
            end.record()
            self._events = (self._events[0], end)

    def last_ms(self) -> float | None:
        """The last call's time: device time once its events completed, else host time."""
        if self._events is not None and self._events[1] is not None and self._events[1].query():
            return float(self._events[0].elapsed_time(self._events[1]))
        return self._host_ms


class SpectralBudget:
    """Chooses layers per call from measured costs (see the module docstring)."""

    def __init__(self, layers: int, fraction: float, every: int, *, shared: SharedSums | None = None) -> None:
        if not 0 < fraction:
            raise ValueError(f"the spectral budget must be a positive fraction of step time, got {fraction}")
        self.layers = max(1, layers)
        self.fraction = fraction
        self.every = max(1, every)
        self.per_call = self.layers
        self.shared = shared
        self._calls = 0

    def before_call(self, last_call_ms: float | None, step_ms: float | None) -> int:
        """Layers this call covers, given the last call's time and the current step time."""
        self._calls += 1
        if self.shared is not None:
            sums = self.shared.exchange(self._calls, last_call_ms, step_ms)
            call, step = sums if sums is not None else (None, None)
        else:
            call, step = last_call_ms, step_ms
        if call is not None and step:
            self.adjust(call / step)
        return self.per_call

    def adjust(self, cost_per_step_time: float) -> None:
        """`cost_per_step_time` = call time / step time; the share is that over `every`."""
        share = cost_per_step_time / self.every
        if share > self.fraction and self.per_call > 1:
            self.per_call = max(1, self.per_call // 2)
        elif share < self.fraction / 4 and self.per_call < self.layers:
            self.per_call = min(self.layers, self.per_call * 2)


class SharedSums:
    """Sums of host numbers over the ranks of a mesh, through the c10d store (see above)."""

    def __init__(self, store: Any, prefix: str, ranks: int) -> None:
        self.store = store
        self.prefix = prefix
        self.ranks = ranks

    def _key(self, call: int, what: str) -> str:
        return f"{self.prefix}/{call}/{what}"

    def exchange(self, call: int, last_call_ms: float | None, step_ms: float | None) -> tuple[float, float] | None:
        """Adds this rank's measurement of call−1; returns the sums for call−2 (None at first)."""
        measured = call - 1
        if measured >= 1:
            self.store.add(self._key(measured, "call_us"), int((last_call_ms or 0.0) * 1000))
            self.store.add(self._key(measured, "step_us"), int((step_ms or 0.0) * 1000))
            if self.store.add(self._key(measured, "ranks"), 1) == self.ranks:
                self.store.set(self._key(measured, "done"), b"1")
        agreed = call - 2
        if agreed < 1:
            return None
        self.store.wait([self._key(agreed, "done")])
        call_us = self.store.add(self._key(agreed, "call_us"), 0)
        step_us = self.store.add(self._key(agreed, "step_us"), 0)
        return call_us / 1000.0, step_us / 1000.0


class StepClock:
    """The training step's time, for the budget: an exponential average (weight 0.2) of the
    host time between logged steps, divided by the steps between them."""

    def __init__(self) -> None:
        self.ms: float | None = None
        self._last_time: float | None = None  # perf_counter at the last log

    def tick(self, step: int, last_step: int | None) -> None:
        """At the log of `step`; `last_step` is the step logged before (the schedule keeps it)."""
        now = time.perf_counter()
        if self._last_time is not None and last_step is not None and step > last_step:
            per_step = (now - self._last_time) * 1000.0 / (step - last_step)
            self.ms = per_step if self.ms is None else 0.8 * self.ms + 0.2 * per_step
        self._last_time = now
