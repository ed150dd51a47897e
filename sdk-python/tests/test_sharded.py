"""Sharded models: FSDP2 (1-D and HSDP), gradient accumulation under FSDP2, tensor parallelism,
and the layouts that are refused (FSDP1, DeepSpeed).

Each layout runs as 4 gloo processes (`sharded_worker.py`). What must hold:

* Twins: the watched job ends with parameters bit-identical to the unwatched one's — the FSDP2
  gradient probe's all-reduce and the sharded spectral probe's collectives only read.
* Gradient statistics against a brute-force recomputation (a plain copy with the gathered
  weights, each rank's local gradient gathered in float64): ‖g_k‖ and ‖ḡ‖ to relative 1e-5
  (float32 reduce-scatter order); cos_to_mean, which under FSDP2 is the cosine of two
  CountSketches, equal to the brute-force cosine of the same sketches to 1e-5 (this checks that
  the shards' sketches, placed by their global coordinates, add up to the sketch of ḡ), and to
  the exact cosine within 0.1 — five standard errors at sketch_dim 4096 (√(1 + cos²)/64 ≤ 0.022).
* Spectral norms of sharded weights: a fresh 300-iteration call on the sharded model against
  torch.linalg.matrix_norm(ord=2) of the gathered matrices, relative 1e-4 (measured ≤ 2e-7);
  every layer reported by exactly one rank; the run's own last values (2 warm iterations per
  step while lr 0.5 moves the weights) within 25 %.
* Replica fingerprints (every step): under HSDP each rank digests its shards and declares its
  replica set (the ranks holding the same shards: rank % 2 on the 2×2 mesh); the digests agree
  within each set at every step and differ between sets; with no replicate dimension (1-D
  FSDP2) the probe is off and the run's tags say why.
* Refusals name what is supported.

A hang is a failure: every process has a deadline.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import run_ranks

WORLD = 4
DEADLINE_S = 240
WORKER = Path(__file__).with_name("sharded_worker.py")


def run_layout(layout: str, out: Path, world: int = WORLD) -> list[dict[str, Any]]:
    run_ranks([sys.executable, str(WORKER), layout, str(out)], world, DEADLINE_S)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def check_spectral(ranks: list[dict[str, Any]], layers: int = 2) -> None:
    reference = ranks[0]["spectral"]["reference"]
    assert all(r["spectral"]["collective"] for r in ranks), "sharded weights make the spectral probe collective"
    owners: dict[int, list[int]] = {}
    for rank, result in enumerate(ranks):
        fresh = result["spectral"]["fresh"]
        for key, value in fresh.items():
            if key in reference:
                assert math.isclose(value, reference[key], rel_tol=1e-4), f"rank {rank} {key}: {value} != {reference[key]}"
        for layer in {int(k.split("/")[1]) for k in fresh}:
            owners.setdefault(layer, []).append(rank)
        last = result["reported"][-1]["values"]
        for key, value in last.items():
            if key in reference:
                assert math.isclose(value, reference[key], rel_tol=0.25), f"rank {rank} reported {key} {value}, weights say {reference[key]}"
        assert last.get("probe_ms.spectral/None/None", 0) > 0, "each rank reports what its spectral calls cost"
    assert owners == {layer: [layer % WORLD] for layer in range(layers)}, f"each layer is reported by one rank: {owners}"
    for rank, result in enumerate(ranks):
        for key, value in result["spectral"]["estimate"].items():
            want = result["spectral"]["estimate_plain"][key]
            assert math.isclose(value, want, rel_tol=1e-4), f"rank {rank} {key}: sharded estimate {value} != {want} on the gathered weights"
    assert {k for r in ranks for k in r["spectral"]["estimate"]} == {f"effective_rank/{layer}" for layer in range(layers)}
    measured = {k for r in ranks for k in r["spectral"]["fresh"] if k.startswith("effective_rank/")}
    assert measured == {f"effective_rank/{layer}/None" for layer in range(layers)}, f"the effective rank of every layer, from the sharded weights: {measured}"


@pytest.mark.parametrize("layout", ["fsdp2", "fsdp2_accumulation", "hsdp"])
def test_fsdp2_twins_statistics_and_sharded_spectral(layout: str, tmp_path: Path) -> None:
    ranks = run_layout(layout, tmp_path)
    for rank, result in enumerate(ranks):
        unequal = [name for name, same in result["equal"].items() if not same]
        assert not unequal, f"{layout} rank {rank}: watching changed {unequal}"
        # FSDP2 shards rows: every block is a contiguous range, the one its coordinates say.
        bases = result["shard_bases"]
        assert bases and all(v is True for v in bases.values()), f"{layout} rank {rank}: {bases}"
        reported = {r["step"]: r["values"] for r in result["reported"]}
        assert len(result["expected"]) == len(reported) == 5
        for want in result["expected"]:
            got = reported[want["step"]]
            where = f"{layout} rank {rank} step {want['step']}"
            assert got["nonfinite/None/None"] == 0
            for name in ("grad_norm", "grad_norm_mean"):
                assert math.isclose(got[f"{name}/None/None"], want[name], rel_tol=1e-5), f"{where} {name}: {got[f'{name}/None/None']} != {want[name]}"
            cosine = got["cos_to_mean/None/None"]
            assert math.isclose(cosine, want["sketch_cosine"], rel_tol=1e-5, abs_tol=1e-6), f"{where}: sketch cosine {cosine} != {want['sketch_cosine']}"
            assert abs(cosine - want["cos_to_mean"]) < 0.1, f"{where}: estimate {cosine} vs exact {want['cos_to_mean']}"
            assert got["probe_ms.grad/None/None"] > 0
    check_replica_fingerprints(layout, ranks)
    check_spectral(ranks)


def check_replica_fingerprints(layout: str, ranks: list[dict[str, Any]]) -> None:
    if layout != "hsdp":
        assert all("param_fingerprint/None/None" not in r["values"] for rank in ranks for r in rank["reported"])
        assert ranks[0]["tags"]["replica_fingerprint"].startswith("off: sharded parameters (FSDP2 without a replicate dimension"), ranks[0]["tags"]
        return
    for step in range(5):
        values = [rank["reported"][step]["values"] for rank in ranks]
        assert [v["replica_set/None/None"] for v in values] == [0, 1, 0, 1], values
        digests = [(v["param_fingerprint/None/None"], v["param_locator/None/None"]) for v in values]
        assert digests[0] == digests[2] and digests[1] == digests[3], f"step {step}: replicas of one shard agree: {digests}"
        assert digests[0] != digests[1], f"step {step}: different shards differ: {digests}"
    # The optimizer state (SGD's momentum, sharded as the weights are) at step 0: the same.
    state = [rank["reported"][0]["values"]["optim_fingerprint/None/None"] for rank in ranks]
    assert state[0] == state[2] and state[1] == state[3] and state[0] != state[1], state
    names = json.loads(ranks[0]["tags"]["replica_fingerprint_tensors"])
    assert "transformer.h.0.mlp.c_fc.weight" in names and all(r["tags"]["replica_fingerprint_tensors"] == ranks[0]["tags"]["replica_fingerprint_tensors"] for r in ranks)


def test_a_failing_fsdp2_probe_on_one_rank_neither_hangs_nor_lies(tmp_path: Path) -> None:
    ranks = run_layout("fsdp2_failure", tmp_path)
    for rank, result in enumerate(ranks):
        assert all(result["equal"].values()), f"rank {rank}: watching changed training"
        by_step = {r["step"]: r["values"] for r in result["reported"]}
        assert sorted(by_step) == [0, 1, 2, 3, 4]
        for step, values in by_step.items():
            mean = values.get("grad_norm_mean/None/None")
            if step < 2:
                assert mean is not None and math.isfinite(mean)
            elif rank == 1:
                assert "grad_norm/None/None" not in values, "the failed probe reports nothing"
            else:
                assert mean is not None and math.isnan(mean), f"rank {rank} step {step}: a sum missing rank 1 must not look valid ({mean})"
                assert math.isfinite(values["grad_norm/None/None"]), "the rank's own norm is still exact"


def test_tensor_parallel_spectral_is_exact_and_gradients_are_refused(tmp_path: Path) -> None:
    ranks = run_layout("tp", tmp_path)
    for rank, result in enumerate(ranks):
        assert all(result["equal"].values()), f"rank {rank}: watching changed training"
        assert "tensor parallelism" in result["refusal"] and "every={'grad': 0}" in result["refusal"]
        assert not any(k.startswith("grad_norm") for r in result["reported"] for k in r["values"])
    check_spectral(ranks)


def test_fsdp1_and_deepspeed_are_refused_with_what_is_supported(tmp_path: Path) -> None:
    ranks = run_layout("refusals", tmp_path, world=2)
    for result in ranks:
        messages = result["refusals"]
        assert set(messages) == {"fsdp1", "deepspeed_engine", "deepspeed_inner"}
        for case, message in messages.items():
            assert message, f"{case}: watch() accepted a layout it would misread"
            assert "FSDP2 (torch.distributed.fsdp.fully_shard" in message and "DistributedDataParallel" in message, message
            assert "every={'grad': 0, 'spectral': 0}" in message
        assert "FSDP1" in messages["fsdp1"]
        assert "DeepSpeed" in messages["deepspeed_engine"] and "DeepSpeed" in messages["deepspeed_inner"]
