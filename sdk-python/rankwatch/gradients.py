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
  estimates ⟨g_i, g_j⟩ (on a GPU with Triton one fused kernel, `sketch_kernel`; elsewhere
  hashed coordinates kept up to a budget, then a scatter);
* in dot mode, on dot steps (a cadence of its own, every 10th step by default), a copy of the
  local gradient, held until the end of the backward: then ⟨g_k, ḡ⟩ (→ ``cos_to_mean``,
  exact) and the copy is freed. It costs one gradient's memory for the length of a backward
  and three passes over it — three times the norms' cost, hence not every step;
  `dot_mode=False` turns it off.

At the end of a backward whose gradients the wrapper reduced, ‖ḡ‖² comes from the reduced
`.grad` (→ ``grad_norm_mean``). Under gradient accumulation with `no_sync`, the micro-batches
that do not synchronise are skipped (the wrapper's own flag, read when its forward starts), so
there is one record per optimizer step and it describes the rank's whole contribution. With a
`GradScaler` (the one whose `scale()` scaled a loss since the last record, seen through
`scaling.listen`, whether or not it was given to `watch`) every quantity is divided by the scale the backward ran with (its device tensor,
never read on the host), and a reduced gradient holding an Inf/NaN is reported as the step the
scaler will skip (``amp_skipped``), not as a non-finite alarm.

FSDP2 (`fully_shard`). There the parameters are shards and FSDP computes each module's
gradient on an unsharded parameter it keeps for the purpose, then reduce-scatters it. The hooks
go on those unsharded parameters (installed by a one-off forward hook once FSDP made them), so
they still see each rank's whole local gradient before any reduction: ‖g_k‖, the non-finite
count and the sketch are exact as above. The averaged gradient exists only as shards, one per
rank, so ‖ḡ‖² and the sketch of ḡ are sums over ranks: at the end of every backward that FSDP
reduced, every rank of the shard group adds its part with one all-reduce of 2 + sketch_dim
numbers (issued on every rank at the same point of every reducing backward, whether or not
this rank measures the step, so the collectives always match; a rank whose hooks failed still
takes part, with an empty contribution, and the result is marked invalid). ⟨g_k, ḡ⟩ cannot be
had exactly without moving gradients, so under FSDP2 ``cos_to_mean`` is the cosine of the two
CountSketches, on sketch steps: an unbiased estimate with a standard error of about
√((1 + cos²)/sketch_dim) (0.03–0.045 at 1024). The same estimate replaces dot mode under
DistributedDataParallel when one copy of the gradient would exceed `copy_limit_bytes`.

Every value stays a device tensor; the run's reporter copies them to the host asynchronously.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import scaling, sketch_kernel
from .countsketch import countsketch_coordinates
from .sharding import FsdpLayout, find_ddp_wrapper, shard_base, shard_indices

_UNSCALED = object()  # the loss went through a disabled GradScaler


@dataclass
class GradientRecord:
    """What the last completed backward measured; every field a device tensor."""

    local_sq: torch.Tensor
    nonfinite: torch.Tensor
    mean_sq: torch.Tensor | None
    dot: torch.Tensor | None
    skipped: torch.Tensor | None
    sketch: torch.Tensor | None


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
        cache_bytes: int = 512 << 20,
        copy_limit_bytes: int = 1 << 30,
        fsdp: FsdpLayout | None = None,
        fused: bool = True,
    ) -> None:
        # Each parameter once (tied weights appear twice in some lists), in the model's order,
        # which every rank shares: the sketch's coordinates depend on it.
        self._params = list(dict.fromkeys(p for p in params if p.requires_grad))
        if fsdp is not None:
            self._params = list(fsdp.params)
        if not self._params:
            raise ValueError("rankwatch: no parameter requires a gradient; nothing for the gradient probe to watch")
        self._fsdp = fsdp
        self.device = self._params[0].to_local().device if fsdp is not None else self._params[0].device  # type: ignore[attr-defined]
        # Dot mode holds one copy of the gradient through the backward; above the limit (and
        # always under FSDP2, where ḡ is sharded) the cosine comes from the sketches instead.
        gradient_bytes = sum(p.numel() * p.element_size() for p in self._params)
        self.sketch_cosine = fsdp is not None or (dot_mode and gradient_bytes > copy_limit_bytes)
        self.dot_mode = dot_mode and not self.sketch_cosine
        self.elapsed = 0.0  # seconds spent on the training thread, since the run last read it
        self.sketch_dim = sketch_dim
        self.sketch_seed = sketch_seed
        self._scaler_given = scaler
        self._scaled_by: Any = None  # the scaler whose scale() ran since the last record
        self.scaler_note: str | None = None  # once: the loss was scaled by another scaler
        self._cache_bytes = cache_bytes
        self._cached_bytes = 0
        self._coordinates: dict[int, torch.Tensor] = {}
        # On a GPU the sketch is one fused Triton kernel, with no coordinates kept (see
        # sketch_kernel). `fused=False` forces the reference path (the GPU suite compares the
        # two). Where a DTensor block starts in its parameter, per parameter: fixed for the run.
        self._fused = sketch_kernel.load() if fused and self.device.type == "cuda" else None
        self._shard_bases: dict[int, int | None] = {}
        n = len(self._params)
        self._norms: list[torch.Tensor | None] = [None] * n
        self._sketch_rows: torch.Tensor | None = None
        self._copies: list[torch.Tensor | None] = [None] * n
        # On CPU a fresh copy of a large gradient costs more in page faults than in copying
        # (malloc hands big blocks back to the kernel on free): the copies reuse buffers kept
        # for the run. On a GPU the caching allocator already reuses the blocks.
        self._copy_buffers: list[torch.Tensor | None] = [None] * n
        self._index_chunk: torch.Tensor | None = None
        # Cadence: the run arms the probe for the backward passes of steps it will report.
        self.armed = True
        self.sketch_armed = False
        self.dot_armed = True
        self._record: GradientRecord | None = None  # the last backward's, until taken
        self.error: BaseException | None = None
        self._sync = True
        self._complete = True
        self._pending_tasks: set[int] = set()
        self._handles: list[Any] = []
        self._pending_params: dict[int, Any] = {}
        self._installers: list[Any] = []  # forward hooks waiting for FSDP2's unsharded parameters
        self._wrapper: torch.nn.parallel.DistributedDataParallel | None = None
        self._find_wrapper_of = find_wrapper_of if wrapper is None else None
        if wrapper is not None and fsdp is None:
            self._attach_wrapper(wrapper)
        if fsdp is None:
            for index, param in enumerate(self._params):
                # torch leaves register_post_accumulate_grad_hook unannotated.
                self._handles.append(param.register_post_accumulate_grad_hook(self._hook_for(index)))  # type: ignore[no-untyped-call]
        else:
            self._pending_params = {index: fsdp_param for index, (fsdp_param, _) in enumerate(fsdp.entries)}
            self._install_unsharded()
            if self._pending_params:
                self._installers = [m.register_forward_hook(lambda *_: self._install_unsharded()) for g in fsdp.groups for m in g.modules]

    @property
    def collective(self) -> bool:
        """Whether the probe takes part in a collective (FSDP2): it must then stay installed on
        every rank alike, even after an error, until `remove()` on every rank."""
        return self._fsdp is not None

    def _install_unsharded(self) -> None:
        """Hooks FSDP2's unsharded parameters; FSDP makes them at a module's first forward.
        The forward hooks that call this go once every parameter is hooked."""
        for index, fsdp_param in list(self._pending_params.items()):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                self._handles.append(unsharded.register_post_accumulate_grad_hook(self._hook_for(index)))
                del self._pending_params[index]
        if not self._pending_params:
            self._remove_installers()

    def _remove_installers(self) -> None:
        for handle in self._installers:
            handle.remove()
        self._installers = []

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
        self._pending_params = {}
        self._remove_installers()
        self._copies = [None] * len(self._params)
        self._copy_buffers = [None] * len(self._params)
        self._index_chunk = None

    # -- hooks ------------------------------------------------------------------------------

    def _hook_for(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            started = time.perf_counter()
            try:
                if self._fsdp is not None:
                    # Every reducing backward ends in the probe's all-reduce, measured or not.
                    self._queue_end_of_backward()
                if not self.armed:
                    self._scaled_by = None  # this backward's scaler: no record to unscale
                if self.error is not None or not self.armed or not self._synced(index):
                    return
                self._observe(index, param)
            except Exception as e:  # noqa: BLE001 - a probe must never break the step
                self._fail(e)
            finally:
                self.elapsed += time.perf_counter() - started

        return hook

    def _synced(self, index: int) -> bool:
        """Whether this backward reduces parameter `index`: its FSDP2 group's flag, or DDP's."""
        return self._fsdp.entries[index][1].reduce_grads if self._fsdp is not None else self._sync

    def _queue_end_of_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task not in self._pending_tasks:
            self._pending_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_of_backward(task, first_pass=True))

    def _observe(self, index: int, param: torch.Tensor) -> None:
        if self._complete:
            # The first hook of a new backward: slots of parameters it will not reach are zero.
            self._complete = False
            self._norms = [None] * len(self._params)
            if self._sketch_rows is not None:
                self._sketch_rows.zero_()
            self._copies = [None] * len(self._params)
        self._queue_end_of_backward()
        grad = param.grad
        if grad is None:
            return
        g = grad.detach()
        # One kernel per parameter here; everything else is batched at the end of the backward.
        self._norms[index] = torch.linalg.vector_norm(g, dtype=torch.float32)
        if self.sketch_armed:
            if self._sketch_rows is None:
                self._sketch_rows = torch.zeros(len(self._params), 2 * self.sketch_dim, dtype=torch.float32, device=self.device)
            row = self._sketch_rows[index]
            row.zero_()
            self._sketch_into(row, index, g.reshape(-1))
        if self.dot_mode and self.dot_armed:
            # The exact dot has a cadence of its own: a copy of the gradient is the probe's
            # most expensive work (a pass to write it, two to read it back).
            self._copies[index] = self._copy_of(index, g)

    def _copy_of(self, index: int, g: torch.Tensor) -> torch.Tensor:
        if g.device.type != "cpu":
            return g.clone()
        buffer = self._copy_buffers[index]
        if buffer is None or buffer.shape != g.shape or buffer.dtype != g.dtype:
            buffer = self._copy_buffers[index] = torch.empty(g.shape, dtype=g.dtype)
        return buffer.copy_(g)

    _CHUNK = 1 << 20

    def _accumulate(self, target: torch.Tensor, folded: torch.Tensor, values: torch.Tensor) -> None:
        """target[folded[i]] += values[i] (as float32). On a GPU one index_add_. On CPU, whose
        index_add_ is one serial loop, a chunk at a time: the cached int32 indices widened into
        one reused int64 buffer (scatter_add_ wants them so), and the chunk split into one row
        per thread, which scatter_add_ runs in parallel (2.5× faster on two cores)."""
        if values.device.type != "cpu":
            target.index_add_(0, folded, values.float())
            return
        if self._index_chunk is None:
            self._index_chunk = torch.empty(self._CHUNK, dtype=torch.int64)
        rows = max(1, torch.get_num_threads())
        partial = torch.zeros(rows, target.numel(), dtype=torch.float32)
        for start in range(0, values.numel(), self._CHUNK):
            part = values[start : start + self._CHUNK].float()
            indices = self._index_chunk[: part.numel()].copy_(folded[start : start + self._CHUNK])
            even = part.numel() // rows * rows
            partial.scatter_add_(1, indices[:even].view(rows, -1), part[:even].view(rows, -1))
            if even < part.numel():
                partial[0].scatter_add_(0, indices[even:], part[even:])
        target.add_(partial.sum(0))

    def _folded(self, index: int, n: int, shard_of: torch.Tensor | None = None) -> torch.Tensor:
        """Parameter `index`'s coordinates (all n, or this rank's block of the DTensor
        `shard_of`; cached apart under key -1 - index) as buckets of a sketch of twice the
        dimension: bucket + dim where the sign is −1. Adding the gradient there and taking
        the first half minus the second is the CountSketch, without a multiply per coordinate."""
        key = index if shard_of is None else -1 - index
        hit = self._coordinates.get(key)
        if hit is not None and hit.numel() == n:
            return hit
        indices = shard_indices(shard_of) if shard_of is not None else None
        target, sign = countsketch_coordinates(self.sketch_seed, index, n, self.sketch_dim, self.device, indices)
        folded = target.add_((sign < 0).to(torch.int32), alpha=self.sketch_dim)
        # Kept (4 bytes a coordinate) while they fit the cache budget: hashing costs some
        # twenty integer passes, reading the cache one. Beyond it they are recomputed.
        if self._cached_bytes + 4 * n <= self._cache_bytes:
            self._coordinates[key] = folded
            self._cached_bytes += 4 * n
        return folded

    def _unfold(self, doubled: torch.Tensor) -> torch.Tensor:
        return doubled[: self.sketch_dim] - doubled[self.sketch_dim :]

    def warm_up_sketch(self) -> None:
        """Compiles the fused sketch off the training thread, for a run that will take sketches
        (so that its first sketch step does not wait for Triton)."""
        if self._fused is not None:
            sketch_kernel.warm_up(self._fused, self.device, {p.dtype for p in self._params}, self.sketch_dim)

    def _sketch_into(self, target: torch.Tensor, index: int, values: torch.Tensor, shard_of: torch.Tensor | None = None) -> None:
        """target (2·dim, folded) += the sketch of parameter `index`'s flat `values` (all its
        coordinates, or this rank's block of the DTensor `shard_of`): on a GPU with Triton one
        fused kernel (`sketch_kernel`), else the cached coordinates and `_accumulate`."""
        if self._fused is not None and values.is_cuda:
            base: int | None = 0
            indices = None
            if shard_of is not None:
                if index not in self._shard_bases:
                    self._shard_bases[index] = shard_base(shard_of)
                base = self._shard_bases[index]
                # A block that is not one range of the whole (rare: FSDP2 shards rows) hashes
                # its coordinates as the reference path does.
                indices = shard_indices(shard_of) if base is None else None
            self._fused(target, values, self.sketch_seed, index, self.sketch_dim, indices, base or 0)
            return
        self._accumulate(target, self._folded(index, values.numel(), shard_of), values)

    def _sketch_of(self, grads: list[tuple[int, torch.Tensor]], sharded: bool) -> torch.Tensor:
        """The CountSketch of gradients (index, tensor): whole ones, or DTensor shards placed
        at their coordinates in the whole parameter."""
        doubled = torch.zeros(2 * self.sketch_dim, dtype=torch.float32, device=self.device)
        for index, grad in grads:
            values = grad.to_local() if sharded else grad  # type: ignore[attr-defined]
            self._sketch_into(doubled, index, values.detach().reshape(-1), grad if sharded else None)
        return self._unfold(doubled)

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
            started = time.perf_counter()
            if self._fsdp is not None:
                self._close_sharded()
            elif self.error is None and not self._complete:
                self._close()
            self.elapsed += time.perf_counter() - started
        except Exception as e:  # noqa: BLE001 - a probe must never break the step
            self._fail(e)

    @property
    def ddp_wrapper(self) -> torch.nn.parallel.DistributedDataParallel | None:
        """The DDP wrapper whose all-reduce the probe reads around, once known."""
        return self._wrapper

    def _reduced(self) -> bool:
        if self._wrapper is None and self._find_wrapper_of is not None and dist.is_available() and dist.is_initialized():
            found = find_ddp_wrapper(self._find_wrapper_of)
            self._find_wrapper_of = None
            if found is not None:
                self._attach_wrapper(found)
                # Found after its forward: its own flag still says whether this backward synced.
                self._sync = bool(found.require_backward_grad_sync)
        return self._wrapper is not None and self._sync

    def _local_norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """‖g_k‖² and the number of gradient tensors holding a NaN/Inf, from the hooks' norms."""
        local = [n for n in self._norms if n is not None]
        norms = torch.stack(local) if local else torch.zeros(1, device=self.device)
        # A NaN/Inf anywhere in a gradient makes its norm NaN/Inf: count the tensors holding one.
        return norms.double().square().sum(), (~torch.isfinite(norms)).sum().double()

    def _local_sketch(self) -> torch.Tensor | None:
        return self._unfold(self._sketch_rows.sum(0)) if self.sketch_armed and self._sketch_rows is not None else None

    def _close_sharded(self) -> None:
        """End of a backward under FSDP2: the shard group's one all-reduce, then the record."""
        fsdp = self._fsdp
        assert fsdp is not None
        if not fsdp.reduces():
            return  # a no-sync micro-batch: nothing was reduced, on any rank
        measured = self.error is None and not self._complete
        self._complete = True
        dim = self.sketch_dim
        # [‖ḡ shard‖², sketch of the ḡ shard, 1 if this rank measured]: summed over the group.
        payload = torch.zeros(dim + 2, dtype=torch.float64, device=self.device)
        if measured:
            try:
                shards = [(i, p.grad) for i, p in enumerate(self._params) if p.grad is not None]
                if shards:
                    norms = torch._foreach_norm([g.to_local().detach() for _, g in shards], 2, dtype=torch.float32)  # type: ignore[attr-defined]
                    payload[0] = torch.stack(norms).double().square().sum()
                    if self.sketch_armed:
                        payload[1 : dim + 1] = self._sketch_of(shards, sharded=True)
                payload[dim + 1] = 1.0
            except Exception as e:  # noqa: BLE001 - the all-reduce below must happen regardless
                self._fail(e)
                measured = False
                payload.zero_()
        # Every rank reaches this line on every reducing backward: the collectives match.
        dist.all_reduce(payload, group=fsdp.process_group)
        if not measured:
            return
        # Every rank must have measured for the sums to mean anything; otherwise NaN, not a lie.
        complete = payload[dim + 1] == fsdp.size
        nan = torch.full((), float("nan"), dtype=torch.float64, device=self.device)
        local_sq, nonfinite = self._local_norms()
        mean_sq = torch.where(complete, payload[0], nan)
        own = self._local_sketch()
        dot = None
        if own is not None:
            dot = torch.where(complete, _sketch_dot(own, payload[1 : dim + 1], local_sq, mean_sq), nan)
        self._record = self._finish_record(local_sq, nonfinite, mean_sq, dot, own)

    def _close(self) -> None:
        self._complete = True
        local_sq, nonfinite = self._local_norms()
        mean_sq = dot = None
        if self._reduced():
            grads = [p.grad for p in self._params]
            present = [i for i, g in enumerate(grads) if g is not None]
            if present:
                norms = torch._foreach_norm([grads[i].detach() for i in present], 2, dtype=torch.float32)  # type: ignore[union-attr]
                mean_sq = torch.stack(norms).double().square().sum()
            else:
                mean_sq = torch.zeros((), dtype=torch.float64, device=self.device)
            if self.dot_mode and any(c is not None for c in self._copies):
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
            own = self._local_sketch()
            if self.sketch_cosine and own is not None:
                mean_sketch = self._sketch_of([(i, grads[i]) for i in present], sharded=False)  # type: ignore[misc]
                dot = _sketch_dot(own, mean_sketch, local_sq, mean_sq)
        self._copies = [None] * len(self._params)
        self._record = self._finish_record(local_sq, nonfinite, mean_sq, dot, self._local_sketch())

    def _finish_record(
        self,
        local_sq: torch.Tensor,
        nonfinite: torch.Tensor,
        mean_sq: torch.Tensor | None,
        dot: torch.Tensor | None,
        sketch: torch.Tensor | None,
    ) -> GradientRecord:
        """The record, unscaled by the loss scaler where there is one."""
        skipped = None
        # The scaler whose scale() ran since the last record scaled this backward's loss; none
        # ran: the loss was not scaled through a GradScaler (unless the one given was used
        # some other way, which is the user's word).
        seen, self._scaled_by = self._scaled_by, None
        scaler = None if seen is _UNSCALED else seen if seen is not None else self._scaler_given
        if scaler is not None and scaling.enabled(scaler):
            scale = getattr(scaler, "_scale", None)
            if isinstance(scale, torch.Tensor):
                inv_sq = scale.double().reciprocal().square().to(self.device).reshape(())
                local_sq = local_sq * inv_sq
                mean_sq = mean_sq * inv_sq if mean_sq is not None else None
                dot = dot * inv_sq if dot is not None else None
            # The scaler checks the gradient its optimizer sees: the reduced one when reduced.
            checked = mean_sq if mean_sq is not None else local_sq
            skipped = (~torch.isfinite(checked)).double()
            nonfinite = torch.zeros_like(nonfinite)
        return GradientRecord(local_sq, nonfinite, mean_sq, dot, skipped, sketch)

    def saw_scale(self, scaler: Any, outputs: Any, result: Any) -> None:
        """`scaling.listen`'s listener: the scaler that scaled the loss is the one to unscale by."""
        if not scaling.enabled(scaler):
            self._scaled_by = _UNSCALED  # this loss went through a scaler that scales nothing
            return
        self._scaled_by = scaler
        given = self._scaler_given
        if given is not None and scaler is not given and self.scaler_note is None:
            self.scaler_note = (
                f"rankwatch: the loss was scaled by {type(scaler).__name__} at {id(scaler):#x}, not by the "
                f"{type(given).__name__} given to watch(scaler=); gradient norms are unscaled by the one that scaled the loss"
            )

    def take(self) -> GradientRecord | None:
        """The record of the last backward, once; None when no backward finished since."""
        record, self._record = self._record, None
        return record

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self._copies = [None] * len(self._params)


def _sketch_dot(own: torch.Tensor, mean: torch.Tensor, local_sq: torch.Tensor, mean_sq: torch.Tensor) -> torch.Tensor:
    """⟨g_k, ḡ⟩ estimated as cos(sketch of g_k, sketch of ḡ) · ‖g_k‖ · ‖ḡ‖, so that the run's
    cos_to_mean = dot / (‖g_k‖ ‖ḡ‖) is the cosine of the sketches."""
    own, mean = own.double(), mean.double()
    cosine: torch.Tensor = torch.dot(own, mean) / (torch.linalg.vector_norm(own) * torch.linalg.vector_norm(mean)).clamp_min(1e-300)
    return cosine * (local_sq * mean_sq).sqrt()

