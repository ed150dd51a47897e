"""Rank, world size and one run name, from torch.distributed first and then each launcher."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import rankwatch
from rankwatch import topology

from conftest import run_ranks

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "TORCHELASTIC_RUN_ID", "RANKWATCH_RUN")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("env", "rank", "world", "local", "run"),
    [
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "job-9"}, 3, 4, 1, "job-9"),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "4411", "SLURM_STEP_ID": "0"}, 5, 8, 1, "slurm-4411.0"),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "2", "RANKWATCH_RUN": "mpi-run"}, 2, 3, 2, "mpi-run"),
    ],
)
def test_each_launcher_gives_rank_world_and_a_shared_name(clean_env: pytest.MonkeyPatch, env: dict[str, str], rank: int, world: int, local: int, run: str, tmp_path: Path) -> None:
    for k, v in env.items():
        clean_env.setenv(k, v)
    r = rankwatch.init(mode="offline", spool_dir=tmp_path)
    assert (r.rank, r.world_size, r.local_rank, r.id) == (rank, world, local, run)
    r.finish()


def test_a_bad_launcher_variable_is_named(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SLURM_PROCID", "zero")
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        rankwatch.init(mode="offline")


def test_torchrun_default_run_id_is_not_a_name_and_ranks_agree_through_the_store(tmp_path: Path) -> None:
    """torchrun sets TORCHELASTIC_RUN_ID=none; the made-up name must still be one per job, and
    rank and world come from the process group even when the environment says otherwise."""
    script = (
        "import os, sys, time, torch.distributed as dist\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "dist.init_process_group('gloo')\n"
        "import rankwatch\n"
        "os.environ['RANK'] = '7'  # stale or wrong environment: the process group wins\n"
        "if dist.get_rank() == 0: time.sleep(1.5)  # rank 1 asks before rank 0 named the run\n"
        "r = rankwatch.init(mode='offline', spool_dir=sys.argv[2])\n"
        "print(r.id, r.rank, r.world_size, flush=True)\n"
        "r.finish(); dist.barrier(); dist.destroy_process_group()\n"
    )
    sdk = str(Path(__file__).resolve().parent.parent)
    outputs = [out.split() for out in run_ranks([sys.executable, "-c", script, sdk, str(tmp_path)], 2, timeout=120, env={"TORCHELASTIC_RUN_ID": "none"})]
    assert outputs[0][0] == outputs[1][0] and outputs[0][0].startswith("run-"), outputs
    assert [o[1:] for o in outputs] == [["0", "2"], ["1", "2"]]


def test_replica_groups_name_their_runs() -> None:
    group = topology.ReplicaGroup.of([3, 1])
    assert group is not None
    assert group.ranks == (1, 3) and group.run_suffix(4) == ".dp1" and group.rank_of(3) == 1
    assert topology.ReplicaGroup.of([0, 1, 2, 3]).run_suffix(4) == ""  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="not in its data-parallel group"):
        group.rank_of(0)


def test_an_explicit_data_parallel_group_makes_the_run_that_groups(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    r = rankwatch.init(run="hybrid", rank=3, world_size=4, data_parallel_group=[2, 3], mode="offline", spool_dir=tmp_path)
    assert (r.id, r.rank, r.world_size, r.global_rank) == ("hybrid.dp2", 1, 2, 3)
    assert r.tags["global_ranks"] == "2,3"
    r.log(0, loss=1.0)
    r.finish()
    assert (tmp_path / "hybrid.dp2" / "rank-1").is_dir(), "the group's run spools under its own name and rank"
