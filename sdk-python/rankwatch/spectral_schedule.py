"""The spectral probe as a run drives it: which layers this rank measures, when, and at what
cost.

Replicated weights: the layers are shared out over the ranks (layer i on rank i mod K), and a
rank measures its share when `log()` finds the probe due. Sharded weights (FSDP2, tensor
parallelism): every rank measures every layer together, so the calls run after every k-th
optimizer step, from an optimizer hook, where every rank is at the same point. Either way the
calls are timed and kept under the run's `spectral_budget` (`budget.py`), and what a call
measured waits, as device tensors, for the next report. A call that fails turns the probe off,
said once; training and the other probes go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .budget import SharedSums, SpectralBudget, SpectralTimer
from .spectral import Metric, ShardingError, SpectralProbe

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from .layout import Layout


class ScheduledSpectral:
    """A spectral probe, its time budget and its pending measurements."""

    def __init__(
        self,
        layout: Layout,
        *,
        run_id: str,
        rank: int,
        world_size: int,
        device: torch.device,
        optimizer: torch.optim.Optimizer | None,
        every: int,
        fraction: float,
        erank_probes: int,
        step_ms: Callable[[], float | None],
        failed: Callable[[BaseException], None],
    ) -> None:
        try:
            probe = SpectralProbe(layout, reporter=rank, reporters=world_size, erank_probes=erank_probes)
        except ShardingError as e:
            raise ValueError(f"rankwatch.watch: the spectral probe cannot measure this model's weights exactly: {e}. Pass every={{'spectral': 0}} to rankwatch.init to watch the rest.") from e
        self._probe: SpectralProbe | None = probe
        self._every = every
        self._step_ms = step_ms
        self._failed = failed
        self._optimizer_steps = 0
        self._hook: RemovableHandle | None = None
        shared = None
        layers = len(layout.blocks)
        if probe.collective:
            if optimizer is None:
                raise ValueError(
                    "rankwatch.watch: this model's weights are sharded, so every rank measures them together and must do so at the "
                    "same steps; pass the optimizer to watch() (the probe runs after every k-th optimizer step), or every={'spectral': 0}"
                )
            import torch.distributed as dist

            store = dist.distributed_c10d._get_default_store()
            shared = SharedSums(store, f"rankwatch/{run_id}/spectral", probe.mesh_size)
            self._hook = optimizer.register_step_post_hook(lambda *_: self._after_optimizer_step())
        else:
            layers = len([p for p in range(layers) if p % world_size == rank])
        self.collective = probe.collective
        self._timer = SpectralTimer(device)
        self._budget = SpectralBudget(layers, fraction, every, shared=shared)
        self._pending: list[Metric] = []
        self._call_ms: float | None = None

    def _after_optimizer_step(self) -> None:
        """Sharded weights: every rank measures after the same optimizer steps."""
        self._optimizer_steps += 1
        if self._optimizer_steps % self._every == 0:
            self.measure()

    def measure(self) -> None:
        """One call: the next layers of this rank's share, as many as the budget allows."""
        probe = self._probe
        if probe is None:
            return  # failed earlier and off
        probe.layers_per_call = self._budget.before_call(self._timer.last_ms(), self._step_ms())
        self._timer.start()
        try:
            self._pending.extend(probe.compute())
        except Exception as e:  # noqa: BLE001 - a failing probe turns itself off
            self._probe = None
            self._failed(e)
            return
        finally:
            self._timer.stop()
        self._call_ms = self._timer.last_ms()

    def take(self) -> list[Metric]:
        """What the calls since the last report measured."""
        pending, self._pending = self._pending, []
        return pending

    def take_cost_ms(self) -> float | None:
        """The last call's time, once (None when no call finished since)."""
        ms, self._call_ms = self._call_ms, None
        return ms

    def remove(self) -> None:
        """Removes the optimizer hook (sharded weights) and drops the probe and its budget,
        which holds the process group's store."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._probe = None
        self._pending = []
