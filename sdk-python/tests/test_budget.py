"""The spectral budget: layers per call shrink when a call costs more than its share of the step
and grow back when it costs far less; under sharded weights every rank decides from the same
sums, exchanged through a real c10d store."""

from __future__ import annotations

import threading
from typing import cast

import pytest
import torch
import torch.distributed as dist

from rankwatch.budget import SharedSums, SpectralBudget, SpectralTimer


def test_layers_per_call_halve_over_budget_and_double_back_under_a_quarter() -> None:
    budget = SpectralBudget(layers=16, fraction=0.01, every=50)
    # A call of 40 ms every 50 steps of 10 ms: 40 / 500 = 8 % of training time.
    assert budget.before_call(None, 10.0) == 16  # nothing measured yet
    assert budget.before_call(40.0, 10.0) == 8
    assert budget.before_call(20.0, 10.0) == 4  # 4 %: still over
    assert budget.before_call(10.0, 10.0) == 2
    assert budget.before_call(6.0, 10.0) == 1  # 1.2 %
    assert budget.before_call(5.0, 10.0) == 1  # 1 %: at the budget, not over it
    assert budget.before_call(50.0, 10.0) == 1  # never below one layer
    assert budget.before_call(0.5, 10.0) == 2  # 0.1 %: under a quarter of the budget
    assert budget.before_call(1.5, 10.0) == 2  # 0.3 %: between, unchanged
    for _ in range(10):
        budget.before_call(0.1, 10.0)
    assert budget.per_call == 16  # never above every layer


def test_a_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive fraction"):
        SpectralBudget(layers=4, fraction=0.0, every=10)


def test_ranks_agree_through_the_store_whatever_they_measured() -> None:
    """Two ranks measuring different times take the same decisions, from the sums over both;
    the read of call c-2's sums waits until the slower rank added its part."""
    store = dist.HashStore()
    budgets = [SpectralBudget(layers=8, fraction=0.01, every=10, shared=SharedSums(store, "run/spectral", ranks=2)) for _ in range(2)]
    measured = [[None, 30.0, 30.0, 1.0, 1.0], [None, 1.0, 1.0, 1.0, 1.0]]  # call ms per call, per rank
    decisions: list[list[int]] = [[], []]

    def rank(r: int) -> None:
        for ms in measured[r]:
            decisions[r].append(budgets[r].before_call(ms, 10.0))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert decisions[0] == decisions[1]
    # Call 3 decides on call 1's sums: (30 + 1) / (10 + 10) / 10 = 15 % > 1 %, so it halves.
    assert decisions[0][:2] == [8, 8] and decisions[0][2] == 4


def test_the_timer_measures_host_time_on_cpu() -> None:
    timer = SpectralTimer(torch.device("cpu"))
    assert timer.last_ms() is None
    timer.start()
    torch.randn(256, 256) @ torch.randn(256, 256)
    timer.stop()
    assert timer.last_ms() is not None and cast(float, timer.last_ms()) > 0  # the same call, not None


def test_a_run_over_its_spectral_budget_measures_fewer_layers_per_call(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With a budget no call can meet, the run halves the layers a spectral call covers down
    to one; with a generous one it keeps every layer. Each call reports its time."""
    import rankwatch
    from conftest import train_step
    from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

    def spectral_layers(budget: float) -> list[int]:
        torch.manual_seed(0)
        model = NanoGPT(NanoGPTConfig(block_size=8, vocab_size=16, n_layer=4, n_head=2, n_embd=16))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        run = rankwatch.init(run="budget", mode="offline", spool_dir=tmp_path, every={"grad": 0, "activations": 0, "spectral": 1})
        run.watch(model, optimizer, spectral_budget=budget)
        covered = []
        for step in range(6):
            run.log(step, loss=train_step(model, optimizer, vocab=16, batch=2, seq=8))
            covered.append(len({k[1] for k in run.last_values if k[0] == "spectral.sigma"}))
            assert run.last_values[("probe_ms.spectral", None, None, False)] > 0
            run.last_values.clear()
        run.finish()
        return covered

    tight = spectral_layers(1e-12)
    assert tight[0] == 4 and tight[-1] == 1 and tight == sorted(tight, reverse=True), tight
    assert spectral_layers(1e6) == [4] * 6
