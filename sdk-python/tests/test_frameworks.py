"""Accelerate's own loop and Lightning's DDP strategy, each under torchrun with 2 gloo ranks and
gradient accumulation 2. Accelerate: watched and unwatched twins end bit-identical, and the
reported ‖ḡ‖ of every optimizer step equals the norm of the gradient the optimizer saw.
Lightning: twins bit-identical, one report per optimizer step with the mean of its micro-batch losses, and ‖ḡ‖ equal
to the averaged gradient's norm in `on_before_optimizer_step`, on both ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from conftest import torchrun


def launch(kind: str, out: Path) -> list[dict[str, Any]]:
    torchrun([str(Path(__file__).with_name("frameworks_worker.py")), kind, str(out)], nproc=2, timeout=300)
    return [json.loads((out / f"{kind}-{r}.json").read_text()) for r in range(2)]


def test_accelerate_loop_twins_and_averaged_gradient(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    ranks = launch("accelerate", tmp_path)
    for rank, result in enumerate(ranks):
        assert result["equal"], f"rank {rank}: watching changed training"
        assert len(result["reported"]) == len(result["seen"]) == 4, "one record per optimizer step (8 batches a rank, 2 each)"
        for got, want in zip(result["reported"], result["seen"]):
            assert math.isclose(got["grad_norm_mean"], want, rel_tol=1e-5), (got, want)
            assert got["grad_norm"] > 0 and 0 < got["cos_to_mean"] <= 1 + 1e-9
    assert ranks[0]["seen"] == pytest.approx(ranks[1]["seen"], rel=1e-9)


def test_lightning_ddp_reports_each_optimizer_step(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    ranks = launch("lightning", tmp_path)
    for rank, result in enumerate(ranks):
        assert result["equal"], f"rank {rank}: watching changed training"
        reported = result["reported"]
        assert [r["step"] for r in reported] == [1, 2, 3], f"rank {rank}: {reported}"
        for i, got in enumerate(reported):
            micro = result["losses"][2 * i : 2 * i + 2]
            assert math.isclose(got["loss"], sum(micro) / 2, rel_tol=1e-6)
            assert math.isclose(got["grad_norm_mean"], result["averaged"][i], rel_tol=1e-5), (got, result["averaged"][i])
            assert got["grad_norm"] > 0 and 0 < got["cos_to_mean"] <= 1 + 1e-9
    assert ranks[0]["run"] == ranks[1]["run"] == "pl-ddp"
