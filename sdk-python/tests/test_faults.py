"""The fault injector's own promises, on which the detection benchmark's sweeps rest: a label
shuffle of rate r corrupts about that share of one rank's targets and no other rank's, keeping
the batch's labels (only their positions move); bad fault texts are refused with the reason."""

from __future__ import annotations

import re

import pytest
import torch
from rankwatch_testkit.faults import Fault, Injector


@pytest.mark.parametrize("rate", [0.05, 0.3, 1.0])
def test_a_partial_label_shuffle_moves_about_its_share_of_targets_on_its_rank_only(rate: float) -> None:
    fault = Fault.parse(f"shuffle_labels@5:rank=1:rate={rate}")
    torch.manual_seed(0)
    targets = torch.randint(0, 256, (64, 128))
    faulty, healthy = Injector([fault], rank=1), Injector([fault], rank=0)
    faulty.begin_step(4)
    assert torch.equal(faulty.targets(targets), targets), "before its step the fault does nothing"
    faulty.begin_step(5)
    healthy.begin_step(5)
    assert torch.equal(healthy.targets(targets), targets)
    shuffled = faulty.targets(targets)
    assert torch.equal(shuffled.flatten().sort().values, targets.flatten().sort().values), "the same labels, moved"
    changed = (shuffled != targets).float().mean().item()
    # A moved target lands on an equal label with probability ~1/256.
    assert abs(changed - rate * (1 - 1 / 256)) < 0.03, (rate, changed)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("shuffle_labels@3:rank=1:rate=0", "rate must be in (0, 1]"),
        ("shuffle_labels@3:rank=1:rate=1.5", "rate must be in (0, 1]"),
        ("shuffle_labels@3:rate=0.5", "needs rank=N"),
        ("grad_scale@3:rank=1:rate=2", "unknown option 'rate'"),
        ("grad_scale@x:rank=1", "non-negative integer step"),
    ],
)
def test_bad_fault_texts_are_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        Fault.parse(text)
