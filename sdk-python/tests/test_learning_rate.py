"""`learning_rate`: the learning rate each optimizer step used, read by the agent from the
optimizer it watches (what `rank_collapse` waits out as the schedule's warm-up)."""

from __future__ import annotations

from pathlib import Path

import torch

import rankwatch
from conftest import train_step
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

KEY = ("learning_rate", None, None, False)


def _model() -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT(NanoGPTConfig(block_size=8, vocab_size=16, n_layer=2, n_head=2, n_embd=16))


def test_each_report_carries_the_learning_rate_its_step_used(tmp_path: Path) -> None:
    """A warm-up scheduler moves the learning rate after each step; the report has the value
    the step read, not the next one. Unwatching removes the hook."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    hooks_before = len(optimizer._optimizer_step_pre_hooks)
    run = rankwatch.init(run="lr", mode="offline", spool_dir=tmp_path, every={"spectral": 0, "activations": 0})
    run.watch(model, optimizer)
    seen, used = [], []
    for step in range(6):
        used.append(optimizer.param_groups[0]["lr"])
        loss = train_step(model, optimizer, vocab=16, batch=2, seq=8)
        scheduler.step()
        run.log(step, loss=loss)
        seen.append(run.last_values.pop(KEY, None))
    assert seen == used and used[:4] == [2.5e-4, 5e-4, 7.5e-4, 1e-3], (seen, used)
    # No step since the last report: nothing to send.
    run.log(6, loss=loss)
    assert KEY not in run.last_values
    run.finish()
    assert len(optimizer._optimizer_step_pre_hooks) == hooks_before


def test_a_tensor_learning_rate_and_one_the_user_logs(tmp_path: Path) -> None:
    """A tensor learning rate goes with the device values (copied at the step: a scheduler
    changes it in place after); one the user logs under the same name is not sent twice."""
    model = _model()
    lr = torch.tensor(0.01)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    run = rankwatch.init(run="lr-tensor", mode="offline", spool_dir=tmp_path, every={"spectral": 0, "activations": 0})
    run.watch(model, optimizer)
    loss = train_step(model, optimizer, vocab=16, batch=2, seq=8)
    optimizer.param_groups[0]["lr"].fill_(0.005)  # what a scheduler does after the step
    run.log(0, loss=loss)
    assert run.last_values[KEY] == torch.tensor(0.01).item()
    run.last_values.clear()
    loss = train_step(model, optimizer, vocab=16, batch=2, seq=8)
    run.log(1, loss=loss, learning_rate=0.123)
    assert run.last_values.get(KEY) in (None, 0.123), run.last_values.get(KEY)
    run.finish()


def test_no_optimizer_no_learning_rate(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = rankwatch.init(run="lr-none", mode="offline", spool_dir=tmp_path, every={"spectral": 0, "activations": 0})
    run.watch(model)
    for step in range(3):
        run.log(step, loss=train_step(model, optimizer, vocab=16, batch=2, seq=8))
    assert KEY not in run.last_values and ("loss", None, None, False) in run.last_values
    run.finish()
