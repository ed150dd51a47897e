"""The activation probe in a model watched and then `torch.compile`d (the SDK's documented order).

Each job compiles from a fresh dynamo state and trains the same steps from the same seed; the
unwatched twin is the anchor. Counted with dynamo's own counters:
- not opted in, the hooks add nothing to the graphs: as many graphs as the twin, the same
  parameters bit for bit, no act_max reported, and one warning and a tag saying how to opt in;
- opted in (`compiled_activations=True`), arming and disarming every other step costs exactly one
  graph more than the twin (armed and disarmed, each compiled once), no graph break, the same
  parameters bit for bit, and the maxima and token cosines reported at the last armed step equal
  those an eager probe reads on the same weights and batch (relative 1e-5: compiled and eager
  forwards round differently).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rankwatch.activations import ActivationProbe
from rankwatch.discovery import discover
from rankwatch_testkit.zoo import ZooConfig, ZooModel

from compiled_worker import train as _train
from conftest import run_ranks

CONFIG = ZooConfig(layout="olmo")
@pytest.fixture(scope="module")
def unwatched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _train(tmp_path_factory.mktemp("plain"), None)


def _same_parameters(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"], strict=True))


def test_not_opted_in_the_compiled_graphs_are_the_unwatched_ones(tmp_path: Path, unwatched: dict[str, Any]) -> None:
    watched = _train(tmp_path, {})
    assert _same_parameters(watched, unwatched), "watching changed the compiled training"
    assert watched["graphs"] == unwatched["graphs"] and watched["breaks"] == unwatched["breaks"] == 0
    assert not any(key[0] == "act_max" for key in watched["reported"]), "the compiled graphs measured activations"
    assert any(key[0] == "grad_norm" for key in watched["reported"]), "every other probe runs"
    said = [w for w in watched["warnings"] if "activation probe off inside torch.compile graphs" in w]
    assert len(said) == 1 and "compiled_activations=True" in said[0], watched["warnings"]
    assert watched["tags"]["activations"].startswith("off in compiled graphs")


def test_opted_in_arming_costs_one_graph_more_and_measures_what_eager_does(tmp_path: Path, unwatched: dict[str, Any]) -> None:
    watched = _train(tmp_path, {"compiled_activations": True})
    assert _same_parameters(watched, unwatched), "watching changed the compiled training"
    assert unwatched["graphs"] >= 1
    assert watched["graphs"] == unwatched["graphs"] + 1, f"{watched['graphs']} graphs against the twin's {unwatched['graphs']}"
    assert watched["breaks"] == 0, "a graph break in the training step"
    assert not any("activation probe off" in w for w in watched["warnings"]), watched["warnings"]
    assert "activations" not in watched["tags"]

    # The eager reference: a fresh model with the weights of the last armed step, its batch.
    assert watched["last_armed"] is not None
    state, x = watched["last_armed"]
    reference = ZooModel(CONFIG)
    reference.load_state_dict(state)
    probe = ActivationProbe(reference, discover(reference))
    probe.arm()
    reference(x, torch.roll(x, -1, 1))
    expected = {(metric, layer, site): float(value) for metric, layer, site, value in probe.collect()}
    got = {(key[0], key[1], key[2]): value for key, value in watched["reported"].items() if key[0] in ("act_max", "token_cosine")}
    # OLMo's blocks have no attention or MLP submodule: embed, per block its output and
    # cosine, the final norm.
    assert set(got) == set(expected) and len(expected) == 1 + CONFIG.layers * 2 + 1
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


def test_opted_in_twins_under_ddp_over_two_gloo_ranks(tmp_path: Path) -> None:
    """nanoGPT's layout (DistributedDataParallel over the compiled model), 2 gloo processes with
    a deadline: opted in, every rank's watched twin ends bit-identical to the unwatched one,
    compiles one graph more, breaks none, and reports the activation maxima."""
    run_ranks([sys.executable, str(Path(__file__).with_name("compiled_worker.py")), str(tmp_path)], 2, 300)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result["equal"], f"rank {rank}: watching changed the compiled training"
        plain, watched = result["graphs"]
        assert plain >= 1 and watched == plain + 1, result
        assert result["breaks"] == [0, 0], result
        assert "act_max" in result["metrics"] and "grad_norm" in result["metrics"], result
