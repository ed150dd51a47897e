"""The count sketch's hashing: each gradient coordinate's bucket and sign, from the run's
shared seed, the parameter's index and the coordinate's index.

The definition is analytics' `math/sketch.rs`; both sketch paths compute it from here (the
reference one in `gradients`, the fused Triton kernel in `_sketch_triton`), which is why this
sits below both: it imports neither.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["countsketch_coordinates", "sketch_keys"]

_MASK32 = 0xFFFFFFFF


def _fmix32(h: Any) -> Any:
    """murmur3's 32-bit finaliser on values in [0, 2^32): Python ints or int64 tensors (the
    products may wrap in int64, which leaves the low 32 bits that the mask keeps exact)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def _fmix32_(h: torch.Tensor) -> torch.Tensor:
    """`_fmix32` in place on an int64 tensor of values in [0, 2^32)."""
    h.bitwise_xor_(h >> 16)
    h.mul_(0x85EBCA6B).bitwise_and_(_MASK32)
    h.bitwise_xor_(h >> 13)
    h.mul_(0xC2B2AE35).bitwise_and_(_MASK32)
    return h.bitwise_xor_(h >> 16)


_HASH_CHUNK = 1 << 20  # coordinates hashed at a time: the temporaries stay in cache


def sketch_keys(seed: int, block: int) -> tuple[int, int]:
    """The two 32-bit words that, with a coordinate's index, make its hash: the run's key (from
    the shared seed) and parameter `block`'s index. Both sketch paths start from these."""
    return _fmix32((seed ^ 0x9E3779B9) & _MASK32), block & _MASK32


def countsketch_coordinates(seed: int, block: int, n: int, dim: int, device: torch.device, indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Output bucket (int32) and sign (int8) of coordinates 0..n of gradient block `block` (a
    parameter), or of the flat `indices` of it (a shard's coordinates in the whole parameter).
    The definition is analytics' `math/sketch.rs`; this computes it a chunk at a time, in place."""
    key, hi = sketch_keys(seed, block)
    target = torch.empty(n, dtype=torch.int32, device=device)
    sign = torch.empty(n, dtype=torch.int8, device=device)
    for start in range(0, n, _HASH_CHUNK):
        stop = min(n, start + _HASH_CHUNK)
        if indices is None:
            h = torch.arange(start, stop, device=device, dtype=torch.int64)
        else:
            h = indices[start:stop].to(torch.int64, copy=True)
        h.bitwise_xor_(key)
        _fmix32_(h).bitwise_xor_(hi).add_(key).bitwise_and_(_MASK32)
        _fmix32_(h)
        negative = h >= 0x80000000
        sign[start:stop] = 1 - 2 * negative.to(torch.int8)
        bucket = h.bitwise_and_(0x7FFFFFFF)
        target[start:stop] = bucket.bitwise_and_(dim - 1) if dim & (dim - 1) == 0 else bucket.remainder_(dim)
    return target, sign
