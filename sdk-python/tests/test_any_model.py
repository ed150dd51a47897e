"""Any model, any job: the probes that need no map of the model run on every model, the loss
scaler is found rather than trusted, and a job you do not edit can be told the model's layout.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import rankwatch
from rankwatch.auto.launch import environment, resolve_mapping
from rankwatch.mapping import parse, stored

from conftest import Collector, run_ranks

DEADLINE_S = 240


def test_a_model_discovery_cannot_read_keeps_loss_and_gradient_probes_under_ddp(tmp_path: Path) -> None:
    """2 gloo ranks, a GradScaler(init_scale=1024) never handed to watch(), clip_grad_norm_ after
    unscale_: every rank reports ‖g_k‖, ‖ḡ‖ and cos(g_k, ḡ) equal to brute force, ‖ḡ‖ equal to
    the total clip_grad_norm_ returned (relative 1e-4), twins bit-identical, and one warning
    that names the probes that are off and the fix."""
    worker = Path(__file__).with_name("unreadable_worker.py")
    run_ranks([sys.executable, str(worker), str(tmp_path)], 2, DEADLINE_S)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert result["equal"], f"rank {rank}: watching changed the parameters"
        assert result["clipped_plain"] == result["clipped_watched"]
        off = [w for w in result["warnings"] if "layer probes off" in w]
        assert len(off) == 1, result["warnings"]
        assert "spectral, activations" in off[0] and "mapping" in off[0] and "--mapping" in off[0] and "grad_norm" in off[0]
        assert result["tags"]["layer_probes"] == "off (spectral, activations): blocks not found"
        assert len(result["reported"]) == len(result["expected"]) == 5
        for step, (got, want, clip) in enumerate(zip(result["reported"], result["expected"], result["clipped_watched"], strict=True)):
            for name in ("grad_norm", "grad_norm_mean", "cos_to_mean"):
                assert math.isclose(got[name], want[name], rel_tol=1e-5), f"rank {rank} step {step} {name}: {got[name]} != {want[name]}"
            assert math.isclose(got["grad_norm_mean"], clip, rel_tol=1e-4), f"rank {rank} step {step}: ‖ḡ‖ {got['grad_norm_mean']} != clip total {clip}"
            assert got["amp_skipped"] == 0.0 and got["nonfinite"] == 0.0
            assert not any(k.startswith(("spectral", "act_max")) for k in got)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _step(model: nn.Module, scaler: torch.amp.GradScaler | None, x: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    (scaler.scale(loss) if scaler is not None else loss).backward()
    grads = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in model.parameters()]).double()
    scale = scaler.get_scale() if scaler is not None else 1.0
    return float(grads.norm()) / scale


def test_of_several_scalers_the_one_that_scaled_the_loss_unscales_the_norm(tmp_path: Path) -> None:
    model = _mlp()
    run = rankwatch.init(run="scalers", mode="offline", spool_dir=tmp_path, every={"grad": 1})
    first = torch.amp.GradScaler("cpu", init_scale=1024.0)
    second = torch.amp.GradScaler("cpu", init_scale=8.0)
    torch.amp.GradScaler("cpu", enabled=False)  # a disabled one scales nothing
    run.watch(model)
    x = torch.randn(5, 8)
    for step, scaler in enumerate((first, second, None, first)):
        want = _step(model, scaler, x)
        run.log(step)
        got = run.last_values[("grad_norm", None, None, False)]
        assert math.isclose(got, want, rel_tol=1e-6), f"step {step}: {got} != {want}"
    run.finish()
    assert torch.amp.GradScaler.scale.__name__ == "scale" and not hasattr(torch.amp.GradScaler.scale, "__wrapped__"), "finish() restores GradScaler.scale"


def test_a_scaler_seen_on_a_step_the_probe_skipped_does_not_unscale_a_later_plain_step(tmp_path: Path) -> None:
    model = _mlp()
    run = rankwatch.init(run="stale-scaler", mode="offline", spool_dir=tmp_path, every={"grad": 2})
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    run.watch(model)
    x = torch.randn(5, 8)
    for step, used in enumerate((scaler, scaler, None, None)):
        want = _step(model, used, x)
        run.log(step)
        if step % 2 == 0:
            got = run.last_values[("grad_norm", None, None, False)]
            assert math.isclose(got, want, rel_tol=1e-6), f"step {step}: {got} != {want}"
        run.last_values.clear()
    run.finish()


def test_a_scaler_given_to_watch_but_not_the_one_that_scaled_is_named_once(tmp_path: Path) -> None:
    model = _mlp()
    run = rankwatch.init(run="scaler-named", mode="offline", spool_dir=tmp_path, every={"grad": 1})
    given = torch.amp.GradScaler("cpu", init_scale=4.0)
    used = torch.amp.GradScaler("cpu", init_scale=64.0)
    run.watch(model, scaler=given)
    x = torch.randn(5, 8)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(3):
            want = _step(model, used, x)
            run.log(step)
            assert math.isclose(run.last_values[("grad_norm", None, None, False)], want, rel_tol=1e-6)
    named = [str(w.message) for w in seen if "not by the GradScaler given to watch" in str(w.message)]
    assert len(named) == 1 and f"{id(used):#x}" in named[0]
    run.finish()


def test_an_unknown_model_warns_once_and_reports_gradients(tmp_path: Path) -> None:
    model = _mlp()
    run = rankwatch.init(run="unknown", mode="offline", spool_dir=tmp_path, every={"grad": 1})
    with pytest.warns(rankwatch.RankwatchWarning, match=r"layer probes off \(spectral, activations\).*mapping=") as seen:
        run.watch(model)
    assert len([w for w in seen if "layer probes off" in str(w.message)]) == 1
    _step(model, None, torch.randn(5, 8))
    run.log(0)
    assert run.last_values[("grad_norm", None, None, False)] > 0
    assert not any(k[0].startswith(("spectral", "act_max")) for k in run.last_values)
    run.finish()


def test_a_mapping_that_does_not_fit_is_a_configuration_error_in_watch_and_a_warning_in_the_agent(tmp_path: Path) -> None:
    run = rankwatch.init(run="bad-mapping", mode="offline", spool_dir=tmp_path, every={"grad": 1})
    with pytest.raises(rankwatch.DiscoveryError, match=r"trunk\.nowhere"):
        run.watch(_mlp(), mapping={"blocks": "trunk.nowhere"})
    model = _mlp()
    with pytest.warns(rankwatch.RankwatchWarning, match=r"the mapping does not fit the model"):
        run.watch_or_warn(model, mapping={"blocks": "trunk.nowhere"})
    _step(model, None, torch.randn(5, 8))
    run.log(0)
    assert ("grad_norm", None, None, False) in run.last_values, "the gradient probe runs without the mapping"
    run.finish()


# ---------------------------------------------------------------------------------------------
# --mapping for jobs you do not edit.


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", "not valid JSON"),
        ('["blocks"]', "a JSON object"),
        ('{"q": "attn.q"}', "needs 'blocks'"),
        ('{"blocks": "h", "query": "attn.q"}', "unknown keys"),
        ('{"blocks": "h", "transposed": ["qq"]}', "'transposed' must list sites"),
        ('{"blocks": "h", "attention": {"n_heads": 2}}', "'attention' must be"),
        ("/nonexistent/mapping.json", "neither JSON nor a readable file"),
    ],
)
def test_a_bad_mapping_is_refused_with_what_is_wrong(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse(text)


def test_rankwatch_run_refuses_a_bad_mapping_before_starting_the_job(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    done = subprocess.run(
        [sys.executable, "-m", "rankwatch", "run", "--mapping", '{"q": "x"}', "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "needs 'blocks'" in done.stderr
    assert not marker.exists(), "the job must not start with a mapping that cannot be used"


def test_a_mapping_file_reaches_the_agent_through_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "mapping.json"
    path.write_text(json.dumps({"blocks": "trunk.stack", "q": "mix.query"}))
    mapping = resolve_mapping(str(path), None, None)
    env = environment(["python", "train.py"], run="r", collector=None, every=None, dormant=False, mode=None, mapping=mapping, base={})
    from rankwatch.auto.agent import Settings

    assert Settings.from_env(env).mapping == {"blocks": "trunk.stack", "q": "mix.query"}


class _Stack(nn.Module):
    """Blocks whose attention is an einsum: structural discovery does not follow it."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.ModuleList([_EinsumBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.stack:
            x = block(x)
        return x


class _EinsumBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(8, 8, bias=False) for _ in range(4))
        self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("btc,bsc->bts", self.wq(x), self.wk(x)).softmax(-1)
        x = x + self.wo(torch.einsum("bts,bsc->btc", scores, self.wv(x)))
        return x + self.w2(F.relu(self.w1(x)))


MAPPING = {"blocks": "stack", "q": "wq", "k": "wk", "v": "wv", "o": "wo", "up": "w1", "down": "w2", "attention": {"n_heads": 1, "head_dim": 8}}


def test_the_mapping_is_kept_at_the_collector_and_found_again_by_run_name(tmp_path: Path, collector: Collector) -> None:
    model = _Stack()
    run = rankwatch.init(run="kept-mapping", collector=collector.url, every={"grad": 1, "spectral": 1})
    run.watch(model, mapping=MAPPING)
    x = torch.randn(2, 3, 8)
    model(x).square().mean().backward()
    run.log(0)
    assert any(k[0] == "spectral.ratio" for k in run.last_values), "the mapping turned the layer probes on"
    assert run.flush(10)
    run.finish()
    assert stored(collector.url, "kept-mapping") == MAPPING
    assert resolve_mapping(None, "kept-mapping", collector.url) == MAPPING, "a re-attach under the same name reuses it"
    assert stored(collector.url, "no-such-run") is None
    assert stored("http://127.0.0.1:9", "kept-mapping", timeout=1) is None, "an unreachable collector is no mapping, not an error"


def test_a_model_compiled_before_watch_has_its_activation_probe_off_and_said_so(tmp_path: Path) -> None:
    """Graphs compiled before a hook existed never call it: rather than an armed probe that
    silently sees nothing, the probe is off, with a warning and a tag; every other probe runs."""
    from rankwatch_testkit.zoo import ZooConfig, ZooModel

    torch.manual_seed(0)
    model = ZooModel(ZooConfig(layout="megatron"))
    compiled = cast(nn.Module, torch.compile(model))  # an OptimizedModule; the stub says Callable
    run = rankwatch.init(run="compiled", mode="offline", spool_dir=tmp_path, every={"grad": 1, "spectral": 1, "activations": 1})
    with pytest.warns(rankwatch.RankwatchWarning, match=r"activation probe off: the model is already compiled"):
        run.watch(compiled)
    assert run.tags["activations"] == "off: the model was compiled before watch()"
    assert run._activations is None and run._spectral is not None and run._gradients is not None
    run.finish()
    plain = rankwatch.init(run="eager", mode="offline", spool_dir=tmp_path, every={"activations": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error", rankwatch.RankwatchWarning)
        plain.watch(ZooModel(ZooConfig(layout="megatron")))
    assert plain._activations is not None, "an eager model keeps its activation probe"
    plain.finish()


def _zoo_step(model: nn.Module, optimizer: torch.optim.Optimizer, data: torch.Generator) -> None:
    x = torch.randint(0, 96, (2, 12), generator=data)
    model(x, torch.roll(x, -1, 1))[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_blocks_that_want_their_own_arguments_are_read_at_their_first_forward(tmp_path: Path) -> None:
    """torchtitan and Megatron hand every block rotary tables and a mask: such a block cannot run
    on a made-up input, so the run keeps meta copies of the first block's arguments at its first
    forward and reads the blocks at the next log(): the layer probes start from there, and the
    job trains exactly as its unwatched twin."""
    from rankwatch_testkit.zoo import ZooConfig, ZooModel

    def job(watched: bool) -> tuple[dict[str, torch.Tensor], list[set[str]], rankwatch.Run | None]:
        torch.manual_seed(0)
        model = ZooModel(ZooConfig(layout="rotary_args"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(1)
        run, seen = None, []
        if watched:
            run = rankwatch.init(run="needs-call", mode="offline", spool_dir=tmp_path, every={"grad": 1, "spectral": 1, "activations": 1})
            with warnings.catch_warnings():
                warnings.simplefilter("error", rankwatch.RankwatchWarning)
                run.watch(model, optimizer)
            assert run.tags["layer_probes"] == "pending: the blocks are read at their first forward"
            assert run._layout is None and run._gradients is not None
        for step in range(3):
            _zoo_step(model, optimizer, data)
            if run is not None:
                run.log(step)
                seen.append({k[0] for k in run.last_values})
                run.last_values.clear()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, seen, run

    plain, _, _ = job(False)
    watched, seen, run = job(True)
    assert run is not None and run._layout is not None and run._layout.family == "structural"
    assert "layer_probes" not in run.tags
    assert "spectral.ratio" in seen[0] and "grad_norm" in seen[0], "read at the first log, measured at once"
    assert "act_max" in seen[1], "the activation probe is armed from the first log on"
    assert all(torch.equal(plain[k], watched[k]) for k in plain), "watching changed training"
    run.finish()


def test_a_first_call_the_trace_cannot_use_turns_the_layer_probes_off_with_the_reason(tmp_path: Path) -> None:
    class Cache:
        pass

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, cache: Cache) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x, Cache())
            return x

    model = Model()
    run = rankwatch.init(run="bad-call", mode="offline", spool_dir=tmp_path, every={"grad": 1, "spectral": 1})
    run.watch(model)
    model(torch.randn(2, 3, 8)).square().mean().backward()
    with pytest.warns(rankwatch.RankwatchWarning, match=r"layer probes off \(spectral, activations\).*takes Cache"):
        run.log(0)
    assert run.tags["layer_probes"] == "off (spectral, activations): blocks not found"
    assert ("grad_norm", None, None, False) in run.last_values
    run.finish()
