"""The GPU suite (`cargo xtask gpu`): what only a GPU can show, on a machine that has one.

1. No host syncs: one full training step with every probe due (gradient statistics with dot
   mode and sketch, activations, spectral, the report) under
   `torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronizing call.
2. The same step under `TORCH_CUDA_SANITIZER=1` (CSAN: unsynchronized cross-stream access
   raises), in a subprocess because the sanitizer must be on before CUDA starts.
3. Spectral accuracy in bf16: σ of random 4096×14336 and 14336×4096 bf16 weights (Llama-3-8B
   MLP shapes) and σ_mlp of the pair, by the probe (30 cold iterations, then 5 warm calls)
   against `torch.linalg.matrix_norm(ord=2)` of the same bf16 values in float32.
4. Per-probe step overhead and max_memory_allocated (bench/probe_costs.py) on GPT-2-small in
   float32 and on a ~1B-parameter Llama in bf16, random init. Targets: ≤ 1 % and ≤ 2 % in total
   at the default cadence.

Prints Markdown tables; record them in docs/architecture.md with the machine they ran on.
Never part of CPU CI: without CUDA it stops with a message. `--dry-run` runs parts 3 and 4 on
CPU at toy sizes, to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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
    run = rankwatch.init(run="gpu-suite", mode="offline", spool_dir=tempfile.mkdtemp(prefix="rw-gpu-"), every=1)
    run.watch(ddp, optimizer)
    x = torch.randint(0, 1024, (8, 128), device=device)
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
        print(table(measure("tiny", "cpu", "float32", 2, 1, 1), "per-probe cost (dry run)"))
        return
    if not torch.cuda.is_available():
        sys.exit("cargo xtask gpu needs a CUDA GPU (torch.cuda.is_available() is False); the CPU suites are `cargo xtask test`")
    print(f"# GPU suite on {torch.cuda.get_device_name()} (torch {torch.__version__})\n")
    print("## 1. host syncs under set_sync_debug_mode('error')\n")
    print(sync_debug())
    print("\n## 2. CUDA sanitizer (TORCH_CUDA_SANITIZER=1)\n")
    print(sanitizer())
    print("\n## 3. spectral accuracy, bf16 Llama-3-8B MLP shapes\n")
    print(spectral_accuracy("cuda", False))
    print(table(measure("gpt2-small", "cuda", "float32", args.steps, 5, 3), "4a. per-probe cost, GPT-2-small float32 on CUDA"))
    print(table(measure("llama-1b", "cuda", "bfloat16", args.steps, 5, 3), "4b. per-probe cost, ~1B Llama bf16 on CUDA"))


if __name__ == "__main__":
    main()
