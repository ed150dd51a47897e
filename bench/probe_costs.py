"""What each probe costs a training step, measured one probe at a time (shared by
`cargo xtask bench sdk` on CPU and `cargo xtask gpu`).

Method. One process trains the model throughout; in rounds, it runs `--steps` steps with no
monitoring, then the same number with exactly one probe installed and due every step
(cadence 1), removes it (`run.finish()`), and goes on to the next probe. Interleaving in one
process cancels what separate processes differ by (placement, allocator state), but on a
shared 2-vCPU VM a neighbour still adds hundreds of milliseconds to some steps, more than
the costs measured. So each probe's cost when due is given two ways:

- inside the agent: the time the training thread spends in the probe's hooks plus in
  `run.log` (what the dashboard's `probe_ms.*` series show), median over the phase's steps.
  On CPU every kernel runs on that thread as it is called, so this is the probe's cost; it
  is the number the CPU total is made of.
- step-time difference: the fastest step with the probe minus the fastest without it
  (interference only ever adds time, so the minimum is the least disturbed estimate, as
  `timeit` advises). It also catches indirect costs, such as caches the probe evicts; on a
  GPU, where the host returns before the kernels finish, it is the only one that counts, and
  the GPU total is made of it.

At the default cadence a probe is paid every k-th step: its share of training is cost / k /
step time, and the total is the sum of the shares. The exact dot and the sketch ride on the
gradient probe: their rows are their cost on top of it. A probe's share falls as 1/tokens per
step (its work grows with the parameters, a step's with parameters × tokens). Memory: on a
GPU, the peak allocated during each probe's steps (torch.cuda.max_memory_allocated, reset per
phase) minus the unmonitored peak; on CPU, where torch keeps no such counter, the bytes the
probe holds between steps (its copy buffers and its cached sketch coordinates). On a GPU
every step ends with a synchronize so that step times are device times; the probes never
synchronize.

Usage: python bench/probe_costs.py [--model gpt2-100m|gpt2-small|llama-1b|tiny] [--device cpu|cuda]
                                   [--dtype float32|bfloat16] [--steps N] [--rounds N] [--warmup N]
                                   [--batch N --seq N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sdk-python"))

OFF = {"grad": 0, "sketch": 0, "dot": 0, "activations": 0, "spectral": 0, "fingerprint": 0}
CONFIGS: dict[str, dict[str, int]] = {
    "none": OFF,
    "grad": {**OFF, "grad": 1},
    "grad+dot": {**OFF, "grad": 1, "dot": 1},
    "grad+sketch": {**OFF, "grad": 1, "sketch": 1},
    "activations": {**OFF, "activations": 1},
    "spectral": {**OFF, "spectral": 1},
    "spectral, no effective rank": {**OFF, "spectral": 1},
    "replica fingerprint": {**OFF, "fingerprint": 1},
}
# watch() arguments beyond the cadence, per configuration.
WATCH_OPTIONS: dict[str, dict[str, Any]] = {"spectral, no effective rank": {"effective_rank_probes": 0}}
# The default cadence (rankwatch.run.Cadence): steps between measurements.
DEFAULT_EVERY = {
    "grad": 1,
    "grad+dot": 10,
    "grad+sketch": 10,
    "activations": 25,
    "spectral": 50,
    "spectral, no effective rank": 50,
    "replica fingerprint": 10,
}
# The dot and the sketch ride on the gradient probe: their own cost is the difference.
ON_TOP_OF_GRAD = {"grad+dot": "exact dot (on top of grad)", "grad+sketch": "sketch (on top of grad)"}


def build(name: str, device: str, dtype: str, shape: tuple[int, int] | None = None):  # type: ignore[no-untyped-def]
    """(model, batch maker) for one of the benchmark models, random init; `shape` (batch,
    sequence) overrides the model's default batch."""
    import torch

    model: torch.nn.Module
    torch.manual_seed(0)
    if name == "llama-1b":
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
        )
        model = transformers.LlamaForCausalLM(config)
        batch, seq, vocab = 4, 1024, 32000

        def step_loss(m, x):  # type: ignore[no-untyped-def]
            return m(input_ids=x, labels=x).loss
    else:
        from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

        sizes = {
            "tiny": dict(n_layer=2, n_head=2, n_embd=64, vocab_size=256, block_size=64),
            "gpt2-100m": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=8192, block_size=256),
            "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024),
        }[name]
        model = NanoGPT(NanoGPTConfig(dropout=0.0, bias=True, **sizes))  # type: ignore[arg-type]  # sizes are int fields only, which mypy cannot tell from post_ln: bool
        # gpt2-100m on CPU: 4 × 256 tokens a step. A probe's cost grows with the parameters and a
        # step's with parameters × tokens, so its share falls as 1/tokens: `--batch 2 --seq 128`
        # shows the share at a quarter of the tokens.
        batch, seq, vocab = {"tiny": (4, 64), "gpt2-100m": (4, 256), "gpt2-small": (8, 1024)}[name] + (sizes["vocab_size"],)

        def step_loss(m, x):  # type: ignore[no-untyped-def]
            return m(x, torch.roll(x, -1, 1))[1]
    if shape is not None:
        batch, seq = shape
    # As a Module: transformers wraps its .to with functools.wraps, which mypy types without self.
    model = cast("torch.nn.Module", model).to(device=device, dtype=getattr(torch, dtype))
    generator = torch.Generator(device="cpu").manual_seed(1)

    def make_batch():  # type: ignore[no-untyped-def]
        return torch.randint(0, vocab, (batch, seq), generator=generator).to(device)

    return model, make_batch, step_loss


def _held_bytes(run) -> int:  # type: ignore[no-untyped-def]
    """Bytes a run's gradient probe holds between steps: sketch rows, cached coordinates and
    (on CPU) the buffers the exact dot copies gradients into."""
    probe = run._gradients
    if probe is None:
        return 0
    kept = [*probe._coordinates.values(), *(b for b in probe._copy_buffers if b is not None)]
    held = sum(t.numel() * t.element_size() for t in kept)
    rows = probe._sketch_rows
    return held + (rows.numel() * rows.element_size() if rows is not None else 0)


def measure(model_name: str, device: str, dtype: str, steps: int, warmup: int, rounds: int, shape: tuple[int, int] | None = None) -> list[dict[str, Any]]:
    """Runs the interleaved phases in this process; one row per configuration."""
    import torch
    import torch.distributed as dist

    import rankwatch

    cuda = device == "cuda"
    if not dist.is_initialized():
        from socket import socket

        with socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    model, make_batch, step_loss = build(model_name, device, dtype, shape)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    spool = tempfile.mkdtemp(prefix="rw-costs-")
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    inside: dict[str, list[float]] = {c: [] for c in CONFIGS}
    peaks: dict[str, float] = {c: 0.0 for c in CONFIGS}
    step = 0

    def phase(config: str, count: int, record: bool) -> None:
        nonlocal step
        every = CONFIGS[config]
        run = None
        if config != "none":
            run = rankwatch.init(run=f"probe-costs-{config}-{step}", mode="offline", spool_dir=spool, every=every)
            run.watch(ddp, optimizer, spectral=every["spectral"] > 0, activations=every["activations"] > 0, **WATCH_OPTIONS.get(config, {}))
            if every["fingerprint"]:
                # One process stands for the replicas: the fingerprint runs only with a second
                # replica to compare, so it is installed as a two-replica run installs it.
                run.world_size = 2
                run._watch_fingerprint(model, run._layout, sharded=False, ddp=ddp)
                assert run._fingerprint is not None
                run._fingerprint.checked = ddp  # its group of one stands for the replicas: not checked against the run
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(count):
            x = make_batch()
            started = time.perf_counter()
            loss = step_loss(ddp, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            agent_s = 0.0
            if run is not None:
                # The hooks' time since the last log (log() hands it on and resets it), then log's own.
                agent_s = sum(p.elapsed for p in (run._gradients, run._activations) if p is not None)
                logged = time.perf_counter()
                run.log(step, loss=loss.detach())
                agent_s += time.perf_counter() - logged
            if cuda:
                torch.cuda.synchronize()
            if record:
                times[config].append(time.perf_counter() - started)
                inside[config].append(agent_s)
            step += 1
        if record:
            held = torch.cuda.max_memory_allocated() / 2**20 if cuda else (_held_bytes(run) / 2**20 if run is not None else 0.0)
            peaks[config] = max(peaks[config], held)
        if run is not None:
            run.finish(timeout=5)

    phase("none", warmup, record=False)
    for _ in range(rounds):
        for config in CONFIGS:
            # The first step of a phase pays one-off work (hooks, hashes, a cold spectral start):
            # run it unrecorded, as the first steps of a real run would amortise it.
            phase(config, 1, record=False)
            phase(config, steps, record=True)
    params = sum(p.numel() for p in model.parameters())
    tokens = make_batch().numel()
    return [
        {
            "config": c,
            "min_ms": min(times[c]) * 1e3,
            "median_ms": statistics.median(times[c]) * 1e3,
            "inside_ms": statistics.median(inside[c]) * 1e3,
            "peak_mb": peaks[c],
            "params": params,
            "cuda": cuda,
            "tokens": tokens,
        }
        for c in CONFIGS
    ]


def table(rows: list[dict[str, Any]], title: str) -> str:
    base = next(r for r in rows if r["config"] == "none")
    cuda = base["cuda"]
    step, fastest, peak = base["median_ms"], base["min_ms"], base["peak_mb"]
    memory = "peak memory Δ MB" if cuda else "memory held MB"
    lines = [
        f"\n## {title}: {rows[0]['params'] / 1e6:.1f}M parameters, unmonitored step {step:.1f} ms (median), {fastest:.1f} ms (fastest)\n",
        f"| probe | default cadence (steps) | cost when due, inside the agent ms | cost when due, step-time difference ms | share of training at default cadence | {memory} |",
        "|---|---|---|---|---|---|",
    ]
    total = 0.0
    grad = next(r for r in rows if r["config"] == "grad")
    for r in rows:
        if r["config"] == "none":
            continue
        on_top = r["config"] in ON_TOP_OF_GRAD
        inside = r["inside_ms"] - (grad["inside_ms"] if on_top else 0.0)
        difference = r["min_ms"] - (grad["min_ms"] if on_top else fastest)
        held = r["peak_mb"] - (grad["peak_mb"] if on_top and cuda else (peak if cuda else 0.0))
        every = DEFAULT_EVERY[r["config"]]
        # On CPU the agent's own time is the cost; on a GPU only the step time says it.
        share = (difference if cuda else inside) / every / step
        # The spectral probe without its effective rank is an alternative, not a further cost.
        total += 0.0 if r["config"] in WATCH_OPTIONS else share
        label = ON_TOP_OF_GRAD.get(r["config"], r["config"])
        lines.append(f"| {label} | {every} | {inside:+.1f} | {difference:+.1f} | {100 * share:+.2f} % | {held:+.0f} |")
    basis = "step-time differences" if cuda else "the time inside the agent"
    lines.append(f"\nTotal at the default cadence: {100 * total:+.2f} % of step time (from {basis}).")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt2-100m", choices=["tiny", "gpt2-100m", "gpt2-small", "llama-1b"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=4, help="recorded steps per phase")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, help="sequences a step (default: the model's)")
    p.add_argument("--seq", type=int, help="tokens a sequence (default: the model's)")
    args = p.parse_args()
    shape = (args.batch or 0, args.seq or 0) if args.batch or args.seq else None
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if shape is not None and 0 in shape:
        p.error("--batch and --seq go together")
    rows = measure(args.model, args.device, args.dtype, args.steps, args.warmup, args.rounds, shape)
    print(table(rows, f"per-probe cost, {args.model} {args.dtype} on {args.device}, {rows[0]['tokens']} tokens a step"))


if __name__ == "__main__":
    main()
