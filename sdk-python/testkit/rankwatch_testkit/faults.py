"""Fault injection for demos and tests: what goes wrong in real data-parallel jobs, on purpose.

A fault is written ``KIND@STEP[:key=value...]`` (``--fault`` in the example), e.g.
``grad_scale@60:rank=1:factor=8``. Kinds:

* ``data_seed``   — rank ``rank`` (or ``all``: every rank) shuffles the data with another seed:
  desynchronised data order, the "silent inconsistency" of arXiv 2602.14462.
* ``shuffle_labels`` — rank ``rank`` is fed corrupted data: its targets are permuted (a share
  ``rate`` of them, 1 by default, permuted among themselves).
* ``grad_scale``  — rank ``rank``'s local gradient is multiplied by ``factor`` before the
  all-reduce (a faulty kernel, silent data corruption on one GPU).
* ``grad_noise``  — noise of relative size ``sigma`` (×‖g‖) is added to the local gradient.
* ``grad_flip``   — the ``count`` largest coordinates of each local gradient tensor flip sign.
* ``grad_bit_flip`` — from that step, every ``every`` steps, bit ``bit`` (0 = the lowest
  mantissa bit, 23–30 the exponent, 31 the sign of a float32) of one element of rank ``rank``'s
  local gradient flips: silent data corruption in a GPU's arithmetic or memory. The element is
  drawn anew each time, weighted by tensor size, from a generator of the fault's own.
* ``weight_bit_flip`` — at that step, bit ``bit`` of one element of rank ``rank``'s copy of the
  weights flips, once. DDP never compares replicas after it starts, so that rank trains on
  different weights from then on (the corrupted element is kept by every later update).
* ``stale_weights`` — from that step rank ``rank`` computes its gradient on the weights of
  ``steps`` updates ago (a replica that lags the others: a lost or delayed update), and its
  stale gradient is averaged with the fresh ones.
* ``collapse``    — layer ``layer`` is pushed toward attention-dominated collapse: its value and
  output projections grow by ``rate`` per step while its query and key projections shrink by
  it, so its attention flattens into an average over tokens that outweighs the residual
  stream. The MLP/attention ratio falls away from where it settled; token states converge.
* ``act_grow``    — layer ``layer``'s output is multiplied by ``factor`` (activation outliers).
* ``nan``         — rank ``rank``'s loss becomes NaN at that step (it spreads through the
  all-reduce, as a real one does).
* ``stop_reporting`` — rank ``rank`` keeps training but its agent stops reporting (a hung or
  dead agent: the collector sees a stale rank).

Gradient faults act through tensor hooks on the parameters, so they change the gradient
*before* DDP's bucket all-reduce sees it — where rankwatch measures ‖g_k‖ — exactly as a
corrupted local gradient would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

KINDS = (
    "data_seed",
    "shuffle_labels",
    "grad_scale",
    "grad_noise",
    "grad_flip",
    "grad_bit_flip",
    "weight_bit_flip",
    "stale_weights",
    "collapse",
    "act_grow",
    "nan",
    "stop_reporting",
)
_DEFAULTS: dict[str, dict[str, float]] = {
    "shuffle_labels": {"rate": 1.0},
    "grad_scale": {"factor": 8.0},
    "grad_noise": {"sigma": 2.0},
    "grad_flip": {"count": 16},
    "grad_bit_flip": {"bit": 30, "every": 1},
    "weight_bit_flip": {"bit": 30},
    "stale_weights": {"steps": 1},
    "collapse": {"rate": 0.05},
    "act_grow": {"factor": 100.0},
}


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank
    layer: int | None = None
    params: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def parse(text: str) -> Fault:
        """Parses ``KIND@STEP[:key=value...]``; raises ValueError naming what is wrong."""
        head, *options = text.split(":")
        kind, at, step = head.partition("@")
        if kind not in KINDS:
            raise ValueError(f"fault {text!r}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not at or not step.isdigit():
            raise ValueError(f"fault {text!r}: needs @STEP with a non-negative integer step")
        rank: int | None = None
        layer: int | None = None
        params = dict(_DEFAULTS.get(kind, {}))
        for option in options:
            key, eq, value = option.partition("=")
            if not eq:
                raise ValueError(f"fault {text!r}: option {option!r} is not key=value")
            try:
                if key == "rank":
                    rank = None if value == "all" else int(value)
                elif key == "layer":
                    layer = int(value)
                elif key in params:
                    params[key] = float(value)
                else:
                    raise ValueError(f"fault {text!r}: unknown option {key!r} for {kind}")
            except ValueError as e:
                if "unknown option" in str(e):
                    raise
                raise ValueError(f"fault {text!r}: {key}={value!r} is not a number") from None
        if kind == "shuffle_labels" and not 0.0 < params["rate"] <= 1.0:
            raise ValueError(f"fault {text!r}: rate must be in (0, 1]")
        if kind in ("grad_bit_flip", "weight_bit_flip") and params["bit"] not in range(32):
            raise ValueError(f"fault {text!r}: bit must be an integer from 0 to 31")
        if kind == "grad_bit_flip" and (params["every"] < 1 or params["every"] != int(params["every"])):
            raise ValueError(f"fault {text!r}: every must be a positive integer")
        if kind == "stale_weights" and (params["steps"] < 1 or params["steps"] != int(params["steps"])):
            raise ValueError(f"fault {text!r}: steps must be a positive integer")
        if kind in ("collapse", "act_grow") and layer is None:
            raise ValueError(f"fault {text!r}: {kind} needs layer=N")
        if kind in ("shuffle_labels", "grad_scale", "grad_noise", "grad_flip", "grad_bit_flip", "weight_bit_flip", "stale_weights", "nan", "stop_reporting") and rank is None:
            raise ValueError(f"fault {text!r}: {kind} needs rank=N")
        return Fault(kind, int(step), rank, layer, params)

    def applies(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def check(texts: list[str], error: Callable[[str], NoReturn]) -> None:
    """Parses every ``--fault`` given; calls `error` (an argparse parser's) with the first
    problem, so a typo stops the example before any process starts."""
    for text in texts:
        try:
            Fault.parse(text)
        except ValueError as e:
            error(str(e))


def flip_bit(values: torch.Tensor, index: int, bit: int) -> None:
    """Flips bit `bit` of element `index` (of the flattened tensor) in place, as a bit flip in
    memory would: the float's bits, not its value, are what changes."""
    width = values.element_size() * 8
    if not values.is_floating_point() or width not in (16, 32, 64) or bit >= width:
        raise ValueError(f"cannot flip bit {bit} of a {values.dtype} tensor")
    ints = {16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
    mask = 1 << bit
    if bit == width - 1:
        mask -= 1 << width  # the sign bit, as a signed integer of that width
    # A same-size dtype view keeps the strides, so this writes the tensor's own memory even
    # when it is not contiguous (a transposed weight); `index` counts in logical order.
    bits = values.detach().view(ints)
    at = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), values.shape))
    bits[at] ^= mask


class Injector:
    """Applies a list of faults to one rank's training: call `data_seed()` when building the
    data, `attach(model)` once, `begin_step(step)` before each forward, `targets()` on each
    batch, `loss()` on each loss, `end_backward()` after the backward pass (before the
    optimizer steps), and `reporting()` to ask whether to log this step."""

    def __init__(self, faults: list[Fault], rank: int) -> None:
        self.rank = rank
        self.faults = [f for f in faults if f.applies(rank)]
        self.step = 0
        self._hooks: list[Any] = []
        self._blocks: list[torch.nn.Module] | None = None
        self._params: list[torch.nn.Parameter] = []
        # Bit flips draw their element from a generator of their own (never the global stream,
        # which the healthy twin must consume identically).
        self._random = torch.Generator().manual_seed(8191 + rank)
        self._flip_at: tuple[int, int] | None = None  # (parameter, element) of this step's gradient flip
        self._names: list[str] = []
        self.flipped: list[str] = []  # names of the parameters whose weights had a bit flipped
        self._history: list[list[torch.Tensor]] = []  # stale_weights: weights of the last steps, oldest first
        self._fresh: list[torch.Tensor] | None = None  # the current weights while stale ones are in place

    def active(self, kind: str) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind and self.step >= f.step), None)

    def data_seed(self, seed: int) -> int:
        fault = next((f for f in self.faults if f.kind == "data_seed"), None)
        return seed if fault is None else seed + 7919 * (self.rank + 1)

    def attach(self, model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._params = [p for _, p in named]
        self._names = [n for n, _ in named]
        for i, p in enumerate(self._params):
            self._hooks.append(p.register_hook(lambda grad, i=i: self._gradient(grad, i)))
        for fault in self.faults:
            if fault.kind == "act_grow" and blocks is not None:
                block = blocks[fault.layer]  # type: ignore[index]
                self._hooks.append(block.register_forward_hook(self._grow(fault)))
        self._blocks = blocks

    def _pick_element(self) -> tuple[int, int]:
        """A parameter and an element of it, each element of the model equally likely."""
        sizes = torch.tensor([p.numel() for p in self._params], dtype=torch.float64)
        which = int(torch.multinomial(sizes, 1, generator=self._random))
        return which, int(torch.randint(self._params[which].numel(), (1,), generator=self._random))

    def begin_step(self, step: int) -> None:
        self.step = step
        self._flip_at = None
        fault = self.active("grad_bit_flip")
        if fault is not None and (step - fault.step) % int(fault.params["every"]) == 0:
            self._flip_at = self._pick_element()
        fault = self.active("weight_bit_flip")
        if fault is not None and step == fault.step:
            which, index = self._pick_element()
            with torch.no_grad():
                flip_bit(self._params[which], index, int(fault.params["bit"]))
            self.flipped.append(self._names[which])
        fault = next((f for f in self.faults if f.kind == "stale_weights"), None)
        # Snapshots from `lag` steps before the fault on only: none is read earlier.
        if fault is not None and self._params and step >= fault.step - int(fault.params["steps"]):
            lag = int(fault.params["steps"])
            self._history.append([p.detach().clone() for p in self._params])
            del self._history[: -(lag + 1)]
            if step >= fault.step and len(self._history) == lag + 1:
                self._fresh = self._history[-1]
                with torch.no_grad():
                    for p, old in zip(self._params, self._history[0], strict=True):
                        p.copy_(old)
        fault = self.active("collapse")
        if fault is not None and self._blocks is not None:
            attn = self._blocks[fault.layer].attn  # type: ignore[index]
            rate = fault.params["rate"]
            width = attn.c_proj.weight.shape[0]
            with torch.no_grad():
                # c_attn stacks W_q, W_k, W_v (nanoGPT's layout).
                attn.c_attn.weight[: 2 * width].mul_(1.0 - rate)
                attn.c_attn.weight[2 * width :].mul_(1.0 + rate)
                attn.c_proj.weight.mul_(1.0 + rate)

    def _grow(self, fault: Fault):
        def hook(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
            if self.step >= fault.step:
                return output * fault.params["factor"]
            return None

        return hook

    def end_backward(self) -> None:
        """Puts the current weights back where stale ones computed this step's gradient."""
        if self._fresh is not None:
            with torch.no_grad():
                for p, fresh in zip(self._params, self._fresh, strict=True):
                    p.copy_(fresh)
            self._fresh = None

    def _gradient(self, grad: torch.Tensor, param: int) -> torch.Tensor:
        if self._flip_at is not None and self._flip_at[0] == param:
            grad = grad.clone()
            flip_bit(grad, self._flip_at[1], int(self.active("grad_bit_flip").params["bit"]))  # type: ignore[union-attr]
        fault = self.active("grad_scale")
        if fault is not None:
            grad = grad * fault.params["factor"]
        fault = self.active("grad_noise")
        if fault is not None:
            noise = torch.randn_like(grad)
            grad = grad + noise * (fault.params["sigma"] * grad.norm() / max(grad.numel(), 1) ** 0.5)
        fault = self.active("grad_flip")
        if fault is not None:
            flat = grad.flatten().clone()
            k = min(int(fault.params["count"]), flat.numel())
            idx = flat.abs().topk(k).indices
            flat[idx] = -flat[idx]
            grad = flat.view_as(grad)
        return grad

    def targets(self, targets: torch.Tensor) -> torch.Tensor:
        fault = self.active("shuffle_labels")
        if fault is None:
            return targets
        flat = targets.flatten()
        rate = fault.params["rate"]
        if rate >= 1.0:
            return flat[torch.randperm(flat.numel())].view_as(targets)
        # A share of the positions, their targets permuted among them.
        picked = torch.randperm(flat.numel())[: round(rate * flat.numel())]
        out = flat.clone()
        out[picked] = flat[picked[torch.randperm(picked.numel())]]
        return out.view_as(targets)

    def loss(self, loss: torch.Tensor) -> torch.Tensor:
        fault = self.active("nan")
        if fault is not None and self.step == fault.step:
            return loss * float("nan")
        return loss

    def reporting(self) -> bool:
        return self.active("stop_reporting") is None

    def remove(self) -> None:
        self.end_backward()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
