"""No host sync inside rankwatch, proven without a GPU.

On a GPU, `Tensor.item()`, `tolist()`, `cpu()`, `numpy()`, `bool(t)` and `float(t)` on a device
tensor wait for the device: a probe that does one stalls every step. Here each of them is made
to raise (and to be recorded) whenever a frame of the `rankwatch` package is on the stack,
during full training steps with every probe on at every step — DDP gradient statistics with dot
mode and sketch, GradScaler unscaling, activation maxima, token cosine, spectral norms — and a
tensor loss logged. The only reads allowed are of the reporter's own host buffers, which on a
GPU are the pinned copies read after their event completed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch

import rankwatch
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

from conftest import train_step

if TYPE_CHECKING:
    from types import FrameType

    from rankwatch.report import Reporter

PACKAGE = str(Path(rankwatch.__file__).resolve().parent)
GUARDED = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__")


class HostSyncGuard:
    def __init__(self) -> None:
        self.violations: list[str] = []
        self.allowed: Any = lambda tensor: False
        self._saved: dict[str, Any] = {}

    def _in_rankwatch(self) -> str | None:
        frame: FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename.startswith(PACKAGE):
                return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
            frame = frame.f_back
        return None

    def install(self) -> None:
        for name in GUARDED:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def guarded(tensor: torch.Tensor, *args: Any, __name: str = name, __original: Any = original, **kwargs: Any) -> Any:
                where = self._in_rankwatch()
                if where is not None and not self.allowed(tensor):
                    self.violations.append(f"Tensor.{__name} at {where}")
                    raise RuntimeError(f"host sync: Tensor.{__name} inside rankwatch ({where})")
                return __original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, guarded)

    def remove(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture
def guard() -> Iterator[HostSyncGuard]:
    g = HostSyncGuard()
    g.install()
    try:
        yield g
    finally:
        g.remove()


def amp_step(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> torch.Tensor:
    """One bf16-autocast step of the nanoGPT under a GradScaler; returns the loss."""
    x = torch.randint(0, 40, (4, 16))
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = ddp(x, torch.roll(x, -1, 1))
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss


def test_the_guard_sees_a_host_sync_in_rankwatch_frames(guard: HostSyncGuard) -> None:
    t = torch.ones(())
    with pytest.raises(RuntimeError, match="host sync"):
        exec(compile("t.item()", os.path.join(PACKAGE, "run.py"), "exec"), {"t": t})
    assert guard.violations and t.item() == 1.0, "outside rankwatch nothing changes"


def test_a_full_step_with_every_probe_on_never_syncs(guard: HostSyncGuard, one_rank_group: None, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    run = rankwatch.init(run="no-sync", mode="offline", spool_dir=tmp_path, every={"grad": 1, "sketch": 1, "dot": 1, "activations": 1, "spectral": 1, "fingerprint": 1})
    run.watch(ddp, optimizer, scaler=scaler)
    # The replica fingerprint runs only with a second replica to compare against: install it
    # as a two-replica run would, so that its pass is guarded too.
    run.world_size = 2
    run._watch_fingerprint(model, run._layout, sharded=False, ddp=ddp)
    run._fingerprint.checked = ddp  # type: ignore[union-attr]  # its group of one stands for the replicas: not checked against the run
    assert run._reporter is not None
    reporter = run._reporter
    # The reporter's host buffers are the pinned copies a GPU run reads after their event.
    guard.allowed = lambda tensor: any(tensor is t for pool in reporter._hosts.values() for t in pool)
    for step in range(3):
        loss = amp_step(ddp, optimizer, scaler)
        run.log(step, loss=loss.detach(), tokens=torch.tensor(64))
    run.finish(timeout=5)
    assert guard.violations == []
    names = {k[0] for k in run.last_values}
    for expected in ("loss", "tokens", "grad_norm", "grad_norm_mean", "cos_to_mean", "amp_skipped", "act_max", "token_cosine", "spectral.ratio", "param_fingerprint", "layer_fingerprint"):
        assert expected in names, f"{expected} was measured"


def test_a_full_fsdp2_step_with_every_probe_on_never_syncs(guard: HostSyncGuard, one_rank_group: None, tmp_path: Path) -> None:
    """The sharded paths too: FSDP2 gradient statistics (hooks on the unsharded parameters, the
    end-of-backward all-reduce, shard sketches at global coordinates) and collective spectral
    norms of DTensor weights, run from the optimizer's step hook."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = rankwatch.init(run="no-sync-fsdp2", mode="offline", spool_dir=tmp_path, every=1)
    run.watch(model, optimizer)
    assert run._spectral is not None and run._spectral.collective
    reporter = cast("Reporter", run._reporter)  # watch() made it
    guard.allowed = lambda tensor: any(tensor is t for pool in reporter._hosts.values() for t in pool)
    for step in range(3):
        run.log(step, loss=train_step(model, optimizer, vocab=40, batch=4, seq=16))
    run.finish(timeout=5)
    assert guard.violations == []
    names = {k[0] for k in run.last_values}
    for expected in ("grad_norm", "grad_norm_mean", "cos_to_mean", "act_max", "spectral.ratio", "probe_ms.spectral"):
        assert expected in names, f"{expected} was measured"


def test_steps_watched_by_the_zero_code_agent_never_sync(guard: HostSyncGuard, one_rank_group: None, tmp_path: Path) -> None:
    """What `rankwatch run` / `rankwatch attach` install: the agent's step hook, its loss capture
    (the wrapped `torch.autograd.backward` and `GradScaler.scale`) and every probe. The guard
    covers every step after the agent's start; the start itself (finding the model, reading the
    optimizer's step count once) is a one-off between two steps."""
    from rankwatch.auto.agent import AutoAgent, Settings

    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    agent = AutoAgent(Settings(run="no-sync-auto", mode="offline", spool_dir=str(tmp_path), every={"grad": 1, "sketch": 1, "dot": 1, "activations": 1, "spectral": 1}))
    agent.install()
    saved = guard.allowed
    try:
        for step in range(4):
            if step == 1:
                assert agent.state == "watching" and agent.run is not None
                reporter = cast("Reporter", agent.run._reporter)  # watch() made it
                guard.allowed = lambda tensor: any(tensor is t for pool in reporter._hosts.values() for t in pool)
            elif step == 0:
                guard.allowed = lambda tensor: True  # the one-off start
            last_loss = float(amp_step(ddp, optimizer, scaler).detach())
        run = agent.run
        assert run is not None
        agent.uninstall()
    finally:
        guard.allowed = saved
    assert guard.violations == []
    assert agent.error is None
    names = {k[0] for k in run.last_values}
    for expected in ("loss", "grad_norm", "grad_norm_mean", "cos_to_mean", "amp_skipped", "act_max", "spectral.ratio"):
        assert expected in names, f"{expected} was measured"
    logged = next(v for k, v in run.last_values.items() if k[0] == "loss")
    assert abs(logged - last_loss) <= 1e-6 * abs(last_loss), "the loss is the unscaled one scaler.scale was given"
    assert scaler.get_scale() > 1000, "(the scale the backward ran at was large)"
    assert torch.autograd.backward.__module__ == "torch.autograd", "the loss capture was undone"
