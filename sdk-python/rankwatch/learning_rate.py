"""The learning rate each optimizer step used (`learning_rate`): the collector's
`rank_collapse` keeps early training open while the schedule's warm-up still climbs.

A pre-hook on the watched optimizer's `step` keeps the first parameter group's `lr` as that
step reads it (after the step, a scheduler's `step()` has usually moved it on to the next
one's). A number is sent as a host value; a tensor learning rate (capturable and fused
optimizers accept one) is copied in the hook and goes with the device values, so it is never
read on the training thread. Reading a dict entry changes nothing the step computes."""

from __future__ import annotations

import numbers

import torch
from torch.utils.hooks import RemovableHandle

from .report import SeriesKey

KEY: SeriesKey = ("learning_rate", None, None, False)


class LearningRateProbe:
    """Keeps the learning rate of the optimizer's latest step until the next report."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._lr: float | torch.Tensor | None = None
        self._handle: RemovableHandle | None = optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        groups = optimizer.param_groups
        lr = groups[0].get("lr") if groups else None
        if isinstance(lr, torch.Tensor):
            # A scheduler updates a tensor learning rate in place after the step.
            self._lr = lr.detach().clone()
        elif isinstance(lr, numbers.Real) and not isinstance(lr, bool):
            self._lr = float(lr)
        else:
            self._lr = None

    def report(self, keys: list[SeriesKey], values: list[torch.Tensor], host: list[tuple[SeriesKey, float]]) -> None:
        """Adds the latest step's learning rate, if a step ran since the last report."""
        lr, self._lr = self._lr, None
        if isinstance(lr, torch.Tensor):
            keys.append(KEY)
            values.append(lr)
        elif lr is not None:
            host.append((KEY, lr))

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
