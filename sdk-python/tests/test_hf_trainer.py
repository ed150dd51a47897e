"""The Hugging Face Trainer under torchrun (2 gloo ranks, DDP through Accelerate, gradient
accumulation 2), with and without `num_items_in_batch`: watched (every probe at every step) and
unwatched twins end with identical parameters; the per-rank losses rankwatch reports,
weighted by their tokens, must give the Trainer's own logged loss; the gradient statistics must
be there on both ranks, ‖ḡ‖ equal across ranks and equal to the Trainer's own `grad_norm` (the
norm of the averaged gradient before clipping)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import torchrun

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.mark.parametrize("variant", ["items", "mean"])
def test_trainer_ddp_with_accumulation_reports_each_rank_truly(variant: str, tmp_path: Path) -> None:
    torchrun([str(Path(__file__).with_name("hf_trainer_worker.py")), str(tmp_path), variant], nproc=2, timeout=300, env={"HF_HUB_OFFLINE": "1"})
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["equal"] for r in ranks] == [True, True], "the watched Trainer ended with the unwatched twin's parameters"
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["run"] == ranks[1]["run"] == f"hf-{variant}"
    trainer = ranks[0]["trainer"]
    assert sorted(trainer) == ["1", "2", "3", "4"]
    for step, want in trainer.items():
        per_rank = [r["steps"][step] for r in ranks]
        tokens = [v["tokens"] for v in per_rank]
        weighted = sum(v["loss"] * n for v, n in zip(per_rank, tokens)) / sum(tokens)
        if variant == "items":
            # num_items_in_batch: the Trainer's loss is the token mean over ranks and micro-batches.
            assert math.isclose(weighted, want["loss"], rel_tol=1e-5), (step, weighted, want)
        else:
            # Per-micro-batch means over equal token counts: the plain mean is the same number.
            assert len(set(tokens)) == 1
            assert math.isclose(sum(v["loss"] for v in per_rank) / 2, want["loss"], rel_tol=1e-5), (step, per_rank, want)
        means = [v["grad_norm_mean"] for v in per_rank]
        assert math.isclose(means[0], means[1], rel_tol=1e-9)
        assert math.isclose(means[0], want["grad_norm"], rel_tol=1e-4), (step, means, want)
        for v in per_rank:
            assert v["grad_norm"] > 0 and 0 < v["cos_to_mean"] <= 1 + 1e-9
            assert v["nonfinite"] == 0
