"""Getting device scalars to the agent without a host sync on the training thread.

Everything measured during a step — the loss the user passed as a tensor, grad norms from the
DDP hook, spectral norms, activation maxima — is a 0-dim tensor on the model's device. At each
report the reporter writes them into **one preallocated device buffer** (a single `torch.stack`
into a slice of it), starts **one non-blocking copy into pinned host memory** and records a CUDA
event. The values are read on a *later* report, once `event.query()` says the copy finished,
and handed to the native agent as one list of floats. Nothing here ever waits for the GPU,
except `drain(wait=True)` at flush and finish. On CPU the same path runs with no event and
ordinary (unpinned) memory, where reading back is immediate.

The list of series of a report — (metric, layer, site, all_ranks) per value — is registered with
the native agent once per distinct shape and referred to by id afterwards.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

SeriesKey = tuple[str, int | None, str | None, bool]


@dataclass
class _InFlight:
    step: int
    series_id: int
    n: int
    host: torch.Tensor
    event: Any  # torch.cuda.Event | None
    sketch: tuple[int, int] | None  # (dimension, seed) of a sketch after the scalars
    host_values: list[float]  # values already on the host, after the device ones


class Reporter:
    """Stacks device scalars, copies them to the host asynchronously, delivers them later."""

    def __init__(self, agent: Any, device: torch.device, on_values: Callable[[int, Sequence[SeriesKey], list[float]], None] | None = None) -> None:
        self._agent = agent
        self._device = device
        self._cuda = device.type == "cuda"
        self._capacity = 0
        self._buffer = torch.empty(0, dtype=torch.float64, device=device)
        self._hosts: dict[int, list[torch.Tensor]] = {}
        self._series: dict[tuple[SeriesKey, ...], int] = {}
        self._keys_by_id: dict[int, tuple[SeriesKey, ...]] = {}
        self._inflight: deque[_InFlight] = deque()
        self._on_values = on_values

    def _series_id(self, keys: tuple[SeriesKey, ...]) -> int:
        sid = self._series.get(keys)
        if sid is None:
            sid = self._agent.register(list(keys))
            self._series[keys] = sid
            self._keys_by_id[sid] = keys
        return sid

    def _host_buffer(self, n: int) -> torch.Tensor:
        pool = self._hosts.setdefault(n, [])
        busy = {id(f.host) for f in self._inflight}
        for t in pool:
            if id(t) not in busy:
                return t
        t = torch.empty(n, dtype=torch.float64, pin_memory=self._cuda)
        pool.append(t)
        return t

    def submit(
        self,
        step: int,
        keys: Sequence[SeriesKey],
        values: Sequence[torch.Tensor],
        sketch: tuple[torch.Tensor, int] | None = None,
        host: Sequence[tuple[SeriesKey, float]] = (),
    ) -> None:
        """Queues one report. `sketch` is (vector, seed): appended after the scalars. `host`
        values (key, float) are known on the host already: they never visit the device and
        are delivered with the device values of the same report."""
        if not values and sketch is None and not host:
            return
        host_keys = [k for k, _ in host]
        host_values = [float(v) for _, v in host]
        if not values and sketch is None:
            sid = self._series_id((*keys, *host_keys))
            self._inflight.append(_InFlight(step, sid, len(host_keys), torch.empty(0, dtype=torch.float64), None, None, host_values))
            self.drain()
            return
        parts = [v.detach().reshape(1).to(self._device, torch.float64) for v in values]
        if sketch is not None:
            parts.append(sketch[0].detach().reshape(-1).to(self._device, torch.float64))
        n = sum(p.numel() for p in parts)
        if n > self._capacity:
            self._capacity = max(n, 2 * self._capacity, 64)
            self._buffer = torch.empty(self._capacity, dtype=torch.float64, device=self._device)
        device_values = self._buffer[:n]
        torch.cat(parts, out=device_values)
        staged = self._host_buffer(n)
        staged.copy_(device_values, non_blocking=self._cuda)
        event = None
        if self._cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves Event.__init__ unannotated
            event.record()
        all_keys = (*keys, *host_keys)
        sid = self._series_id(all_keys) if all_keys else -1
        sketch_info = (sketch[0].numel(), sketch[1]) if sketch is not None else None
        self._inflight.append(_InFlight(step, sid, len(keys) + len(host_keys), staged, event, sketch_info, host_values))
        if not self._cuda:
            # Host memory: the values are there already, no reason to hold them a report.
            self.drain()

    @property
    def pending(self) -> int:
        """Reports whose device values are not read back yet."""
        return len(self._inflight)

    def drain(self, wait: bool = False) -> None:
        """Hands every finished copy to the agent, oldest first."""
        while self._inflight:
            item = self._inflight[0]
            if item.event is not None and not item.event.query():
                if not wait:
                    return
                item.event.synchronize()
            self._inflight.popleft()
            device_values = item.host.tolist() if item.host.numel() else []
            on_device = item.n - len(item.host_values)
            scalars = device_values[:on_device] + item.host_values
            values = scalars + device_values[on_device:]
            if item.n:
                self._agent.log_series(item.step, item.series_id, scalars)
                if self._on_values is not None:
                    self._on_values(item.step, self._keys_by_id[item.series_id], scalars)
            if item.sketch is not None:
                dim, seed = item.sketch
                vector = values[item.n : item.n + dim]
                norm = _grad_norm_of(self._keys_by_id.get(item.series_id, ()), scalars)
                if norm is not None:
                    self._agent.sketch(item.step, "countsketch", seed, norm, vector)


def _grad_norm_of(keys: Sequence[SeriesKey], values: Sequence[float]) -> float | None:
    for key, value in zip(keys, values, strict=True):
        if key[0] == "grad_norm":
            return value
    return None
