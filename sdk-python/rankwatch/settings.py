"""`rankwatch.init`: the settings a run starts from, read from its arguments and the
environment, and the run they make.

Rank and world size come from `torch.distributed` or the launcher's environment
(`topology.py`); the run's name from the argument, the launcher, or one agreed by every rank;
the collector and spool from the arguments or `RANKWATCH_*` (`offline.py`). Mistakes in these
raise here, before training starts: that is configuration, not monitoring trouble. What `init`
returns is a `Run` (`run.py`), or for `mode="disabled"` a `NoopRun` that reports nothing and
agrees nothing with the other ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .cadence import Cadence
from .offline import Mode, collector_url, parse_mode, spool_root
from .run import NoopRun, Run
from .topology import ReplicaGroup, agree_run_name, clean_run_id, launcher_run_name, local_rank, rank_and_world

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch.distributed import ProcessGroup


def init(
    run: str | None = None,
    collector: str | None = None,
    *,
    mode: Mode | None = None,
    every: int | Mapping[str, int] | Cadence | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    token: str | None = None,
    tags: Mapping[str, object] | None = None,
    dot_mode: bool = True,
    sketch_dim: int = 1024,
    data_parallel_group: ProcessGroup | Sequence[int] | None = None,
) -> Run:
    """Starts monitoring this process's rank of a training run.

    Rank and world size come from `torch.distributed` when it is initialised, else from the
    launcher's environment (torchrun's `RANK`/`WORLD_SIZE`, Slurm's `SLURM_PROCID`/
    `SLURM_NTASKS`, Open MPI's). Without `run`, the name is `RANKWATCH_RUN`,
    `TORCHELASTIC_RUN_ID` (unless `none`) or `SLURM_JOB_ID`, else one made on rank 0 and shared
    with every rank through the process group's store. `data_parallel_group` (a ProcessGroup or
    a list of global ranks) says which ranks are replicas of each other when that is not the
    whole world; `watch` also learns it from a DistributedDataParallel wrapper. `mode` is
    "online" (stream to `collector`, spooling to disk while it is away), "offline" (spool only;
    send later with `rankwatch.sync`) or "disabled" (every call is a no-op). Settings also come
    from `RANKWATCH_COLLECTOR`, `RANKWATCH_MODE`, `RANKWATCH_RUN`, `RANKWATCH_INGEST_TOKEN` and
    `RANKWATCH_SPOOL_DIR`. `dot_mode` measures each rank's exact cosine to the averaged
    gradient at the cost of one copy of the gradient during the backward pass.
    """
    mode = parse_mode(mode or os.environ.get("RANKWATCH_MODE", "online"))
    found_rank, found_world = rank_and_world()
    rank = found_rank if rank is None else rank
    world_size = found_world if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rankwatch.init: rank {rank} is not within world size {world_size}")
    named = run or launcher_run_name()
    collector = collector_url(collector)
    if sketch_dim < 1:
        raise ValueError("rankwatch.init: sketch_dim must be at least 1")
    cadence = Cadence.parse(every)
    replica_group = ReplicaGroup.of(data_parallel_group) if data_parallel_group is not None else None
    if mode == "disabled":
        # Nothing is reported, so nothing is agreed with the other ranks or checked for sending.
        return NoopRun(
            clean_run_id(named) if named else "disabled",
            rank=rank,
            world_size=world_size,
            local_rank=local_rank(),
            collector=collector,
            cadence=cadence,
            tags=tags or {},
            dot_mode=dot_mode,
            sketch_dim=sketch_dim,
            replica_group=replica_group,
        )
    run_id = clean_run_id(named) if named else agree_run_name(rank, world_size)
    if not collector.startswith("http://"):
        raise ValueError(f"rankwatch.init: collector must be an http:// URL, got {collector!r}")
    spool = spool_root(spool_dir)
    return Run(
        run_id,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank(),
        collector=collector,
        mode=mode,
        cadence=cadence,
        spool_dir=spool,
        token=token or os.environ.get("RANKWATCH_INGEST_TOKEN"),
        tags=tags or {},
        dot_mode=dot_mode,
        sketch_dim=sketch_dim,
        replica_group=replica_group,
    )
