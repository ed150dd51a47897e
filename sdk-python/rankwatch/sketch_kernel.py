"""The CountSketch of a CUDA gradient as one fused Triton kernel.

Why. The reference path (`countsketch.countsketch_coordinates`, then `index_add_`) hashes the
coordinates with some twenty elementwise int64 passes, a chunk at a time, and keeps the result
(4 bytes a coordinate) while it fits a 512 MiB budget. On an H200, for a ~0.85 B-parameter Llama
in bf16 (gradients past the budget, and sketched twice a step: the rank's own and the mean's),
that made a sketch step 430 ms slower than the 72 ms step itself (`cargo xtask gpu`): hundreds
of bytes of memory traffic per coordinate and tens of thousands of kernel launches. Here each
program hashes its block of coordinates in registers, reads the gradient once, and adds each
value into its bucket with an atomic add: one pass over the gradient, no cached coordinates,
no temporaries. Programs write to private copies of the sketch (by program id; 128, by a sweep)
so that the atomics on one bucket do not all queue on one address; the copies are summed after.

The buckets and signs are the reference's, bit for bit: the same int64 arithmetic masked to
32 bits (analytics' `math/sketch.rs` defines it). Only the float32 sums' order differs. Triton
comes with PyTorch's CUDA wheels on Linux; where it is missing (or on CPU), `load()` answers
None and the reference path is used.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

Sketcher = Callable[[torch.Tensor, torch.Tensor, int, int, int, "torch.Tensor | None", int], None]
_warmed: set[tuple[torch.device, torch.dtype]] = set()
_lock = threading.Lock()


@functools.cache
def load() -> Sketcher | None:
    """The fused sketcher, or None where Triton cannot be imported (imported once)."""
    try:
        from ._sketch_triton import sketch
    except Exception:  # noqa: BLE001 - any import failure means: use the reference path
        return None
    return sketch


def warm_up(sketcher: Sketcher, device: torch.device, dtypes: set[torch.dtype], dim: int) -> None:
    """Compiles the kernel for `dtypes` off the training thread (a daemon thread sketches a few
    values on a side stream), so that the first sketch step does not wait a second for Triton."""

    with _lock:
        todo = {dtype for dtype in dtypes if (device, dtype) not in _warmed}
        _warmed.update((device, dtype) for dtype in todo)
    if not todo:
        return

    def compile_all() -> None:
        try:
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            with torch.cuda.stream(stream):
                for dtype in todo:
                    # One value: the kernel is compiled per dtype, not per length.
                    values = torch.zeros(1, dtype=dtype, device=device)
                    target = torch.zeros(2 * dim, dtype=torch.float32, device=device)
                    sketcher(target, values, 0, 0, dim, None, 0)
        except Exception:  # noqa: BLE001 - the training thread compiles on first use instead
            pass

    threading.Thread(target=compile_all, name="rankwatch-sketch-compile", daemon=True).start()


def describe() -> dict[str, Any]:
    """What the fused path is built from (for the GPU suite's table)."""
    try:
        import triton

        from ._sketch_triton import BLOCK, COPIES

        return {"triton": triton.__version__, "block": BLOCK, "copies": COPIES}
    except Exception:  # noqa: BLE001
        return {"triton": None}
