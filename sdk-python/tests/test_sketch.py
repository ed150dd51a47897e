"""The SDK's CountSketch coordinates are analytics' definition (`math/sketch.rs`), bit for bit.

The Rust crate pins hash32(42, i) for five 64-bit coordinates; i = (parameter << 32) | offset in
the SDK. With a sketch dimension of 2^31 the bucket is the hash's low 31 bits and the sign its
top bit, so the pins fix both. The chunked, in-place computation must also agree with itself
across chunk boundaries and for explicit shard coordinates.
"""

from __future__ import annotations

import torch

from rankwatch import gradients
from rankwatch.gradients import countsketch_coordinates

PINNED = {0: 0x837B1BE9, 1: 0x9B17D22B, 2: 0x98A8D0F2, 1 << 32: 0x5F27E438, (1 << 64) - 1: 0xC4443598}


def test_coordinates_reproduce_the_pinned_hashes() -> None:
    for index, h in PINNED.items():
        block, offset = index >> 32, index & 0xFFFFFFFF
        target, sign = countsketch_coordinates(42, block, 1, 1 << 31, torch.device("cpu"), torch.tensor([offset]))
        assert int(target[0]) == h & 0x7FFFFFFF, hex(index)
        assert int(sign[0]) == (-1 if h >= 1 << 31 else 1), hex(index)


def test_chunks_and_shard_indices_agree_with_the_whole(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    whole = countsketch_coordinates(7, 3, 10_000, 1000, torch.device("cpu"))
    monkeypatch.setattr(gradients, "_HASH_CHUNK", 999)  # chunk edges inside the range
    chunked = countsketch_coordinates(7, 3, 10_000, 1000, torch.device("cpu"))
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    picked = torch.tensor([0, 998, 999, 5000, 9999])
    shard = countsketch_coordinates(7, 3, 5, 1000, torch.device("cpu"), picked)
    assert torch.equal(shard[0], whole[0][picked]) and torch.equal(shard[1], whole[1][picked])
    assert int(whole[0].max()) < 1000 and set(whole[1].tolist()) == {-1, 1}
