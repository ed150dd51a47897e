"""Who this process is in the job: rank, world size, the run's one name, its data-parallel group.

Rank and world size come from `torch.distributed` when it is initialised (the only source that
is right under every launcher), then from the launchers' environments: torchrun's `RANK` /
`WORLD_SIZE`, Slurm's `SLURM_PROCID` / `SLURM_NTASKS`, Open MPI's `OMPI_COMM_WORLD_RANK` /
`OMPI_COMM_WORLD_SIZE`.

Every rank must report under the same run name. In order: the name given to `init`,
`RANKWATCH_RUN`, `TORCHELASTIC_RUN_ID` (unless torchrun's default `none`), `SLURM_JOB_ID`
(plus the step id when there is one). Otherwise the name is made up on rank 0 and handed to the
other ranks through the process group's key-value store — a store read, not a collective, so it
adds nothing to the job's sequence of collectives and cannot hang a rank that never calls
`init`. Without an initialised process group there is no way to agree: each rank makes its own
name and the run is told so.

The statistics across workers compare data-parallel replicas. When the data-parallel group is a
proper subgroup of the world (DDP over a subgroup: hybrid data × tensor/pipeline parallelism,
or several independent replica groups), each group becomes a run of its own, named
`<run>.dp<lowest global rank of the group>`, whose ranks are the ranks within the group.
"""

from __future__ import annotations

import itertools
import os
import re
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed import ProcessGroup

_RUN_ID = re.compile(r"[^A-Za-z0-9._-]+")
_RANK_VARIABLES = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
_agreements = itertools.count()


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"rankwatch.init: environment variable {name}={raw!r} is not an integer") from None


def _distributed() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a requirement of watching
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of this process, from torch.distributed or the launcher."""
    dist = _distributed()
    if dist is not None:
        return dist.get_rank(), dist.get_world_size()
    for rank_var, world_var in _RANK_VARIABLES:
        rank = _env_int(rank_var)
        if rank is not None:
            return rank, _env_int(world_var) or 1
    return 0, 1


def local_rank() -> int:
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        value = _env_int(name)
        if value is not None:
            return value
    return 0


def clean_run_id(candidate: str) -> str:
    cleaned = _RUN_ID.sub("-", candidate).strip(".-")[:128]
    if not cleaned:
        raise ValueError(f"rankwatch.init: run name {candidate!r} has no usable characters ([A-Za-z0-9._-])")
    return cleaned


def launcher_run_name() -> str | None:
    """A name every rank of the job sees alike in its environment, if the launcher gave one."""
    explicit = os.environ.get("RANKWATCH_RUN")
    if explicit:
        return explicit
    elastic = os.environ.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        return elastic
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm-{job}" + (f".{step}" if step else "")
    return None


def agree_run_name(rank: int, world: int, timeout_s: float = 60.0) -> str:
    """A made-up name, the same on every rank when a process group is there to agree on it."""
    mine = time.strftime("run-%Y%m%d-%H%M%S")
    if world <= 1:
        return mine
    dist = _distributed()
    if dist is None:
        warnings.warn(
            f"rankwatch: {world} ranks but no run name and no initialised process group to agree on one; "
            "each rank names its own run. Pass run=..., set RANKWATCH_RUN, or call init after init_process_group.",
            stacklevel=3,
        )
        return mine
    key = f"rankwatch/run-name/{next(_agreements)}"
    try:
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            store.set(key, mine)
            return mine
        store.wait([key], timedelta(seconds=timeout_s))
        return bytes(store.get(key)).decode()
    except Exception as e:  # noqa: BLE001 - a missing agreement must not stop training
        warnings.warn(f"rankwatch: could not agree on a run name with rank 0 ({e}); this rank reports as {mine!r}", stacklevel=3)
        return mine


@dataclass(frozen=True)
class ReplicaGroup:
    """This process's data-parallel group: global ranks, in order."""

    ranks: tuple[int, ...]

    @classmethod
    def of(cls, group: ProcessGroup | Sequence[int] | None) -> ReplicaGroup | None:
        """From a ProcessGroup (None: the world) or a sequence of global ranks."""
        if isinstance(group, (list, tuple)):
            return cls(tuple(sorted(int(r) for r in group)))
        dist = _distributed()
        if dist is None:
            return None
        return cls(tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD))))

    def run_suffix(self, world: int) -> str:
        return "" if len(self.ranks) == world else f".dp{self.ranks[0]}"

    def rank_of(self, global_rank: int) -> int:
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"rankwatch: rank {global_rank} is not in its data-parallel group {list(self.ranks)}") from None
