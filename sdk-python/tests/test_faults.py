"""The fault injector's own promises, on which the detection benchmark's sweeps rest: a label
shuffle of rate r corrupts about that share of one rank's targets and no other rank's, keeping
the batch's labels (only their positions move); a bit flip changes exactly the bit it names, of
one element, on its rank, at its steps; a stale rank's gradient is the one its weights of k
updates ago give; bad fault texts are refused with the reason."""

from __future__ import annotations

import re

import pytest
import torch
from rankwatch_testkit.faults import Fault, Injector, flip_bit


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
        ("grad_bit_flip@3:rank=1:bit=32", "bit must be an integer from 0 to 31"),
        ("weight_bit_flip@3:rank=1:bit=2.5", "bit must be an integer from 0 to 31"),
        ("grad_bit_flip@3:rank=1:every=0", "every must be a positive integer"),
        ("stale_weights@3:rank=1:steps=0", "steps must be a positive integer"),
        ("stale_weights@3", "needs rank=N"),
    ],
)
def test_bad_fault_texts_are_refused_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=re.escape(reason)):
        Fault.parse(text)


def test_flip_bit_flips_exactly_one_bit_of_one_element() -> None:
    values = torch.tensor([0.5, -3.0, 1e-3, 2.0])
    flip_bit(values, 0, 30)  # 0.5's exponent 126 → 254: 2^127
    assert values[0].item() == 2.0**127
    flip_bit(values, 1, 31)  # the sign
    assert values[1].item() == 3.0
    flip_bit(values, 2, 23)  # the exponent's lowest bit: 1e-3's exponent is odd (-10 + 127), so ÷2
    assert values[2].item() == torch.tensor(5e-4).item()
    assert values[3].item() == 2.0, "other elements untouched"
    # A transposed (non-contiguous) tensor: element 1 in logical order is [0, 1] = 3.0.
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    transposed = base.t()
    flip_bit(transposed, 1, 31)
    assert transposed.tolist() == [[1.0, -3.0], [2.0, 4.0]] and base[1, 0].item() == -3.0, "in place, in logical order"
    halves = torch.tensor([1.5, 1.5], dtype=torch.bfloat16)
    flip_bit(halves, 1, 15)
    assert halves.tolist() == [1.5, -1.5]
    with pytest.raises(ValueError, match="cannot flip bit 16 of a torch.bfloat16"):
        flip_bit(halves, 0, 16)


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _grads(model: torch.nn.Module, injector: Injector, step: int, x: torch.Tensor) -> list[torch.Tensor]:
    injector.begin_step(step)
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    injector.end_backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int32)


def test_a_gradient_bit_flip_changes_one_bit_of_one_element_on_its_rank_at_its_steps() -> None:
    x = torch.randn(4, 6)
    fault = Fault.parse("grad_bit_flip@2:rank=1:bit=26:every=2")
    healthy, faulty = _model(), _model()
    clean, hit = Injector([fault], rank=0), Injector([fault], rank=1)
    clean.attach(healthy)
    hit.attach(faulty)
    state = torch.random.get_rng_state()
    changed = []
    for step in range(6):
        a, b = _grads(healthy, clean, step, x), _grads(faulty, hit, step, x)
        diff = torch.cat([(_bits(u) ^ _bits(v)) for u, v in zip(a, b, strict=True)])
        changed.append(int((diff != 0).sum()))
        if changed[-1]:
            assert diff[diff != 0].tolist() == [1 << 26], "one element, bit 26 alone"
    assert changed == [0, 0, 1, 0, 1, 0], "from step 2, every 2nd step, one element"
    assert torch.equal(torch.random.get_rng_state(), state), "the global random stream is not drawn from"


def test_a_weight_bit_flip_corrupts_one_element_once_and_it_stays() -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    injector = Injector([Fault.parse("weight_bit_flip@1:rank=0:bit=30")], rank=0)
    injector.attach(model)
    injector.begin_step(0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    injector.begin_step(1)
    diff = torch.cat([(_bits(p) ^ _bits(q)) for p, q in zip(model.parameters(), before, strict=True)])
    assert diff[diff != 0].tolist() == [1 << 30]
    injector.begin_step(2)
    diff2 = torch.cat([(_bits(p) ^ _bits(q)) for p, q in zip(model.parameters(), before, strict=True)])
    assert torch.equal(diff, diff2), "flipped once, not again"


def test_stale_weights_compute_the_gradient_on_the_weights_of_k_updates_ago() -> None:
    x = torch.randn(4, 6)
    model = _model()
    injector = Injector([Fault.parse("stale_weights@3:rank=0:steps=2")], rank=0)
    injector.attach(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    weights: list[list[torch.Tensor]] = []
    for step in range(6):
        weights.append([p.detach().clone() for p in model.parameters()])
        grads = _grads(model, injector, step, x)
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights[-1], strict=True)), "current weights are back after the backward"
        # The gradient a healthy replica would compute on the weights of `used` steps ago.
        used = weights[step - 2] if step >= 3 else weights[step]
        reference = _model()
        with torch.no_grad():
            for p, w in zip(reference.parameters(), used, strict=True):
                p.copy_(w)
        reference(x).square().sum().backward()
        assert all(torch.allclose(g, p.grad, rtol=0, atol=0) for g, p in zip(grads, reference.parameters(), strict=True)), step  # type: ignore[arg-type]
        optimizer.step()
    assert not torch.equal(weights[3][0], weights[1][0]), "the weights moved, so the test can tell stale from fresh"


def _twins(texts: list[str], steps: int, x: torch.Tensor, lr: float = 0.05) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]], Injector, torch.optim.Optimizer]:
    """Trains a healthy replica (rank 0) and a faulty one (rank 1) on the same batch; returns
    each one's weights after every step (index s: after step s), the faulty injector and its
    optimizer."""
    trajectories: list[list[list[torch.Tensor]]] = []
    for rank in (0, 1):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        injector = Injector([Fault.parse(t) for t in texts], rank=rank)
        injector.attach(model, optimizer=optimizer)
        weights = []
        for step in range(steps):
            _grads(model, injector, step, x)
            optimizer.step()
            weights.append([p.detach().clone() for p in model.parameters()])
        trajectories.append(weights)
    return trajectories[0], trajectories[1], injector, optimizer


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_an_optimizer_state_bit_flip_changes_one_bit_of_one_moment_once_on_its_rank() -> None:
    x = torch.randn(4, 6)
    fault = Fault.parse("optim_bit_flip@2:rank=1:bit=29")
    states = []
    for rank in (0, 1):
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        injector = Injector([fault], rank=rank)
        injector.attach(model, optimizer=optimizer)
        for step in range(2):
            _grads(model, injector, step, x)
            optimizer.step()
        injector.begin_step(2)  # the flip: before step 2's forward
        states.append({(i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in optimizer.state[p].items() if v.numel() > 1})
    healthy, flipped = states
    diffs = [(key, _bits(flipped[key]) ^ _bits(healthy[key])) for key in healthy]
    changed = [(key, d[d != 0].tolist()) for key, d in diffs if bool((d != 0).any())]
    assert len(changed) == 1 and changed[0][1] == [1 << 29], changed
    assert changed[0][0][1] in ("exp_avg", "exp_avg_sq")
    assert len(injector.flipped) == 1 and injector.flipped[0].endswith(changed[0][0][1])


def test_a_skipped_step_leaves_its_rank_one_update_behind() -> None:
    x = torch.randn(4, 6)
    healthy, faulty, _, _ = _twins(["skip_step@2:rank=1"], 5, x)
    assert _equal(healthy[1], faulty[1]), "equal before the fault"
    assert _equal(faulty[2], healthy[1]), "step 2 left the faulty rank's weights where step 1 put them"
    assert not _equal(faulty[2], healthy[2]) and not _equal(faulty[4], healthy[4]), "and it stays behind"


def test_an_old_checkpoint_puts_its_rank_back_k_updates_for_good() -> None:
    x = torch.randn(4, 6)
    healthy, faulty, _, _ = _twins(["old_checkpoint@5:rank=1:steps=3"], 8, x)
    assert _equal(healthy[4], faulty[4])
    # At step 5 the rank resumes from the weights (and Adam state) it had 3 updates ago, i.e.
    # after step 1, and updates them once: the healthy rank's step 2 on the same batch.
    assert _equal(faulty[5], healthy[2]), "resumed from the checkpoint after step 1, then stepped"
    assert _equal(faulty[7], healthy[4]) and not _equal(faulty[7], healthy[7]), "3 updates behind for good"


def test_a_corrupted_gemm_changes_one_forward_on_its_rank_only() -> None:
    x = torch.randn(4, 6)
    fault = Fault.parse("gemm_corrupt@3:rank=1:bit=30")
    outputs: dict[int, list[torch.Tensor]] = {}
    for rank in (0, 1):
        model = _model()
        injector = Injector([fault], rank=rank)
        injector.attach(model)
        outputs[rank] = []
        for step in range(5):
            injector.begin_step(step)
            with torch.no_grad():
                outputs[rank].append(model(x))
    for step in range(5):
        same = torch.equal(outputs[0][step], outputs[1][step])
        assert same == (step != 3), step
    assert not torch.isclose(outputs[0][3], outputs[1][3]).all(), "one output element of one layer corrupted changes the result"


def test_duplicated_data_reads_the_next_ranks_shard_from_its_step() -> None:
    injector = Injector([Fault.parse("duplicate_data@4:rank=3")], rank=3)
    injector.begin_step(3)
    assert injector.reads_shard_of(4) is None
    injector.begin_step(4)
    assert injector.reads_shard_of(4) == 0, "rank 3 of 4 reads rank 0's batches"
    other = Injector([Fault.parse("duplicate_data@4:rank=3")], rank=2)
    other.begin_step(4)
    assert other.reads_shard_of(4) is None


def test_faults_on_optimizer_state_need_the_optimizer() -> None:
    with pytest.raises(ValueError, match="need attach"):
        Injector([Fault.parse("skip_step@2:rank=0")], rank=0).attach(_model())
