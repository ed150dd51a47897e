"""The GPU suite (`cargo xtask gpu`): what only a GPU can show, on a machine that has one.

1. No host syncs: three full training steps with every probe due (gradient statistics with dot
   mode and sketch, activations, spectral, the report) under
   `torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronizing call (after
   two unwatched steps: DDP syncs once itself, rebuilding its buckets at the second forward).
2. The same step under `TORCH_CUDA_SANITIZER=1` (CSAN: unsynchronized cross-stream access
   raises), in a subprocess because the sanitizer must be on before CUDA starts.
3. Spectral accuracy in bf16: σ of random 4096×14336 and 14336×4096 bf16 weights (Llama-3-8B
   MLP shapes) and σ_mlp of the pair, by the probe (30 cold iterations, then 5 warm calls)
   against `torch.linalg.matrix_norm(ord=2)` of the same bf16 values in float32.
3c. The effective rank in bf16: the probe's estimate (64 Rademacher probes, 3 seeds) of the
   participation ratio of a Llama-3-8B-shaped block's linearised map (d 4096, d_ff 14336,
   GQA 32/8 heads) against the float64 SVD of the map formed explicitly from the same bf16
   values, and the GPU time of one probe call with and without it.
3b. The fused Triton sketch (rankwatch/_sketch_triton.py) against the reference definition
   on sizes, dtypes, dimensions and shard coordinates, and both timed on 100M coordinates.
4. Per-probe step overhead and max_memory_allocated (bench/probe_costs.py) on GPT-2-small in
   float32 and on a ~1B-parameter Llama in bf16, random init. Targets: ≤ 1 % and ≤ 2 % in total
   at the default cadence.

Prints Markdown tables; record them in docs/performance.md with the machine they ran on. A
part that fails is reported and the others still run; the exit status says how many failed.
On a GPU machine without a Rust toolchain: build the native module in release elsewhere
(`maturin build --release` in sdk-python/), put its `_native.abi3.so` in sdk-python/rankwatch/,
and run `PYTHONPATH=sdk-python:sdk-python/testkit python3 bench/gpu_suite.py`.
Never part of CPU CI: without CUDA it stops with a message. `--dry-run` runs parts 3 and 4 on
CPU at toy sizes, to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from collections.abc import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sdk-python"))
sys.path.insert(0, str(ROOT / "bench"))


def full_step(device: str, strict: bool = False) -> str:
    """Three steps of a small GPT with every probe due. With `strict`, the steps (not the setup,
    not finish(), which waits for the last report on purpose) run under sync-debug "error"."""
    import torch
    import torch.distributed as dist

    import rankwatch
    from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

    if not dist.is_initialized():
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(n_layer=4, n_head=4, n_embd=256, vocab_size=1024, block_size=128)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    x = torch.randint(0, 1024, (8, 128), device=device)
    # Two unwatched steps first: DDP itself synchronises once, when it rebuilds its buckets at
    # the second forward (`Reducer._rebuild_buckets`), and that is not the agent's to answer for.
    for _ in range(2):
        ddp(x, torch.roll(x, -1, 1))[1].backward()
        optimizer.zero_grad(set_to_none=True)
    run = rankwatch.init(run="gpu-suite", mode="offline", spool_dir=tempfile.mkdtemp(prefix="rw-gpu-"), every=1)
    run.watch(ddp, optimizer)
    if strict:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):  # cold spectral start, then warm; reports read back on later steps
            _, loss = ddp(x, torch.roll(x, -1, 1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.log(step, loss=loss.detach(), tokens=x.numel())
    finally:
        if strict:
            torch.cuda.set_sync_debug_mode(0)
    run.finish(timeout=10)
    return ", ".join(sorted({k[0] for k in run.last_values}))


def sync_debug() -> str:
    names = full_step("cuda", strict=True)
    return f"ok: no synchronizing call in 3 full steps with every probe due; reported {names}"


def sanitizer() -> str:
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    code = "import sys; sys.path[:0] = sys.argv[1:]; import gpu_suite; print(gpu_suite.full_step('cuda'))"
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench"), str(ROOT / "sdk-python")], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        return f"FAILED (exit {out.returncode}):\n{out.stderr[-4000:]}"
    return "ok: no data race reported by CSAN"


def spectral_accuracy(device: str, dry_run: bool) -> str:
    import torch

    from rankwatch.discovery import Block, Layout
    from rankwatch.spectral import SpectralProbe

    d, f = (256, 896) if dry_run else (4096, 14336)
    generator = torch.Generator(device="cpu").manual_seed(0)
    def weight(out: int, inp: int) -> torch.Tensor:
        # A Gaussian bulk plus four larger directions, as trained weights have (a pure
        # Gaussian's top gap is tiny and would measure the iteration count, not the arithmetic).
        bulk = torch.randn(out, inp, generator=generator) * 0.02
        u = torch.linalg.qr(torch.randn(out, 4, generator=generator))[0]
        v = torch.linalg.qr(torch.randn(inp, 4, generator=generator))[0]
        spikes = torch.tensor([3.0, 2.2, 1.8, 1.5]) * 0.02 * (out**0.5 + inp**0.5)
        return (bulk + u @ torch.diag(spikes) @ v.T).to(device, torch.bfloat16)

    up, down = weight(f, d), weight(d, f)
    block = Block(index=0, module=torch.nn.Identity(), matrices={"up": lambda: up, "down": lambda: down})
    probe = SpectralProbe(Layout("bench", [block]))
    for _ in range(6):
        got = {(m, s): float(v) for m, _, s, v in probe.compute()}
    rows = ["| quantity | probe | torch.linalg.matrix_norm(ord=2) | relative error |", "|---|---|---|---|"]
    references = {
        ("spectral.sigma", "up"): torch.linalg.matrix_norm(up.float(), ord=2),
        ("spectral.sigma", "down"): torch.linalg.matrix_norm(down.float(), ord=2),
        ("spectral.mlp", None): torch.linalg.matrix_norm(down.float() @ up.float(), ord=2),
    }
    for key, ref in references.items():
        value, want = got[key], float(ref)
        shape = {"up": f"{f}x{d}", "down": f"{d}x{f}", None: f"{d}x{f} · {f}x{d}"}[key[1]]
        rows.append(f"| {key[0]} {key[1] or ''} ({shape}) | {value:.6g} | {want:.6g} | {abs(value / want - 1):.2e} |")
    return "\n".join(rows)


def effective_rank_accuracy(device: str, dry_run: bool) -> str:
    """The effective rank's estimate against float64 singular values, and its GPU time."""
    import torch

    from rankwatch.discovery import AttentionShape, Block, Layout
    from rankwatch.spectral import SpectralProbe

    d, f, heads, kv, head_dim = (256, 896, 8, 2, 32) if dry_run else (4096, 14336, 32, 8, 128)
    generator = torch.Generator(device="cpu").manual_seed(1)

    def weight(out: int, inp: int, spike: float) -> torch.Tensor:
        # Gaussian bulk at a trained scale plus a few larger directions (see spectral_accuracy).
        bulk = torch.randn(out, inp, generator=generator) * (0.5 / inp**0.5)
        u = torch.linalg.qr(torch.randn(out, 4, generator=generator))[0]
        v = torch.linalg.qr(torch.randn(inp, 4, generator=generator))[0]
        return (bulk + spike * u @ torch.diag(torch.tensor([1.0, 0.7, 0.5, 0.3])) @ v.T).to(device, torch.bfloat16)

    w = {"q": weight(heads * head_dim, d, 1.0), "k": weight(kv * head_dim, d, 1.0), "v": weight(kv * head_dim, d, 2.0),
         "o": weight(d, heads * head_dim, 2.0), "up": weight(f, d, 2.0), "down": weight(d, f, 4.0)}
    block = Block(index=0, module=torch.nn.Identity(), matrices={s: cast("Callable[[], torch.Tensor]", lambda t=t: t) for s, t in w.items()},
                  attention=AttentionShape(n_heads=heads, n_kv_heads=kv, head_dim=head_dim))
    # Reference: L = (I + W_down W_up)(I + W_o R W_v) formed in float64 from the same bf16 values.
    w64 = {s: t.double() for s, t in w.items()}
    replicated_v = w64["v"].reshape(kv, head_dim, d).repeat_interleave(heads // kv, dim=0).reshape(heads * head_dim, d)
    eye = torch.eye(d, dtype=torch.float64, device=device)
    linear = (eye + w64["down"] @ w64["up"]) @ (eye + w64["o"] @ replicated_v)
    s = torch.linalg.svdvals(linear)
    want = float(s.square().sum().square() / s.pow(4).sum())
    del linear, w64, eye
    rows = [f"float64 SVD of the {d}×{d} map: effective rank {want:.2f}\n",
            "| probes | seed | estimate | relative error |", "|---|---|---|---|"]
    errors = []
    for seed in range(3):
        probe = SpectralProbe(Layout("bench", [block]), seed=seed)
        got = next(float(v) for m, _, _, v in probe.compute() if m == "effective_rank")
        errors.append(abs(got / want - 1))
        rows.append(f"| {probe.erank_probes} | {seed} | {got:.2f} | {errors[-1]:.2e} |")
    timings = {}
    for label, probes in [("with effective rank (64 probes)", 64), ("without (effective_rank_probes=0)", 0)]:
        probe = SpectralProbe(Layout("bench", [block]), erank_probes=probes)
        probe.compute()  # the cold start
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                probe.compute()
            end.record()
            torch.cuda.synchronize()
            timings[label] = (start.elapsed_time(end) / 5, (torch.cuda.max_memory_allocated() - base) / 2**20)
        else:
            started = time.perf_counter()
            probe.compute()
            timings[label] = ((time.perf_counter() - started) * 1e3, float("nan"))
    rows.append("\n| one warm probe call, one block | ms (GPU time, mean of 5) | peak temporary memory MB |\n|---|---|---|")
    rows += [f"| {label} | {ms:.2f} | {mb:.1f} |" for label, (ms, mb) in timings.items()]
    return "\n".join(rows)


def fused_sketch() -> str:
    """The fused Triton sketch against the reference (hashed coordinates, then index_add_ in
    float64), on sizes, dtypes, dimensions and shard coordinates a run meets; then both timed
    on one large bf16 gradient."""
    import torch
    from gpu_sketch_sweep import timed
    from rankwatch_testkit.sketch import fused_error

    from rankwatch import sketch_kernel
    from rankwatch.gradients import GradientProbe

    fused = sketch_kernel.load()
    if fused is None:
        raise RuntimeError("Triton could not be imported: the fused sketch is unavailable")
    device = torch.device("cuda")
    generator = torch.Generator(device="cpu").manual_seed(3)
    rows = [f"fused kernel: {sketch_kernel.describe()}\n", "| n | dtype | dim | coordinates | max abs error / max abs bucket |", "|---|---|---|---|---|"]
    worst = 0.0
    for n, dtype, dim, how in [
        (1, torch.float32, 1024, "0..n"), (1023, torch.bfloat16, 1024, "0..n"), (1_000_003, torch.float16, 1024, "0..n"),
        (4_000_000, torch.bfloat16, 1000, "0..n"), (2_000_000, torch.float32, 1024, "base 12345"),
        (300_000, torch.bfloat16, 1024, "indices"), (50_000_000, torch.bfloat16, 1024, "0..n"),
    ]:
        values = torch.randn(n, generator=generator).to(device, dtype)
        base = 12345 if how.startswith("base") else 0
        indices = torch.randperm(10 * n, generator=generator)[:n].to(device) if how == "indices" else None
        error = fused_error(fused, values, 5, 7, dim, indices, base)
        worst = max(worst, error)
        rows.append(f"| {n:,} | {str(dtype).removeprefix('torch.')} | {dim} | {how} | {error:.1e} |")
    if worst > 1e-5:
        raise AssertionError("\n".join(rows) + f"\nthe fused sketch differs from the reference by {worst:.1e} > 1e-5")
    # Timing: one 100M-coordinate bf16 gradient, reference (uncached: hashed every time) vs fused.
    big = torch.randn(100_000_000, device=device, dtype=torch.bfloat16)
    param = torch.nn.Parameter(torch.zeros(1, device=device))
    timings = {}
    for name, use_fused in [("reference (hashes every call)", False), ("fused", True)]:
        probe = GradientProbe([param], fused=use_fused, cache_bytes=0)
        target = torch.zeros(2 * 1024, dtype=torch.float32, device=device)
        timings[name] = timed(cast("Callable[[], object]", lambda probe=probe, target=target: probe._sketch_into(target, 0, big)), reps=5)
        probe.remove()
    rows.append("\n| sketch of 100M bf16 coordinates | ms (GPU time, mean of 5) |\n|---|---|")
    rows += [f"| {name} | {ms:.2f} |" for name, ms in timings.items()]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dry-run", action="store_true", help="parts 3 and 4 on CPU at toy sizes")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    import torch

    from probe_costs import measure, table

    if args.dry_run:
        print("## spectral accuracy (dry run, CPU, 256x896)\n")
        print(spectral_accuracy("cpu", True))
        print("\n## effective rank (dry run, CPU)\n")
        print(effective_rank_accuracy("cpu", True))
        print(table(measure("tiny", "cpu", "float32", 2, 1, 1), "per-probe cost (dry run)"))
        return
    if not torch.cuda.is_available():
        sys.exit("cargo xtask gpu needs a CUDA GPU (torch.cuda.is_available() is False); the CPU suites are `cargo xtask test`")
    print(f"# GPU suite on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    parts = [
        ("1. host syncs under set_sync_debug_mode('error')", sync_debug),
        ("2. CUDA sanitizer (TORCH_CUDA_SANITIZER=1)", sanitizer),
        ("3. spectral accuracy, bf16 Llama-3-8B MLP shapes", lambda: spectral_accuracy("cuda", False)),
        ("3c. effective rank in bf16, Llama-3-8B block shapes", lambda: effective_rank_accuracy("cuda", False)),
        ("3b. fused sketch kernel against the reference", fused_sketch),
        ("4a. per-probe cost, GPT-2-small float32 on CUDA", lambda: table(measure("gpt2-small", "cuda", "float32", args.steps, 5, 3), "per-probe cost")),
        ("4b. per-probe cost, ~1B Llama bf16 on CUDA", lambda: table(measure("llama-1b", "cuda", "bfloat16", args.steps, 5, 3), "per-probe cost")),
    ]
    failed = 0
    for title, part in parts:
        # One part's failure is reported and the rest still run: a GPU is lent for minutes,
        # and each part answers a different question.
        print(f"\n## {title}\n", flush=True)
        started = time.perf_counter()
        try:
            print(part())
        except Exception:  # noqa: BLE001 - reported, and the exit status says so
            failed += 1
            print(f"FAILED:\n```\n{traceback.format_exc()[-4000:]}```")
        torch.cuda.empty_cache()
        print(f"\n({time.perf_counter() - started:.0f} s)", flush=True)
    if failed:
        sys.exit(f"{failed} part(s) of the GPU suite failed")


if __name__ == "__main__":
    main()
