"""Misuse gets a clear error (configuration) or a warning (the training loop), never a crash."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch

import rankwatch
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

from conftest import Collector


def offline(tmp_path: Path, **kw: Any) -> rankwatch.Run:
    return rankwatch.init(run="bad-use", mode="offline", spool_dir=tmp_path / "spool", **kw)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "sometimes"}, "mode must be"),
        ({"collector": "ftp://x"}, "http://"),
        ({"rank": 4, "world_size": 4}, "not within world size"),
        ({"every": {"spectrum": 3}}, "unknown probe"),
        ({"every": 0}, "at least 1"),
        ({"run": "///"}, "no usable characters"),
    ],
)
def test_bad_init_arguments_name_the_problem(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        rankwatch.init(**kwargs)


def test_wrong_types_nan_and_misuse_in_the_loop_only_warn(tmp_path: Path, collector: Collector) -> None:
    run = rankwatch.init(run="bad-loop", collector=collector.url, spool_dir=tmp_path / "spool")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.log(0, loss=1.5, note="a string", vec=torch.ones(3), ok=2.0)  # type: ignore[arg-type]  # the wrong type is the test
        run.log(-1, loss=1.0)
        run.log("3", loss=1.0)  # type: ignore[arg-type]
        run.log(1, **{"bad name!": 1.0})
        run.log(2, spectral_ratio=1.0)  # a user scalar, fine
        run.log(3, loss=torch.tensor(float("nan")))
        run.log(4, loss=float("inf"))
        stats = run.finish(timeout=10)
        run.finish()
        run.log(5, loss=1.0)
    messages = " | ".join(str(w.message) for w in caught)
    for expected in ("'note' is a str", "shape (3,)", "step that is an int >= 0", "bad name!", "loss is nan at step 3", "called twice", "after finish"):
        assert expected in messages, f"no warning about {expected!r}: {messages}"
    assert all(issubclass(w.category, rankwatch.RankwatchWarning) for w in caught)
    assert stats["refused_rows"] == 0 and stats["dropped_rows"] == 0
    rows = {(r["metric"], r["step"]): r["value"] for r in collector.sql("SELECT metric, step, value FROM samples")}
    assert rows[("loss", 0)] == 1.5 and rows[("user/ok", 0)] == 2.0
    assert ("user/note", 0) not in rows and ("user/vec", 0) not in rows
    assert rows[("user/spectral_ratio", 2)] == 1.0
    assert rows[("loss", 3)] == "NaN" and rows[("nonfinite", 3)] == 1.0, "NaN is stored and counted"
    assert rows[("loss", 4)] == "Infinity"
    assert not any(step == 5 for _, step in rows)


def test_disabled_mode_is_a_no_op(tmp_path: Path) -> None:
    run = rankwatch.init(mode="disabled")
    model = NanoGPT(NanoGPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=8))
    assert run.watch(model) is run
    run.log(0, loss=torch.tensor(1.0))
    assert run.finish() == {} and run.stats() == {}
    assert not list(model.modules())[0]._forward_hooks


def test_disabled_mode_returns_a_noop_run_with_every_public_method_of_run() -> None:
    """NoopRun overrides each public method and property of Run, so none of Run's machinery
    (agent, probes, spool) runs in disabled mode — including methods added to Run later."""
    run = rankwatch.init(mode="disabled")
    assert type(run) is rankwatch.NoopRun and isinstance(run, rankwatch.Run)
    public = {name for name in dir(rankwatch.Run) if not name.startswith("_") or name in ("__enter__", "__exit__")}
    methods = {name for name in public if callable(getattr(rankwatch.Run, name)) or isinstance(getattr(rankwatch.Run, name), property)}
    assert methods >= {"watch", "watch_or_warn", "log", "on_alert", "stats", "flush", "finish", "unwatch", "finished"}
    missing = sorted(name for name in methods if name not in vars(rankwatch.NoopRun))
    assert not missing, f"NoopRun does not override Run.{missing}: in disabled mode they would run Run's code"
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a no-op warns about nothing either
        with run as same:
            assert same is run
            assert run.watch(model) is run and run.watch_or_warn(model) is run
            run.log(0, {"loss": 1.0}, tokens=3, lr=torch.tensor(0.1))
            run.on_alert(lambda alert: None)
            assert run.flush() is True and run.stats() == {}
            run.unwatch()
        assert run.finished and run.finish() == {}
    assert not model._forward_hooks and not model.weight._post_accumulate_grad_hooks
    assert run.mode == "disabled" and run.id == "disabled" and run.last_values == {}
    assert run not in rankwatch.run.live_runs()
    with pytest.raises(TypeError, match="callable"):
        run.on_alert("not a function")  # type: ignore[arg-type]


def test_context_manager_finishes(tmp_path: Path) -> None:
    with offline(tmp_path) as run:
        run.log(0, loss=math.pi)
    assert run._finished
    report_dir = tmp_path / "spool" / "bad-use"
    assert any(report_dir.rglob("*.spool")), "offline data waits in the spool"


def test_a_sharded_model_needs_the_optimizer_for_its_spectral_steps(tmp_path: Path) -> None:
    """FSDP2 weights are measured by every rank together, at the same optimizer steps: without
    the optimizer watch() says so; with it, every probe reports (one rank here; several in
    test_sharded.py)."""
    import os

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from conftest import free_port, train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = NanoGPT(NanoGPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=8))
        fully_shard(model)
        run = offline(tmp_path)
        with pytest.raises(ValueError, match=r"pass the optimizer to watch\(\)"):
            run.watch(model)
        run.finish()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        quiet = rankwatch.init(run="sharded", mode="offline", spool_dir=tmp_path / "spool", every=1)
        quiet.watch(model, optimizer)
        for step in range(2):
            quiet.log(step, loss=train_step(model, optimizer, vocab=10, batch=2, seq=8))
        names = {k[0] for k in quiet.last_values}
        assert {"act_max", "token_cosine", "grad_norm", "grad_norm_mean", "spectral.sigma", "probe_ms.spectral"} <= names
        quiet.finish()
    finally:
        dist.destroy_process_group()


def test_a_failing_probe_turns_itself_off_and_the_step_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rankwatch.gradients import GradientProbe

    def broken(self, index, param):  # type: ignore[no-untyped-def]
        raise RuntimeError("probe bug")

    monkeypatch.setattr(GradientProbe, "_observe", broken)
    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=8, dropout=0.0))
    reference = NanoGPT(NanoGPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=8, dropout=0.0))
    reference.load_state_dict(model.state_dict())
    run = offline(tmp_path, every={"activations": 1, "spectral": 1})
    run.watch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            x = torch.randint(0, 10, (2, 8))
            for m in (model, reference):
                _, loss = m(x, torch.roll(x, -1, 1))
                loss.backward()
            run.log(step, loss=loss.detach(), **{"bad name!": 1.0}, fine=2.0)
    stats = run.finish()
    messages = [str(w.message) for w in caught]
    assert sum("gradient probe failed" in m for m in messages) == 1, messages
    assert sum("bad name!" in m for m in messages) == 1, "warned once, counted every time"
    assert all(torch.equal(cast(torch.Tensor, a.grad), cast(torch.Tensor, b.grad)) for a, b in zip(model.parameters(), reference.parameters()))
    names = {k[0] for k in run.last_values}
    assert "act_max" in names and "grad_norm" not in names, "the other probes go on"
    assert run.last_values[("rejected", None, None, False)] == 3.0
    assert stats["dropped_rows"] == 0
