"""The replica fingerprint's digest against an independent host reference, and its promise:
every single-bit flip of a parameter, in every bit of float32, bfloat16, float16 and float64,
changes the digest of the whole model and of the block that holds it; the digest of equal
weights does not depend on their memory layout; and it stays off where the ranks are not
replicas. The twins (the same job watched, fingerprint on, and unwatched, over 4 gloo processes,
bit-identical) are test_twins.py's."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwatch.fingerprint import MASK, FingerprintProbe, bit_sum

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def reference_sum(t: torch.Tensor) -> int:
    """S from the tensor's bytes, in Python integers: the sum of its signed words (the element's
    width, or 32-bit halves of 8-byte elements), wrapped to a signed word."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    width = 4 if t.element_size() == 8 else t.element_size()
    words = np.frombuffer(raw, dtype={1: "<i1", 2: "<i2", 4: "<i4"}[width])
    half = 1 << (8 * width - 1)
    return (int(sum(int(w) for w in words)) + half) % (2 * half) - half


def reference_digest(tensors: list[torch.Tensor], positions: list[int], power: int = 1) -> int:
    """D (power 1) or the locator L (power 2): Σ S_i·(2i+1)^power mod 2^52."""
    return sum(reference_sum(t) * (2 * i + 1) ** power for t, i in zip(tensors, positions, strict=True)) % (1 << 64) & MASK


def flip(t: torch.Tensor, element: int, bit: int) -> None:
    """Flips `bit` of element `element` (flat, in memory order) of contiguous `t`, in place."""
    raw = t.view(torch.uint8).view(-1)
    at = element * t.element_size() + bit // 8  # little-endian
    raw[at] ^= 1 << (bit % 8)


def model_tensors(seed: int) -> tuple[list[torch.Tensor], list[int | None]]:
    g = torch.Generator().manual_seed(seed)
    tensors = [(torch.randn(5, 7, generator=g) * 10 ** float(i % 5 - 2)).to(DTYPES[i % 4]) for i in range(9)]
    tensors.append(torch.randn(6, 4, generator=g).t())  # not contiguous
    blocks = [None, 0, 0, 1, None, 1, 2, 2, None, 0]
    return tensors, blocks


def test_the_digest_is_the_reference_for_the_model_and_each_block() -> None:
    tensors, blocks = model_tensors(0)
    model, locator, per_block = FingerprintProbe(tensors, blocks, 3).compute()
    assert model.dtype == torch.float64 and locator.dtype == torch.float64 and per_block.shape == (3,)
    assert int(model.item()) == reference_digest(tensors, list(range(len(tensors))))
    assert int(locator.item()) == reference_digest(tensors, list(range(len(tensors))), power=2)
    assert 0 <= locator.item() < 2**52 and float(int(locator.item())) == locator.item()
    for b in range(3):
        members = [i for i, owner in enumerate(blocks) if owner == b]
        assert int(per_block[b].item()) == reference_digest([tensors[i] for i in members], members), b
    assert 0 <= model.item() < 2**52 and float(int(model.item())) == model.item(), "an integer, exact in a float64"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bit_of_every_dtype_flipped_changes_the_digest(dtype: torch.dtype) -> None:
    tensors, blocks = model_tensors(1)
    tensors = [t.contiguous().to(dtype) for t in tensors]
    probe = FingerprintProbe(tensors, blocks, 3)
    model, locator, per_block = (v.clone() for v in probe.compute())
    g = torch.Generator().manual_seed(2)
    for bit in range(8 * tensors[0].element_size()):
        which = int(torch.randint(len(tensors), (1,), generator=g))
        element = int(torch.randint(tensors[which].numel(), (1,), generator=g))
        flip(tensors[which], element, bit)
        flipped_model, flipped_locator, flipped_blocks = probe.compute()
        assert flipped_model != model, (bit, which, element)
        positions = list(range(len(tensors)))
        assert int(flipped_locator.item()) == reference_digest(tensors, positions, power=2) and flipped_locator != locator
        owner = blocks[which]
        for b in range(3):
            assert (flipped_blocks[b] != per_block[b]) == (b == owner), (bit, which, b)
        flip(tensors[which], element, bit)
        again, again_locator, _ = probe.compute()
        assert again == model and again_locator == locator, "flipped back, the digest is back"


@settings(max_examples=200, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    position=st.integers(0, 5),
    data=st.data(),
)
def test_random_single_bit_flips_are_always_seen(dtype: torch.dtype, shape: tuple[int, int], position: int, data: st.DataObject) -> None:
    torch.manual_seed(position)
    tensors = [torch.randn(shape).to(dtype) for _ in range(6)]
    probe = FingerprintProbe(tensors, [None] * 6, 0)
    before, _, _ = probe.compute()
    element = data.draw(st.integers(0, tensors[position].numel() - 1))
    bit = data.draw(st.integers(0, 8 * tensors[position].element_size() - 1))
    flip(tensors[position], element, bit)
    after, locator, _ = probe.compute()
    assert after != before
    assert int(after.item()) == reference_digest(tensors, list(range(6)))
    assert int(locator.item()) == reference_digest(tensors, list(range(6)), power=2)


def test_equal_weights_in_another_memory_layout_give_the_same_digest() -> None:
    weight = torch.randn(8, 5)
    transposed_storage = weight.t().contiguous().t()  # equal values, column-major memory
    assert not transposed_storage.is_contiguous() and torch.equal(transposed_storage, weight)
    assert bit_sum(transposed_storage) == bit_sum(weight)
    channels_last = torch.randn(2, 3, 4, 5)
    assert bit_sum(channels_last.to(memory_format=torch.channels_last)) == bit_sum(channels_last)


def test_no_host_sync_on_meta_tensors() -> None:
    """Meta tensors have no data: any .item(), int() or branch on a value would raise."""
    with torch.device("meta"):
        tensors = [torch.zeros(4, 4), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.float64)]
    model, locator, blocks = FingerprintProbe(tensors, [0, None, 0], 1).compute()
    assert model.device.type == "meta" and locator.device.type == "meta" and blocks.device.type == "meta" and blocks.shape == (1,)


def test_the_optimizer_state_digest_sees_a_flip_in_a_moment_and_equal_states_agree() -> None:
    """Two replicas stepped with the same gradients hold equal Adam states, so equal digests; a
    bit flipped in one exp_avg_sq changes the digest and the locator; both are the host
    reference over the state tensors, the k-th state tensor (keys sorted) of the i-th parameter
    at position 8i + k; only the tensors on the device asked for."""
    from rankwatch.fingerprint import digest, optimizer_state

    def replica() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    x = torch.randn(8, 4)
    states = []
    for model, optimizer in (replica(), replica()):
        for _ in range(3):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        states.append(optimizer)
    cpu = torch.device("cpu")
    (a, at), (b, bt) = (optimizer_state(o, cpu) for o in states)
    assert len(a) == 3 * 4, "exp_avg, exp_avg_sq and step for each of 4 parameters"
    assert at == bt == [8 * i + k for i in range(4) for k in range(3)], at
    assert digest(a, at, cpu) == digest(b, bt, cpu)
    d, locator = digest(a, at, cpu)
    assert int(d.item()) == reference_digest(a, at) and int(locator.item()) == reference_digest(a, at, power=2)
    second = states[1].state[next(iter(states[1].state))]["exp_avg_sq"]
    flip(second, 0, 3)
    flipped = digest(*optimizer_state(states[1], cpu), cpu)
    assert flipped[0] != d and flipped[1] != locator
    assert optimizer_state(states[0], torch.device("meta")) == ([], []), "only the state on the given device"


@pytest.mark.parametrize("local_sgd", [False, True], ids=["plain-ddp", "post-local-sgd"])
def test_post_local_sgd_replicas_are_not_compared(one_rank_group: None, tmp_path: Path, local_sgd: bool) -> None:
    """Post-local SGD stops averaging gradients and averages the models every k steps: its
    replicas differ by design in between, so the fingerprint is off there and says so (a false
    critical alert otherwise); plain DDP reports it."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

    import rankwatch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if local_sgd:
        ddp.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD, start_localSGD_iter=2), post_localSGD_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    run = rankwatch.init(run="local-sgd", mode="offline", spool_dir=tmp_path, every={"fingerprint": 1})
    run.watch(ddp, optimizer)
    run.world_size = 2  # one process stands for the replicas, as in test_host_sync
    run._watch_fingerprint(model, run._layout, sharded=False, ddp=ddp, optimizer=optimizer)
    run._fingerprint.checked = ddp  # type: ignore[union-attr]  # its group of one stands for the replicas: not checked against the run
    for step in range(3):
        ddp(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        run.log(step)
    tags, names = dict(run.tags), {k[0] for k in run.last_values}
    run.finish(timeout=5)
    if local_sgd:
        assert "param_fingerprint" not in names
        assert cast(str, tags["replica_fingerprint"]).startswith("off: post-local SGD averages the replicas only every k steps"), tags
    else:
        assert "param_fingerprint" in names and "replica_fingerprint" not in tags


def test_a_ddp_group_that_is_not_the_runs_replicas_turns_the_fingerprint_off(one_rank_group: None, tmp_path: Path) -> None:
    """A wrapper over a sub-group (a pipeline stage's, a tensor-parallel shard's) found after the
    run was named for the whole world would compare ranks that are not replicas: off, and said."""
    import rankwatch

    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    run = rankwatch.init(run="sub-group", mode="offline", spool_dir=tmp_path, every={"fingerprint": 1})
    run.watch(ddp, optimizer)
    run.world_size = 2  # the run counts two ranks, the DDP group one
    run._watch_fingerprint(model, run._layout, sharded=False, ddp=ddp, optimizer=optimizer)
    for step in range(2):
        ddp(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        run.log(step)
    tags, names = dict(run.tags), {k[0] for k in run.last_values}
    run.finish(timeout=5)
    assert "param_fingerprint" not in names
    assert cast(str, tags["replica_fingerprint"]).startswith("off: the DDP group has 1 ranks but the run 2"), tags


def test_random_bit_flips_are_named_with_rank_and_tensor_under_ddp_bf16_and_hsdp(tmp_path: Path) -> None:
    """The fast subset of `cargo xtask bench detection --suite flips`: 4 gloo ranks through the
    real agent to a real collector, a random bit of a random tensor flipped on one rank in each
    window (bf16 DDP with an ignored parameter, float32 HSDP over a 2 × 2 mesh), fingerprint
    every 2nd step: each flip still present at the next fingerprint is named there with its
    rank(s) and tensor, flips of the DDP-ignored parameter raise nothing, nothing else fires."""
    import json
    import os
    import subprocess
    import sys

    if not os.environ.get("RANKWATCH_BIN"):
        pytest.skip("RANKWATCH_BIN (the collector binary) is not set")
    bench = Path(__file__).resolve().parents[2] / "bench" / "replica_flips.py"
    out = tmp_path / "flips"
    done = subprocess.run(
        [sys.executable, str(bench), "--layouts", "ddp-bf16,hsdp-fp32", "--flips", "6", "--every", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = json.loads((out / "flips.json").read_text())["results"]
    for r in results:
        assert r["flips"] == 6 and r["to_name"] >= 4, r["layout"]
        assert r["named"] == r["to_name"] and r["missed"] == r["misnamed"] == 0, (r["layout"], [row["explanations"] for row in r["rows"]])
        assert r["false_alerts"] == 0 and r["ignored_alerts"] == 0 and r["rounded_away_alerts"] == 0, r["layout"]
        assert r["delay_max"] <= 1, "flipped within the interval before the fingerprint"
    ddp = next(r for r in results if r["layout"] == "ddp-bf16")
    assert ddp["ignored_flips"] == 8 and ddp["ignored_tag"] == "transformer.wpe.weight", ddp["ignored_tag"]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
