"""What the zero-code agent finds in a live training process: the model an optimizer trains
and the step count a framework keeps. (The loss scaler is not looked for: the gradient probe
follows the one whose `scale()` ran, see `scaling.py`.)

The model is found from the optimizer, never guessed from names: among the module trees
alive in the process (`gc` holds every `nn.Module`), the root whose parameters cover the
most of the optimizer's — the DistributedDataParallel wrapper or the FSDP2 root when there is
one, the bare model otherwise. This runs once, at the end of an optimizer step; a heap of
millions of objects takes a second or so, paid once.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch


class NothingToWatch(RuntimeError):
    """The process has no model the agent can watch (the message says what was missing)."""


@dataclass
class Found:
    model: torch.nn.Module  # what `Run.watch` is given: the DDP/FSDP wrapper or the model
    parameters: int  # of the optimizer's, how many the model holds
    framework: Any  # a Hugging Face or Lightning trainer driving this optimizer, if any

    def describe(self) -> str:
        inner = getattr(self.model, "module", self.model)
        wrapper = f"{type(self.model).__name__}(" if inner is not self.model else ""
        return f"{wrapper}{type(inner).__name__}{')' if wrapper else ''} ({self.parameters:,} parameters trained)"


def _heap() -> Iterator[object]:
    """Every object `gc` tracks. Touching some of them warns (torch's deprecated aliases
    answer `isinstance` with a FutureWarning): those warnings are not the user's business."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield from gc.get_objects()


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def model_of(optimizer: torch.optim.Optimizer) -> Found:
    """The root module holding the parameters `optimizer` updates."""
    wanted = optimizer_parameters(optimizer)
    if not wanted:
        raise NothingToWatch("the optimizer has no parameters")
    # type(), not isinstance(): a weakref.proxy to a module (Lightning keeps some) passes isinstance.
    modules: list[torch.nn.Module] = [cast(torch.nn.Module, o) for o in _heap() if issubclass(type(o), torch.nn.Module)]
    children = {id(child) for m in modules for child in m.children()}
    best: tuple[int, int, torch.nn.Module] | None = None
    for module in modules:
        if id(module) in children:
            continue
        covered = total = 0
        for p in module.parameters():
            total += p.numel()
            if id(p) in wanted:
                covered += p.numel()
        # The most of the optimizer's parameters; among equals, the fewest others.
        if covered and (best is None or (covered, -total) > (best[0], -best[1])):
            best = (covered, total, module)
    if best is None:
        raise NothingToWatch("no module alive in the process holds the optimizer's parameters")
    return Found(model=best[2], parameters=best[0], framework=trainer_of(optimizer))


def trainer_of(optimizer: torch.optim.Optimizer) -> Any:
    """A Hugging Face `Trainer` or a Lightning `Trainer` whose optimizer this is (or wraps)."""
    for o in _heap():
        name = type(o).__name__
        if not name.endswith("Trainer") or not hasattr(o, "state") and not hasattr(o, "global_step"):
            continue
        candidates = [getattr(o, "optimizer", None), *(getattr(o, "optimizers", None) or [])]
        for c in candidates:
            if c is optimizer or getattr(c, "optimizer", None) is optimizer:
                return o
    return None


def steps_done(optimizer: torch.optim.Optimizer, framework: Any) -> int | None:
    """Optimizer steps completed, this one included, read from inside a step post-hook: the
    framework's global step (not yet advanced for this step), else the step count the
    optimizer keeps per parameter (Adam, AdamW, ...); None when neither exists."""
    state = getattr(framework, "state", None)
    step = getattr(state, "global_step", None)  # Hugging Face
    if step is None and framework is not None and hasattr(framework, "fit_loop"):
        step = getattr(framework, "global_step", None)  # Lightning
    if isinstance(step, int):
        return step + 1
    for group in optimizer.param_groups:
        for p in group["params"]:
            value = optimizer.state.get(p, {}).get("step")
            if isinstance(value, torch.Tensor):
                # On the CPU unless the optimizer is capturable: then this one read syncs, once.
                return int(value.detach().to("cpu", non_blocking=False))
            if isinstance(value, (int, float)):
                return int(value)
    return None

