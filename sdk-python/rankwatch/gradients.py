"""The gradient probe: each rank's own gradient before data-parallel averaging hides it, measured
without touching the gradient, the collective or the random stream.

Mechanism. One `register_post_accumulate_grad_hook` per parameter. Autograd calls it right after
it accumulated the parameter's `.grad` and *before* any data-parallel wrapper sees that gradient
(DistributedDataParallel's reducer hangs off the same accumulation, after the tensor's own
hooks), so `.grad` there is exactly this rank's local contribution, summed over gradient
accumulation micro-batches. The hook only reads it. The averaged gradient ‖ḡ‖ is read from
`.grad` at the end of the backward pass, after the wrapper finished its reduction: the probe
queues an autograd final callback from its first hook, and that callback queues itself once
more so it runs after the wrapper's own final callback (the engine runs callbacks queued by
callbacks, in order). Nothing is ever written to a gradient, no collective is issued, and no
comm hook is registered, so the probe composes with any comm hook the user registered
(PowerSGD, bf16 compression), with DDP over any process group, and `remove()` takes every hook
away.

What one backward measures, per parameter slot (overwritten, never summed, so a parameter
accumulated twice in one backward, as reentrant checkpointing does, is still counted once):

* ‖g_k‖ of each parameter's local gradient — one kernel in the hook; their sum of squares
  (→ ``grad_norm``) and the number of gradient tensors whose norm is NaN/Inf, i.e. that hold a
  NaN/Inf (→ ``nonfinite``), are taken once, batched, at the end of the backward;
* on sketch steps, the CountSketch of the local gradient with a seed shared by all ranks:
  coordinate i of parameter j is the 64-bit index (j << 32) | i, hashed with murmur3's
  finaliser, so every rank maps every coordinate to the same bucket and sign and ⟨s_i, s_j⟩
  estimates ⟨g_i, g_j⟩;
* in dot mode, a copy of the local gradient, held until the end of the backward: then
  ⟨g_k, ḡ⟩ (→ ``cos_to_mean``, exact) and the copy is freed. It costs one gradient's memory
  for the length of a backward; `dot_mode=False` turns it off.

At the end of a backward whose gradients the wrapper reduced, ‖ḡ‖² comes from the reduced
`.grad` (→ ``grad_norm_mean``). Under gradient accumulation with `no_sync`, the micro-batches
that do not synchronise are skipped (the wrapper's own flag, read when its forward starts), so
there is one record per optimizer step and it describes the rank's whole contribution. With a
`GradScaler` every quantity is divided by the scale the backward ran with (its device tensor,
never read on the host), and a reduced gradient holding an Inf/NaN is reported as the step the
scaler will skip (``amp_skipped``), not as a non-finite alarm.

Every value stays a device tensor; the run's reporter copies them to the host asynchronously.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_MASK32 = 0xFFFFFFFF


def _fmix32(h: Any) -> Any:
    """murmur3's 32-bit finaliser on values in [0, 2^32): Python ints or int64 tensors (the
    products may wrap in int64, which leaves the low 32 bits that the mask keeps exact)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def countsketch_coordinates(seed: int, block: int, n: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Output bucket and sign of coordinates 0..n of gradient block `block` (a parameter)."""
    key = _fmix32((seed ^ 0x9E3779B9) & _MASK32)
    lo = torch.arange(n, device=device, dtype=torch.int64)
    hi = block & _MASK32
    h = _fmix32(((_fmix32(lo ^ key) ^ hi) + key) & _MASK32)
    target = (h & 0x7FFFFFFF) % dim
    sign = 1.0 - 2.0 * (h >= 0x80000000).to(torch.float32)
    return target, sign


@dataclass
class GradientRecord:
    """What the last completed backward measured; every field a device tensor."""

    local_sq: torch.Tensor
    nonfinite: torch.Tensor
    mean_sq: torch.Tensor | None
    dot: torch.Tensor | None
    skipped: torch.Tensor | None
    sketch: torch.Tensor | None


def find_ddp_wrapper(module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel that wraps `module`, if one exists (frameworks such as the
    Hugging Face Trainer hand callbacks the inner module and keep the wrapper to themselves).

    DDP keeps the module in its `_modules` dict, which its instance dict holds: the wrapper is
    found through at most those two dicts among the module's referrers (a one-off walk, at
    the end of the first backward)."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return module
    frontier: list[Any] = [module]
    seen = {id(module)}
    for _ in range(3):
        holders: list[Any] = []
        for obj in frontier:
            for holder in gc.get_referrers(obj):
                if isinstance(holder, torch.nn.parallel.DistributedDataParallel) and holder.module is module:
                    return holder
                if isinstance(holder, dict) and id(holder) not in seen:
                    seen.add(id(holder))
                    holders.append(holder)
        frontier = holders
    return None


class GradientProbe:
    """Post-accumulate-grad hooks on `params`, an end-of-backward callback, and the record."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        wrapper: torch.nn.parallel.DistributedDataParallel | None = None,
        find_wrapper_of: torch.nn.Module | None = None,
        scaler: Any = None,
        dot_mode: bool = True,
        sketch_dim: int = 1024,
        sketch_seed: int = 0,
        cache_limit: int = 50_000_000,
    ) -> None:
        # Each parameter once (tied weights appear twice in some lists), in the model's order,
        # which every rank shares: the sketch's coordinates depend on it.
        self._params = list(dict.fromkeys(p for p in params if p.requires_grad))
        if not self._params:
            raise ValueError("rankwatch: no parameter requires a gradient; nothing for the gradient probe to watch")
        self.device = self._params[0].device
        self.dot_mode = dot_mode
        self.sketch_dim = sketch_dim
        self.sketch_seed = sketch_seed
        self.scaler = scaler
        self._cache_limit = cache_limit
        self._coordinates: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        n = len(self._params)
        self._norms: list[torch.Tensor | None] = [None] * n
        self._sketch_rows: torch.Tensor | None = None
        self._copies: list[torch.Tensor | None] = [None] * n
        # Cadence: the run arms the probe for the backward passes of steps it will report.
        self.armed = True
        self.sketch_armed = False
        self._record: GradientRecord | None = None  # the last backward's, until taken
        self.error: BaseException | None = None
        self._sync = True
        self._complete = True
        self._pending_tasks: set[int] = set()
        self._handles: list[Any] = []
        self._wrapper: torch.nn.parallel.DistributedDataParallel | None = None
        self._find_wrapper_of = find_wrapper_of if wrapper is None else None
        if wrapper is not None:
            self._attach_wrapper(wrapper)
        for index, param in enumerate(self._params):
            self._handles.append(param.register_post_accumulate_grad_hook(self._hook_for(index)))

    # -- wiring -----------------------------------------------------------------------------

    def _attach_wrapper(self, wrapper: torch.nn.parallel.DistributedDataParallel) -> None:
        self._wrapper = wrapper
        self._find_wrapper_of = None
        self._sync = bool(wrapper.require_backward_grad_sync)
        self._handles.append(wrapper.register_forward_pre_hook(self._note_sync))

    def _note_sync(self, wrapper: Any, args: Any) -> None:
        # DDP decides at the start of its forward whether the coming backward reduces; so do we.
        self._sync = bool(wrapper.require_backward_grad_sync) and torch.is_grad_enabled()

    def remove(self) -> None:
        """Takes every hook away; training goes on exactly as without the probe."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._copies = [None] * len(self._params)

    # -- hooks ------------------------------------------------------------------------------

    def _hook_for(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            if self.error is not None or not self.armed or not self._sync:
                return
            try:
                self._observe(index, param)
            except Exception as e:  # noqa: BLE001 - a probe must never break the step
                self._fail(e)

        return hook

    def _observe(self, index: int, param: torch.Tensor) -> None:
        if self._complete:
            # The first hook of a new backward: slots of parameters it will not reach are zero.
            self._complete = False
            self._norms = [None] * len(self._params)
            if self._sketch_rows is not None:
                self._sketch_rows.zero_()
            self._copies = [None] * len(self._params)
        task = torch._C._current_graph_task_id()
        if task not in self._pending_tasks:
            self._pending_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_of_backward(task, first_pass=True))
        grad = param.grad
        if grad is None:
            return
        g = grad.detach()
        # One kernel per parameter here; everything else is batched at the end of the backward.
        self._norms[index] = torch.linalg.vector_norm(g, dtype=torch.float32)
        if self.sketch_armed:
            if self._sketch_rows is None:
                self._sketch_rows = torch.zeros(len(self._params), self.sketch_dim, dtype=torch.float32, device=self.device)
            target, sign = self._coords(index, g.numel())
            row = self._sketch_rows[index]
            row.zero_()
            row.index_add_(0, target, g.reshape(-1).float() * sign)
        if self.dot_mode:
            self._copies[index] = g.clone()

    def _coords(self, index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self._coordinates.get(index)
        if hit is not None and hit[0].numel() == n:
            return hit
        coords = countsketch_coordinates(self.sketch_seed, index, n, self.sketch_dim, self.device)
        # Cache the hashes while the model is small enough that it pays; large models
        # recompute them on each sketch step instead.
        if sum(t.numel() for t, _ in self._coordinates.values()) + n <= self._cache_limit:
            self._coordinates[index] = coords
        return coords

    def _end_of_backward(self, task: int, first_pass: bool) -> None:
        try:
            if first_pass:
                if torch._C._current_autograd_node() is not None:
                    # A backward nested in a node of the outer one (reentrant checkpointing):
                    # the outer backward is not over; its own callback closes the record.
                    self._pending_tasks.discard(task)
                    return
                # Run again after the callbacks queued so far: the wrapper's reduction is one.
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_of_backward(task, first_pass=False))
                return
            self._pending_tasks.discard(task)
            if self.error is None and not self._complete:
                self._close()
        except Exception as e:  # noqa: BLE001 - a probe must never break the step
            self._fail(e)

    def _reduced(self) -> bool:
        if self._wrapper is None and self._find_wrapper_of is not None and dist.is_available() and dist.is_initialized():
            found = find_ddp_wrapper(self._find_wrapper_of)
            self._find_wrapper_of = None
            if found is not None:
                self._attach_wrapper(found)
                # Found after its forward: its own flag still says whether this backward synced.
                self._sync = bool(found.require_backward_grad_sync)
        return self._wrapper is not None and self._sync

    def _close(self) -> None:
        self._complete = True
        local = [n for n in self._norms if n is not None]
        norms = torch.stack(local) if local else torch.zeros(1, device=self.device)
        local_sq = norms.double().square().sum()
        # A NaN/Inf anywhere in a gradient makes its norm NaN/Inf: count the tensors holding one.
        nonfinite = (~torch.isfinite(norms)).sum().double()
        mean_sq = dot = None
        if self._reduced():
            grads = [p.grad for p in self._params]
            present = [i for i, g in enumerate(grads) if g is not None]
            if present:
                norms = torch._foreach_norm([grads[i].detach() for i in present], 2, dtype=torch.float32)  # type: ignore[union-attr]
                mean_sq = torch.stack(norms).double().square().sum()
            else:
                mean_sq = torch.zeros((), dtype=torch.float64, device=self.device)
            if self.dot_mode:
                dots = []
                for i in present:
                    copy = self._copies[i]
                    if copy is not None:
                        if copy.is_cuda:
                            # Made on the backward's stream, used and freed on this one.
                            copy.record_stream(torch.cuda.current_stream(copy.device))
                        reduced = grads[i].detach().reshape(-1)  # type: ignore[union-attr]
                        if copy.dtype not in (torch.float32, torch.float64):
                            copy, reduced = copy.float(), reduced.float()
                        dots.append(torch.dot(copy.reshape(-1), reduced))
                dot = torch.stack(dots).double().sum() if dots else torch.zeros((), dtype=torch.float64, device=self.device)
        self._copies = [None] * len(self._params)
        skipped = None
        if self.scaler is not None and _scaler_enabled(self.scaler):
            scale = getattr(self.scaler, "_scale", None)
            if isinstance(scale, torch.Tensor):
                inv_sq = scale.double().reciprocal().square().to(self.device).reshape(())
                local_sq = local_sq * inv_sq
                mean_sq = mean_sq * inv_sq if mean_sq is not None else None
                dot = dot * inv_sq if dot is not None else None
            # The scaler checks the gradient its optimizer sees: the reduced one when reduced.
            checked = mean_sq if mean_sq is not None else local_sq
            skipped = (~torch.isfinite(checked)).double()
            nonfinite = torch.zeros_like(nonfinite)
        sketch = self._sketch_rows.sum(0) if self.sketch_armed and self._sketch_rows is not None else None
        self._record = GradientRecord(local_sq, nonfinite, mean_sq, dot, skipped, sketch)

    def take(self) -> GradientRecord | None:
        """The record of the last backward, once; None when no backward finished since."""
        record, self._record = self._record, None
        return record

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._copies = [None] * len(self._params)


def _scaler_enabled(scaler: Any) -> bool:
    enabled = getattr(scaler, "is_enabled", None)
    return bool(enabled()) if callable(enabled) else True
