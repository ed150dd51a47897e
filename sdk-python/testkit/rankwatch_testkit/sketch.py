"""The fused GPU sketch against its reference, for the tests (under Triton's interpreter on CPU)
and the GPU suite (compiled, on CUDA)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def fused_error(fused: Callable[..., None], values: torch.Tensor, seed: int, block: int, dim: int,
                indices: torch.Tensor | None = None, base: int = 0) -> float:
    """max |fused − reference| / max |reference| over the folded buckets of `values`' sketch,
    the reference being the hashed coordinates (`countsketch_coordinates`) summed in float64."""
    from rankwatch.countsketch import countsketch_coordinates

    n = values.numel()
    coordinates = indices if indices is not None else torch.arange(base, base + n, device=values.device)
    target, sign = countsketch_coordinates(seed, block, n, dim, values.device, coordinates)
    folded = (target + (sign < 0).to(torch.int32) * dim).long()
    want = torch.zeros(2 * dim, dtype=torch.float64, device=values.device).index_add_(0, folded, values.double())
    got = torch.zeros(2 * dim, dtype=torch.float32, device=values.device)
    fused(got, values, seed, block, dim, indices, base)
    return float((got.double() - want).abs().max() / want.abs().max())
