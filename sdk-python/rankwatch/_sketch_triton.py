"""The fused CountSketch kernel (see `sketch_kernel` for why). Imported only where Triton is:
Triton resolves a kernel's helpers among its module's globals, so they live here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .countsketch import sketch_keys

BLOCK = 1024  # coordinates a program sketches
# Private copies of the sketch the programs spread their atomic adds over. Swept on an H200
# (100M bf16 coordinates): 8 copies 1.43 ms, 32 1.22, 128 1.05, 512 and 2048 no faster; a
# 4096-coordinate block was no faster than 1024 at any count.
COPIES = 128


@triton.jit
def _fmix32_device(h):  # type: ignore[no-untyped-def]
    # murmur3's finaliser on int64 values in [0, 2^32), as `countsketch._fmix32_`.
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@triton.jit(do_not_specialize=["n", "base", "key", "hi"])
def _sketch_kernel(values, indices, out, n, base, key, hi, dim,  # type: ignore[no-untyped-def]
                   HAS_INDICES: tl.constexpr, POW2: tl.constexpr, COPIES: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    if HAS_INDICES:
        h = tl.load(indices + offs, mask=inside, other=0).to(tl.int64)
    else:
        h = offs + base
    h = _fmix32_device(h ^ key)
    h = _fmix32_device(((h ^ hi) + key) & 0xFFFFFFFF)
    bucket = h & 0x7FFFFFFF
    if POW2:
        bucket = bucket & (dim - 1)
    else:
        bucket = bucket % dim
    folded = bucket + tl.where(h >= 0x80000000, dim, 0)
    v = tl.load(values + offs, mask=inside, other=0.0).to(tl.float32)
    slot = (pid % COPIES).to(tl.int64) * 2 * dim + folded
    tl.atomic_add(out + slot, v, mask=inside, sem="relaxed")


def sketch(target: torch.Tensor, values: torch.Tensor, seed: int, block: int, dim: int,
           indices: torch.Tensor | None = None, base: int = 0) -> None:
    """target (float32, 2·dim, folded: bucket + dim where the sign is −1) += the sketch of the
    flat, contiguous `values`: coordinates `base + i` of parameter `block`, or `indices[i]`."""
    n = values.numel()
    if n == 0:
        return
    key, hi = sketch_keys(seed, block)
    copies = torch.zeros(COPIES, 2 * dim, dtype=torch.float32, device=values.device)
    grid = (triton.cdiv(n, BLOCK),)
    _sketch_kernel[grid](values, indices if indices is not None else values, copies, n, base, key, hi, dim,
                         HAS_INDICES=indices is not None, POW2=dim & (dim - 1) == 0, COPIES=COPIES, BLOCK=BLOCK)
    target.add_(copies.sum(0))
