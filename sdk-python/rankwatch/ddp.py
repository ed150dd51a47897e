"""DDP consistency probes: each rank's gradient *before* the all-reduce averages it away.

`install(ddp_model, ...)` registers a communication hook that wraps DDP's default all-reduce.
For every gradient bucket it adds, on the bucket's device and without any host sync:

* ‖g_k‖² of the local bucket before reduction (→ ``grad_norm``, this rank's ‖g_k‖),
* ‖ḡ‖² of the reduced bucket after it (→ ``grad_norm_mean``, identical on every rank),
* optionally ⟨g_k, ḡ⟩ ("dot mode": the bucket is cloned before the reduce, costing one
  bucket-sized copy) → ``cos_to_mean`` = ⟨g_k, ḡ⟩ / (‖g_k‖‖ḡ‖), exact,
* the NaN/Inf count of the local gradient (→ part of ``nonfinite``),
* on sketch steps, the CountSketch of the local gradient with a seed shared by all ranks, as
  defined in the analytics crate (`math::sketch`): coordinate i of bucket b is the 64-bit index
  (b << 32) | i, hashed with murmur3's finaliser, so every rank maps every coordinate to the same
  bucket and sign and ⟨s_i, s_j⟩ estimates ⟨g_i, g_j⟩.

Because DDP's default hook divides the bucket by the world size *in place* before reducing,
the local statistics are taken first. The sums accumulate over buckets into small device
tensors; the run's reporter snapshots and zeroes them once per logged step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


def countsketch_coordinates(seed: int, bucket_index: int, n: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Output bucket and sign of coordinates 0..n of gradient bucket `bucket_index`."""
    key = _fmix32((seed ^ 0x9E3779B9) & _MASK32)
    lo = torch.arange(n, device=device, dtype=torch.int64)
    hi = bucket_index & _MASK32
    h = _fmix32(((_fmix32(lo ^ key) ^ hi) + key) & _MASK32)
    target = (h & 0x7FFFFFFF) % dim
    sign = 1.0 - 2.0 * (h >= 0x80000000).to(torch.float32)
    return target, sign


@dataclass
class GradientState:
    """Device accumulators for one step, shared by the hook and the run's reporter."""

    device: torch.device
    dot_mode: bool = True
    sketch_dim: int = 1024
    sketch_seed: int = 0
    cache_limit: int = 50_000_000
    local_sq: torch.Tensor = field(init=False)
    mean_sq: torch.Tensor = field(init=False)
    dot: torch.Tensor = field(init=False)
    nonfinite: torch.Tensor = field(init=False)
    sketch: torch.Tensor = field(init=False)
    sketch_due: bool = False
    steps_seen: int = 0
    _coordinates: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        z = lambda: torch.zeros((), dtype=torch.float64, device=self.device)  # noqa: E731
        self.local_sq, self.mean_sq, self.dot, self.nonfinite = z(), z(), z(), z()
        self.sketch = torch.zeros(self.sketch_dim, dtype=torch.float32, device=self.device)

    def reset(self) -> None:
        for t in (self.local_sq, self.mean_sq, self.dot, self.nonfinite, self.sketch):
            t.zero_()
        self.steps_seen = 0

    def _coords(self, bucket_index: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (bucket_index, n)
        hit = self._coordinates.get(key)
        if hit is not None:
            return hit
        coords = countsketch_coordinates(self.sketch_seed, bucket_index, n, self.sketch_dim, self.device)
        # Cache the hashes for models small enough that it pays (DDP keeps buckets fixed after
        # its first step); large models recompute them on each sketch step instead.
        cached = sum(k[1] for k in self._coordinates) + n
        if cached <= self.cache_limit:
            self._coordinates[key] = coords
        return coords

    def add_local(self, bucket_index: int, grad: torch.Tensor) -> torch.Tensor | None:
        g = grad.detach()
        g32 = g.float()
        self.local_sq += g32.pow(2).sum(dtype=torch.float64)
        self.nonfinite += (~torch.isfinite(g)).sum()
        if self.sketch_due:
            target, sign = self._coords(bucket_index, g.numel())
            self.sketch.index_add_(0, target, g32.reshape(-1) * sign)
        return g.clone() if self.dot_mode else None

    def add_reduced(self, reduced: torch.Tensor, local: torch.Tensor | None) -> None:
        r32 = reduced.detach().float()
        self.mean_sq += r32.pow(2).sum(dtype=torch.float64)
        if local is not None:
            self.dot += (local.float() * r32).sum(dtype=torch.float64)
        self.steps_seen += 1


def _hook(state, bucket):  # type: ignore[no-untyped-def]
    # Unannotated on purpose: DDP compares the annotations with dist.GradBucket at
    # registration, and postponed (string) annotations would never match.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    local = state.add_local(bucket.index(), bucket.buffer())
    future = default_hooks.allreduce_hook(None, bucket)

    def after(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        reduced = fut.value()
        reduced = reduced[0] if isinstance(reduced, list) else reduced
        state.add_reduced(reduced, local)
        return reduced

    return future.then(after)


def install(ddp_model: torch.nn.parallel.DistributedDataParallel, *, dot_mode: bool = True, sketch_dim: int = 1024, sketch_seed: int = 0) -> GradientState:
    """Registers the consistency hook on `ddp_model` (before its first backward)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("rankwatch: the DDP probe needs an initialised torch.distributed process group")
    device = next(ddp_model.parameters()).device
    state = GradientState(device=device, dot_mode=dot_mode, sketch_dim=sketch_dim, sketch_seed=sketch_seed)
    ddp_model.register_comm_hook(state, _hook)
    return state
