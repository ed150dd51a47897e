"""Every question the probes ask about how a model is spread over ranks: which wrapper holds
it (DDP, found even when a framework hands over the inner module), whether FSDP2 manages it
and how its parameters are grouped, where this rank's block of a DTensor lies, which ranks
hold the same shards (HSDP's replicate dimension), and which layouts are refused (FSDP1,
DeepSpeed ZeRO, tensor-parallel gradients) with what message.

It sits below the probes (`gradients`, `run`) and imports neither.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .layout import is_dtensor


def find_ddp_wrapper(module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DistributedDataParallel that wraps `module`, if one exists (frameworks such as the
    Hugging Face Trainer hand callbacks the inner module and keep the wrapper to themselves).

    DDP keeps the module in its `_modules` dict, which its instance dict holds: the wrapper is
    found through at most those two dicts among the module's referrers (a one-off walk, at
    the end of the first backward)."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return module
    found = find_wrapper(module, lambda holder: isinstance(holder, torch.nn.parallel.DistributedDataParallel))
    return found if isinstance(found, torch.nn.parallel.DistributedDataParallel) else None


def find_wrapper(module: torch.nn.Module, is_wrapper: Callable[[object], bool]) -> object | None:
    """An object satisfying `is_wrapper` whose `.module` is `module`, found through at most
    three dicts among the module's referrers (a wrapper's instance dict and its `_modules`)."""
    frontier: list[Any] = [module]
    seen = {id(module)}
    holder: object
    for _ in range(3):
        holders: list[Any] = []
        for obj in frontier:
            for holder in gc.get_referrers(obj):
                if not isinstance(holder, dict) and is_wrapper(holder) and getattr(holder, "module", None) is module:
                    return holder
                if isinstance(holder, dict) and id(holder) not in seen:
                    seen.add(id(holder))
                    holders.append(holder)
        frontier = holders
    return None


def is_fsdp2(model: torch.nn.Module) -> bool:
    """Whether `fully_shard` (FSDP2) manages any part of `model`."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


class FsdpLayout:
    """What the gradient probe needs of a model under FSDP2: for each sharded parameter, FSDP's
    record of it (whose unsharded parameter receives the local gradient) and its group (whose
    `reduce_grads` says whether this backward reduces), and the shard group to sum over."""

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter]) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.groups: list[Any] = []
        owner: dict[int, tuple[Any, Any]] = {}
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None or any(g is group for g in self.groups):
                continue
            self.groups.append(group)
            for fsdp_param in group.fsdp_params:
                owner[id(fsdp_param.sharded_param)] = (fsdp_param, group)
        # Trainable ones only, in the model's order: the probe's slots index this list.
        self.params = [p for p in params if id(p) in owner and p.requires_grad]
        self.entries = [owner[id(p)] for p in self.params]
        if not self.entries:
            raise ValueError("rankwatch.watch: FSDP2 manages none of the model's trainable parameters")
        for fsdp_param, _ in self.entries:
            if getattr(fsdp_param, "_unsharded_dtensor_spec", None) is not None:
                raise ValueError(
                    "rankwatch.watch: this FSDP2 model is also tensor-parallel (its parameters are DTensors inside FSDP); the "
                    "gradient probe measures data-parallel replicas only (DistributedDataParallel, FSDP2 over a 1-D or HSDP mesh). "
                    "Pass every={'grad': 0} to rankwatch.init to watch its spectral norms and activations."
                )
        groups = {id(g.mesh_info.shard_process_group): g.mesh_info.shard_process_group for g in self.groups}
        if len(groups) != 1:
            raise ValueError("rankwatch.watch: the model's FSDP2 modules shard over different process groups; the gradient probe needs one")
        self.process_group = next(iter(groups.values()))
        self.size = dist.get_world_size(self.process_group)

    def reduces(self) -> bool:
        """Whether the backward under way ends in FSDP's reduce-scatter (not a no-sync micro-batch)."""
        return any(g.reduce_grads for g in self.groups)


def shard_indices(tensor: torch.Tensor) -> torch.Tensor | None:
    """The flat coordinates, in the whole tensor, of this rank's block of DTensor `tensor`
    (None for a plain tensor: all of it)."""
    if not is_dtensor(tensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(tensor.shape)
    local_shape, offset = compute_local_shape_and_global_offset(shape, tensor.device_mesh, tensor.placements)
    device = tensor.to_local().device
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, (start, length) in enumerate(zip(offset, local_shape, strict=True)):
        axis = torch.arange(start, start + length, dtype=torch.int64, device=device) * strides[d]
        index = index.unsqueeze(-1) + axis
    return index.reshape(-1)


def shard_base(tensor: torch.Tensor) -> int | None:
    """Where this rank's block of DTensor `tensor` starts in the whole, flat, when the block is
    one contiguous range of it (a block of rows, as FSDP2's dim-0 sharding makes); else None."""
    if not is_dtensor(tensor):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape = tuple(tensor.shape)
    local_shape, offset = compute_local_shape_and_global_offset(shape, tensor.device_mesh, tensor.placements)
    if not shape:
        return 0
    if tuple(local_shape[1:]) != shape[1:]:
        return None
    return int(offset[0]) * math.prod(shape[1:])


def replica_set(params: list[torch.nn.Parameter]) -> int | str:
    """For sharded (DTensor) parameters: this rank's replica set — the ranks that agree with it
    on every mesh coordinate but the replicated ones hold the same shards (HSDP: the same shard
    index, any replica index) — or why there is none.
    Every parameter must be a DTensor on one mesh, replicated along the same mesh dimensions."""
    sharded = [p for p in params if is_dtensor(p)]
    if not sharded or len(sharded) != len(params):
        return "off: the model mixes sharded and plain parameters (only a mesh's replicas are compared)"
    mesh = sharded[0].device_mesh
    kinds = {tuple(type(placement).__name__ == "Replicate" for placement in p.placements) for p in sharded}
    if any(p.device_mesh != mesh for p in sharded) or len(kinds) != 1:
        return "off: the parameters are spread over the mesh in more than one way (no single replica set to compare)"
    replicated = kinds.pop()
    if not any(replicated):
        return "off: sharded parameters (FSDP2 without a replicate dimension, tensor parallel) have no replica in this run"
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return "off: this rank is not in the parameters' device mesh"
    shape = tuple(mesh.shape)
    index, replicas = 0, 1
    for dim, size in enumerate(shape):
        if replicated[dim]:
            replicas *= size
        else:
            index = index * size + coordinate[dim]
    if replicas < 2:
        return "off: the replicate dimension of the mesh has one rank (no replica to compare)"
    return index


_SUPPORTED = (
    "rankwatch measures gradients under DistributedDataParallel and FSDP2 (torch.distributed.fsdp.fully_shard, 1-D or HSDP "
    "mesh), and spectral norms of plain, FSDP2-sharded and tensor-parallel (DTensor) weights"
)
_PROBES_OFF = "pass every={'grad': 0, 'spectral': 0} to rankwatch.init to watch its activations and token cosine"


def check_sharding(given: torch.nn.Module, model: torch.nn.Module, params: list[torch.nn.Parameter], *, grad: bool, spectral: bool) -> Any:
    """Refuses layouts whose gradients or weights the probes would misread, with a message
    naming what is supported; returns the FSDP2 layout the gradient probe needs, if any.

    FSDP1 flattens every weight of a unit into one flat parameter; DeepSpeed ZeRO partitions
    parameters and reduces gradients in hooks of its own: the probes would read shards as
    wholes, so they are refused rather than wrong. Tensor-parallel DTensor gradients are shards
    of one replica's gradient; the spectral probe measures DTensor weights exactly."""
    if not (grad or spectral):
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        FullyShardedDataParallel = ()  # type: ignore[assignment,misc]
    modules = [given, *model.modules()]
    if any(isinstance(m, FullyShardedDataParallel) for m in modules):
        raise ValueError(
            f"rankwatch.watch: this model is wrapped in FSDP1 (FullyShardedDataParallel), whose flat parameters hide each weight and "
            f"each rank's gradient; {_SUPPORTED}. Move to fully_shard, or {_PROBES_OFF}."
        )
    if any(is_deepspeed(m) for m in modules) or any(hasattr(p, "ds_id") for p in params) or find_wrapper(model, is_deepspeed) is not None:
        raise ValueError(
            f"rankwatch.watch: this model runs under DeepSpeed, whose ZeRO stages partition parameters and reduce gradients in "
            f"hooks of their own; {_SUPPORTED}. To watch it anyway, {_PROBES_OFF}."
        )
    if is_fsdp2(model):
        return FsdpLayout(model, params) if grad else None
    if grad and any(is_dtensor(p) for p in params):
        raise ValueError(
            "rankwatch.watch: this model's parameters are DTensors (tensor parallelism): each rank's gradient is a shard of one "
            f"replica's gradient, not a replica's gradient; {_SUPPORTED}. Pass every={{'grad': 0}} to rankwatch.init to watch "
            "its spectral norms and activations."
        )
    return None


def is_deepspeed(module: Any) -> bool:
    """Whether `module` is (or derives from) DeepSpeed's engine."""
    return any(cls.__name__ == "DeepSpeedEngine" for cls in type(module).__mro__)
