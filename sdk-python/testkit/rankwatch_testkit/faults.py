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
* ``optim_bit_flip`` — at that step, bit ``bit`` of one element of one of rank ``rank``'s
  optimizer state tensors (Adam's moments; a parameter drawn by size, then one of its state
  tensors) flips, once: the replicas' optimizers differ, and their weights from the next update.
* ``skip_step``   — rank ``rank`` skips its optimizer step at that step (a lost update): its
  weights and optimizer state stay one update behind the others' from then on.
* ``old_checkpoint`` — at that step rank ``rank``'s weights and optimizer state go back to those
  of ``steps`` updates ago, for good: a rank resumed from an older checkpoint than the others.
* ``gemm_corrupt`` — at that step only, bit ``bit`` of one element of the output of one linear
  layer (drawn from the blocks' linear layers, then an element) flips on rank ``rank``: a
  corrupted matrix multiply in one forward pass. Its effect on the loss and the gradient is
  averaged into every replica; the replicas stay equal.
* ``duplicate_data`` — from that step rank ``rank`` reads the batches of rank ``(rank + 1) %
  world``: two ranks train on one shard, one shard is never read. (The harness draws the
  batches of ``duplicated_shard(world)`` in step with its own, and takes them when
  ``reads_shard_of(world)`` says so.)
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

import copy
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
    "optim_bit_flip",
    "skip_step",
    "old_checkpoint",
    "gemm_corrupt",
    "duplicate_data",
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
    "optim_bit_flip": {"bit": 30},
    "old_checkpoint": {"steps": 10},
    "gemm_corrupt": {"bit": 30},
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
        if kind in ("grad_bit_flip", "weight_bit_flip", "optim_bit_flip", "gemm_corrupt") and params["bit"] not in range(32):
            raise ValueError(f"fault {text!r}: bit must be an integer from 0 to 31")
        if kind == "grad_bit_flip" and (params["every"] < 1 or params["every"] != int(params["every"])):
            raise ValueError(f"fault {text!r}: every must be a positive integer")
        if kind in ("stale_weights", "old_checkpoint") and (params["steps"] < 1 or params["steps"] != int(params["steps"])):
            raise ValueError(f"fault {text!r}: steps must be a positive integer")
        if kind in ("collapse", "act_grow") and layer is None:
            raise ValueError(f"fault {text!r}: {kind} needs layer=N")
        if kind not in ("data_seed", "collapse", "act_grow") and rank is None:
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
        self._optimizer: torch.optim.Optimizer | None = None
        self._linears: list[torch.nn.Module] = []
        self._corrupt_hook: Any = None  # gemm_corrupt's one-step forward hook
        self._skipping: tuple[list[torch.Tensor], dict[str, Any]] | None = None  # skip_step: the state to put back
        self._checkpoints: list[tuple[list[torch.Tensor], dict[str, Any]]] = []  # old_checkpoint: oldest first
        self._fresh: list[torch.Tensor] | None = None  # the current weights while stale ones are in place

    def active(self, kind: str) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind and self.step >= f.step), None)

    def data_seed(self, seed: int) -> int:
        fault = next((f for f in self.faults if f.kind == "data_seed"), None)
        return seed if fault is None else seed + 7919 * (self.rank + 1)

    def attach(self, model: torch.nn.Module, blocks: list[torch.nn.Module] | None = None, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Hooks the faults into `model` (its `blocks`, where a fault needs them) and, for the
        faults that act on optimizer state (``optim_bit_flip``, ``skip_step``,
        ``old_checkpoint``), into `optimizer`."""
        self._optimizer = optimizer
        if any(f.kind in ("optim_bit_flip", "skip_step", "old_checkpoint") for f in self.faults) and optimizer is None:
            raise ValueError("rankwatch_testkit: optim_bit_flip, skip_step and old_checkpoint need attach(..., optimizer=)")
        linears: list[torch.nn.Module] = [m for b in (blocks if blocks is not None else [model]) for m in b.modules() if isinstance(m, torch.nn.Linear)]
        self._linears = linears
        if optimizer is not None and any(f.kind == "skip_step" for f in self.faults):
            self._hooks.append(optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step()))
            self._hooks.append(optimizer.register_step_post_hook(lambda *_: self._after_optimizer_step()))
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
        self._optimizer_faults(step)
        if self._corrupt_hook is not None:
            self._corrupt_hook.remove()
            self._corrupt_hook = None
        fault = self.active("gemm_corrupt")
        if fault is not None and step == fault.step and self._linears:
            which = int(torch.randint(len(self._linears), (1,), generator=self._random))
            self._corrupt_hook = self._linears[which].register_forward_hook(self._corrupt(int(fault.params["bit"])))
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
            attn: Any = self._blocks[fault.layer].attn  # type: ignore[index]  # nanoGPT's attention: c_attn, c_proj
            rate = fault.params["rate"]
            width = attn.c_proj.weight.shape[0]
            with torch.no_grad():
                # c_attn stacks W_q, W_k, W_v (nanoGPT's layout).
                attn.c_attn.weight[: 2 * width].mul_(1.0 - rate)
                attn.c_attn.weight[2 * width :].mul_(1.0 + rate)
                attn.c_proj.weight.mul_(1.0 + rate)

    def _optimizer_faults(self, step: int) -> None:
        """optim_bit_flip, skip_step and old_checkpoint, at the start of `step`."""
        fault = self.active("optim_bit_flip")
        if fault is not None and step == fault.step and self._optimizer is not None:
            held = [(n, p) for n, p in zip(self._names, self._params, strict=True) if self._optimizer.state.get(p)]
            if not held:
                raise RuntimeError("rankwatch_testkit: optim_bit_flip before the optimizer holds any state")
            sizes = torch.tensor([p.numel() for _, p in held], dtype=torch.float64)
            name, param = held[int(torch.multinomial(sizes, 1, generator=self._random))]
            state = self._optimizer.state[param]
            keys = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() == param.numel())
            key = keys[int(torch.randint(len(keys), (1,), generator=self._random))]
            flip_bit(state[key], int(torch.randint(param.numel(), (1,), generator=self._random)), int(fault.params["bit"]))
            self.flipped.append(f"{name}:{key}")
        fault = next((f for f in self.faults if f.kind == "old_checkpoint"), None)
        if fault is not None and fault.step - int(fault.params["steps"]) <= step <= fault.step:
            self._checkpoints.append(self._snapshot())
            del self._checkpoints[: -(int(fault.params["steps"]) + 1)]
            if step == fault.step:
                self._restore(self._checkpoints[0])
                self._checkpoints.clear()

    def _snapshot(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        assert self._optimizer is not None
        return [p.detach().clone() for p in self._params], copy.deepcopy(self._optimizer.state_dict())

    def _restore(self, saved: tuple[list[torch.Tensor], dict[str, Any]]) -> None:
        assert self._optimizer is not None
        with torch.no_grad():
            for p, old in zip(self._params, saved[0], strict=True):
                p.copy_(old)
        self._optimizer.load_state_dict(saved[1])

    def _before_optimizer_step(self) -> None:
        fault = self.active("skip_step")
        if fault is not None and self.step == fault.step:
            self._skipping = self._snapshot()

    def _after_optimizer_step(self) -> None:
        if self._skipping is not None:
            self._restore(self._skipping)  # as if the step never ran on this rank
            self._skipping = None

    def _corrupt(self, bit: int) -> Callable[[torch.nn.Module, Any, torch.Tensor], torch.Tensor]:
        def hook(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
            out = output.clone()
            flip_bit(out, int(torch.randint(out.numel(), (1,), generator=self._random)), bit)
            return out

        return hook

    def duplicated_shard(self, world: int) -> int | None:
        """Under a ``duplicate_data`` fault of this rank: the rank whose batches it takes from
        the fault's step (the harness draws them in step from the start); else None."""
        return (self.rank + 1) % world if any(f.kind == "duplicate_data" for f in self.faults) else None

    def reads_shard_of(self, world: int) -> int | None:
        """Under ``duplicate_data``, from its step: the rank whose batches this rank takes."""
        return self.duplicated_shard(world) if self.active("duplicate_data") is not None else None

    def _grow(self, fault: Fault) -> Callable[[torch.nn.Module, Any, torch.Tensor], torch.Tensor | None]:
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
        if self._corrupt_hook is not None:
            self._corrupt_hook.remove()
            self._corrupt_hook = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
