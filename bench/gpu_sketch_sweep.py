"""On a CUDA machine: the fused sketch kernel's launch shape (block size × private copies) on
bf16 and float32 gradients, and what the gradient probe's norms cost per tensor against one
`torch._foreach_norm`, on gradients shaped like the GPU suite's ~1B Llama. Prints Markdown
tables (docs/performance.md § GPU suite holds the H200's). Run from the repository root:
`PYTHONPATH=sdk-python python3 bench/gpu_sketch_sweep.py`."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sdk-python"))

import torch
import triton
from rankwatch import _sketch_triton as kernel
from rankwatch.countsketch import _fmix32

DIM = 1024


def timed(fn: Callable[[], object], reps: int = 10) -> float:
    """GPU milliseconds per call, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def sweep() -> None:
    device = torch.device("cuda")
    key = int(_fmix32((0 ^ 0x9E3779B9) & 0xFFFFFFFF))
    print("| n | dtype | BLOCK | COPIES | ms | G coordinates/s | max relative difference to the first |")
    print("|---|---|---|---|---|---|---|")
    for n, dtype in [(100_000_000, torch.bfloat16), (11_534_336, torch.bfloat16), (100_000_000, torch.float32)]:
        values = torch.randn(n, device=device, dtype=dtype)
        first = None
        for block in (1024, 4096):
            for copies in (8, 32, 128, 512, 2048):
                out = torch.zeros(copies, 2 * DIM, device=device)

                def sketch(out: torch.Tensor = out, values: torch.Tensor = values, n: int = n, block: int = block, copies: int = copies) -> torch.Tensor:
                    out.zero_()
                    kernel._sketch_kernel[(triton.cdiv(n, block),)](values, values, out, n, 0, key, 3, DIM, HAS_INDICES=False, POW2=True, COPIES=copies, BLOCK=block)
                    return out.sum(0)

                ms = timed(sketch)
                result = sketch().double()
                if first is None:
                    first = result
                difference = float((result - first).abs().max() / first.abs().max())
                print(f"| {n:,} | {str(dtype).removeprefix('torch.')} | {block} | {copies} | {ms:.3f} | {n / ms / 1e6:.1f} | {difference:.1e} |", flush=True)


def norms() -> None:
    device = torch.device("cuda")
    block = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048), (5632, 2048), (5632, 2048), (2048, 5632), (2048,), (2048,)]
    shapes = [(32000, 2048), *block * 16, (2048,), (32000, 2048)]
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]
    print(f"\n{len(grads)} bf16 gradients, {sum(g.numel() for g in grads) / 1e6:.1f}M values\n")
    print("| norms of every gradient | ms |\n|---|---|")
    print(f"| `vector_norm(g, dtype=float32)` per tensor (the hooks') | {timed(lambda: [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]):.3f} |")
    print(f"| `torch._foreach_norm(grads, 2, dtype=float32)` (the end of the backward's) | {timed(lambda: torch._foreach_norm(grads, 2, dtype=torch.float32)):.3f} |")
    started = time.perf_counter()
    for g in grads:
        torch.linalg.vector_norm(g, dtype=torch.float32)
    host = (time.perf_counter() - started) * 1e3
    torch.cuda.synchronize()
    print(f"| host time to launch the per-tensor norms | {host:.3f} |")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    sweep()
    norms()
