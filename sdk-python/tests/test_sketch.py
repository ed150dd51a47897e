"""The SDK's CountSketch coordinates are analytics' definition (`math/sketch.rs`), bit for bit.

The Rust crate pins hash32(42, i) for five 64-bit coordinates; i = (parameter << 32) | offset in
the SDK. With a sketch dimension of 2^31 the bucket is the hash's low 31 bits and the sign its
top bit, so the pins fix both. The chunked, in-place computation must also agree with itself
across chunk boundaries and for explicit shard coordinates.
"""

from __future__ import annotations

import torch

from rankwatch import countsketch
from rankwatch.countsketch import countsketch_coordinates

PINNED = {0: 0x837B1BE9, 1: 0x9B17D22B, 2: 0x98A8D0F2, 1 << 32: 0x5F27E438, (1 << 64) - 1: 0xC4443598}


def test_coordinates_reproduce_the_pinned_hashes() -> None:
    for index, h in PINNED.items():
        block, offset = index >> 32, index & 0xFFFFFFFF
        target, sign = countsketch_coordinates(42, block, 1, 1 << 31, torch.device("cpu"), torch.tensor([offset]))
        assert int(target[0]) == h & 0x7FFFFFFF, hex(index)
        assert int(sign[0]) == (-1 if h >= 1 << 31 else 1), hex(index)


def test_chunks_and_shard_indices_agree_with_the_whole(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    whole = countsketch_coordinates(7, 3, 10_000, 1000, torch.device("cpu"))
    monkeypatch.setattr(countsketch, "_HASH_CHUNK", 999)  # chunk edges inside the range
    chunked = countsketch_coordinates(7, 3, 10_000, 1000, torch.device("cpu"))
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])
    picked = torch.tensor([0, 998, 999, 5000, 9999])
    shard = countsketch_coordinates(7, 3, 5, 1000, torch.device("cpu"), picked)
    assert torch.equal(shard[0], whole[0][picked]) and torch.equal(shard[1], whole[1][picked])
    assert int(whole[0].max()) < 1000 and set(whole[1].tolist()) == {-1, 1}


_FUSED_CHECK = r"""
import json, torch
from rankwatch import _sketch_triton
from rankwatch_testkit.sketch import fused_error
torch.manual_seed(0)
errors = []
for n, dtype, dim, how in [(1, torch.float32, 1024, "range"), (1023, torch.bfloat16, 1024, "range"), (5000, torch.float32, 1024, "range"),
                           (3001, torch.bfloat16, 1000, "range"), (20000, torch.float16, 1024, "base"), (2000, torch.float32, 1024, "indices")]:
    values = torch.randn(n).to(dtype)
    block = (1 << 32) + 9  # only the low 32 bits of a parameter index count, as in the reference
    base = 777 if how == "base" else 0
    indices = torch.randperm(10 * n)[:n] if how == "indices" else None
    errors.append(fused_error(_sketch_triton.sketch, values, 3, block, dim, indices, base))
print(json.dumps(errors))
"""


def test_the_fused_gpu_kernel_is_the_reference_sketch_under_tritons_interpreter() -> None:
    """The CUDA path (`rankwatch/_sketch_triton.py`) on CPU: Triton's interpreter runs the kernel
    with numpy, so its hashing, folding and offsets are checked against the reference here; a
    GPU runs it compiled in `cargo xtask gpu` (part 3b). In a subprocess: the interpreter must
    be chosen before Triton is imported."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("triton") is None:
        import pytest

        pytest.skip("Triton is not installed (a CPU-only torch); `cargo xtask gpu` checks the kernel on a GPU")
    sdk = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([sdk, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _FUSED_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    errors = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(errors) == 6 and max(errors) < 1e-6, errors
