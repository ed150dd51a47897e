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

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import rankwatch
from rankwatch.activations import ActivationProbe
from rankwatch.discovery import discover
from rankwatch_testkit.zoo import ZooConfig, ZooModel

STEPS = 8
CONFIG = ZooConfig(layout="olmo")


def _train(tmp_path: Path, watch: dict[str, Any] | None) -> dict[str, Any]:
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = ZooModel(CONFIG)
    run = None
    if watch is not None:
        run = rankwatch.init(run="compiled", mode="offline", spool_dir=tmp_path, every={"activations": 2, "spectral": 4})
        run.watch(model, **watch)
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1)
    last_armed: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", rankwatch.RankwatchWarning)
        for step in range(STEPS):
            x = torch.randint(0, CONFIG.vocab_size, (3, 12), generator=data)
            if run is not None and run._activations is not None and run._activations.armed:
                last_armed = ({k: v.detach().clone() for k, v in model.state_dict().items()}, x)
            compiled(x, torch.roll(x, -1, 1))[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if run is not None:
                run.log(step)
        tags = dict(run.tags) if run is not None else {}
        reported = dict(run.last_values) if run is not None else {}
        if run is not None:
            run.finish()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, rankwatch.RankwatchWarning)],
        "tags": tags,
        "reported": reported,
        "last_armed": last_armed,
    }


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
