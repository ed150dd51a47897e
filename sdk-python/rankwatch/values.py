"""What `log()` accepts, and what it does with the rest.

Plain numbers go straight to the native agent, which checks their names and returns the names
it did not take: tensors and other objects, which are read here. A single-element tensor of a
number dtype joins the step's report as it is (never read on the training thread); a numpy
scalar is a host value, converted; anything else is refused. A refused value never raises into
the training loop: it is skipped, warned about once per cause, and counted in the `rejected`
series, so a dropped value is visible on the dashboard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, SupportsFloat

import torch

from . import _native

if TYPE_CHECKING:
    from .report import SeriesKey

_VOCABULARY = {name: scope for name, scope, _ in _native.vocabulary()}
_NUMBER_DTYPES = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.bool)


class LoggedValues:
    """Turns what `log()` was given into report series, counting what it refuses."""

    def __init__(self, warn: Callable[[str, str], None]) -> None:
        self._warn = warn
        self.rejected = 0
        self._rejected_reported = 0

    def send(self, agent: _native.Agent, step: int, given: dict[str, SupportsFloat]) -> list[str] | None:
        """Hands the plain numbers to the agent; returns the names it left (tensors, objects).
        A bad name refuses the whole call natively; then each value goes alone."""
        try:
            return agent.log(step, given) if given else None
        except ValueError:
            return self._one_by_one(agent, step, given)

    def _one_by_one(self, agent: _native.Agent, step: int, given: dict[str, SupportsFloat]) -> list[str]:
        """The slow path after a bad name: each plain number alone, the bad ones counted."""
        others: list[str] = []
        for name, value in given.items():
            try:
                rest = agent.log(step, {name: value})
            except ValueError as e:
                self.reject(f"name-{name}", f"rankwatch: log(step={step}) skipped {name!r}: {e}")
                continue
            others.extend(rest or ())
        return others

    def reject(self, key: str, message: str) -> None:
        self.rejected += 1
        self._warn(key, message + " (counted in the metric 'rejected')")

    def take(self, name: str, value: object, keys: list[SeriesKey], values: list[torch.Tensor]) -> None:
        """A value the agent did not take, as a series of the report, or refused."""
        metric = name if _VOCABULARY.get(name) == "rank" else (name if name.startswith("user/") else f"user/{name}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                self.reject(f"shape-{name}", f"rankwatch: log() value {name!r} is a tensor of shape {tuple(value.shape)}; only single-element tensors are logged")
                return
            if not (value.is_floating_point() or value.dtype in _NUMBER_DTYPES):
                self.reject(f"dtype-{name}", f"rankwatch: log() value {name!r} has dtype {value.dtype}; skipped")
                return
            keys.append((metric, None, None, False))
            values.append(value)
            if name == "loss":
                # nonfinite counts NaN/Inf in the loss; the gradient's count joins it in the run's report.
                keys.append(("nonfinite", None, None, False))
                values.append((~torch.isfinite(value.detach())).sum().double())
            return
        item = getattr(value, "item", None)
        if item is not None and hasattr(value, "dtype"):  # numpy scalars: host values
            try:
                number = float(item())
            except (TypeError, ValueError):
                pass
            else:
                keys.append((metric, None, None, False))
                values.append(torch.tensor(number, dtype=torch.float64))
                return
        self.reject(f"type-{name}", f"rankwatch: log() value {name!r} is a {type(value).__name__}; expected a number or a tensor, skipped")

    def unreported(self) -> bool:
        """Whether refusals happened since the count was last reported."""
        return self.rejected != self._rejected_reported

    def report_rejected(self, keys: list[SeriesKey], values: list[torch.Tensor]) -> None:
        """Adds the `rejected` count to the report, when it moved."""
        if self.unreported():
            self._rejected_reported = self.rejected
            keys.append(("rejected", None, None, False))
            values.append(torch.tensor(float(self.rejected), dtype=torch.float64))
