"""Replica-divergence benchmark (`cargo xtask bench detection --suite flips`): random single-bit
flips in one replica's weights, each to be named — rank and tensor — at the next fingerprinted
step.

Each layout trains a small GPT (`rankwatch_testkit.models.NanoGPT`) on 4 gloo processes that
stream through the real agent to a real collector with its default rules. The run is cut into
windows of two fingerprint intervals (the default cadence, 10 steps: 20-step windows). In most
windows one rank's copy of one parameter has one bit flipped — a random tensor, a random element,
a random step of the window's first interval, every bit of the parameter's dtype equally often —
just after that step's optimizer step, as silent data corruption would. The flip then lives
through the steps up to the next fingerprinted step D (0–9 optimizer steps later, each applying
the same averaged update to the corrupted copy). After D's report every rank restores the
weights and optimizer state it snapshotted just before the flip (what a restart from a
checkpoint does), so the next window starts from equal replicas and the alert resolves. Steps
whose averaged gradient holds an Inf/NaN (a high exponent bit can make the loss overflow) are
skipped by every rank alike, as a loss scaler skips them.

Layouts: DDP in float32 and in bfloat16 (the whole model and its Adam state in bf16), with the
position embedding ignored by DDP (`_set_params_and_buffers_to_ignore_for_model`): DDP leaves it
unsynchronised, so the fingerprint leaves it out and lists it in the run's tags; some windows
flip a bit there and must raise nothing. HSDP in float32: FSDP2 over a 2 × 2 mesh (replicate ×
shard); a flip in one rank's shard must be named in its replica set (two replicas: both ranks,
saying which changed cannot be told).

A flip counts as *to be named* when the corrupted copy still differs at D, judged independently
of rankwatch (a SHA-1 of the parameter's bytes on every rank at D): an optimizer update can
round a low-mantissa flip of a bfloat16 weight away before D, leaving no difference to see.
Reported per layout: flips, flips to be named, named at D with the right rank(s) and tensor,
missed, misnamed, alerts on ignored-parameter flips, alerts not belonging to any flip (false),
and the delay from the flip to the alert in steps. Writes `flips.json` and `summary.md` under
`--out`.

    RANKWATCH_BIN=target/debug/rankwatch python bench/replica_flips.py
    python bench/replica_flips.py --layouts ddp-fp32 --flips 16     # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import requests
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sdk-python"))
sys.path.insert(0, str(ROOT / "sdk-python" / "testkit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from detection_bench import settle, start_collector  # noqa: E402
from rankwatch_testkit.faults import flip_bit  # noqa: E402
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig  # noqa: E402
from rankwatch_testkit.spawn import spawn_ranks  # noqa: E402

WORLD = 4
IGNORED = "transformer.wpe.weight"
CONFIG = NanoGPTConfig(block_size=32, vocab_size=64, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=False)
LAYOUTS = {
    # name: (sharding, dtype, flips by default)
    "ddp-fp32": ("ddp", torch.float32, 96),
    "ddp-bf16": ("ddp", torch.bfloat16, 64),
    "hsdp-fp32": ("hsdp", torch.float32, 64),
}
IGNORED_FLIPS = 8  # per DDP layout


def plan(layout: str, flips: int, every: int, seed: int) -> list[dict[str, Any]]:
    """The flips of one run: one per window, bits cycled so each is hit equally often, tensor,
    element, rank and step at random; a few windows flip the DDP-ignored parameter."""
    sharding, dtype, _ = LAYOUTS[layout]
    bits = 8 * torch.empty((), dtype=dtype).element_size()
    rng = random.Random(seed)
    names = [n for n, _ in NanoGPT(CONFIG).named_parameters()]
    compared = [n for n in names if sharding != "ddp" or n != IGNORED]
    order = list(range(flips))
    rng.shuffle(order)
    windows: list[dict[str, Any]] = []
    for i in order:
        windows.append({"bit": i % bits, "param": rng.choice(compared), "ignored": False})
    if sharding == "ddp":
        for _ in range(IGNORED_FLIPS):
            windows.insert(rng.randrange(len(windows) + 1), {"bit": rng.randrange(bits), "param": IGNORED, "ignored": True})
    for w, flip in enumerate(windows):
        start = 2 * every * w
        flip.update(window=w, step=start + rng.randint(1, every), detect=start + every, rank=rng.randrange(WORLD), element=rng.random())
    return windows


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def flip_at(t: torch.Tensor, fraction: float, bit: int) -> None:
    """Flips `bit` of one element (at `fraction` of this rank's flat tensor) in place, in memory."""
    shard = local(t)
    flip_bit(shard, min(int(fraction * shard.numel()), shard.numel() - 1), bit)


def rank_main(rank: int, layout: str, url: str, run_name: str, windows: list[dict[str, Any]], every: int, out: str) -> None:
    import rankwatch

    sharding, dtype, _ = LAYOUTS[layout]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = NanoGPT(CONFIG).to(dtype)
    if sharding == "ddp":
        torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [IGNORED])
        wrapped: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        wrapped = cast(torch.nn.Module, fully_shard(model, mesh=mesh))  # the model itself, now also an FSDPModule
    params = dict(model.named_parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = rankwatch.init(run=run_name, collector=url, every={"fingerprint": every, "spectral": 0, "activations": 0, "sketch": 0})
    run.watch(wrapped, optimizer)
    data = torch.Generator().manual_seed(100 + rank)
    by_step = {w["step"]: w for w in windows}
    by_detect = {w["detect"]: w for w in windows}
    steps = 2 * every * len(windows) + every + 1
    snapshot: tuple[list[torch.Tensor], dict[str, Any]] | None = None
    seen: list[dict[str, Any]] = []
    skipped = 0
    for step in range(steps):
        x = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.block_size), generator=data)
        _, loss = wrapped(x, torch.roll(x, -1, 1))
        loss.backward()
        # Skipped on every rank alike when any rank's gradient is not finite.
        finite = torch.tensor([float(all(bool(torch.isfinite(local(p.grad)).all()) for p in params.values() if p.grad is not None))])
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if finite.item() == 1.0:
            optimizer.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        flip = by_step.get(step)
        if flip is not None:
            snapshot = ([local(p).detach().clone() for p in params.values()], _clone_state(optimizer))
            if rank == flip["rank"]:
                flip_at(params[flip["param"]], flip["element"], flip["bit"])
        run.log(step, loss=loss.detach())
        done = by_detect.get(step)
        if done is not None:
            digest = hashlib.sha1(local(params[done["param"]]).detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            seen.append({"window": done["window"], "sha1": digest})
            assert snapshot is not None
            with torch.no_grad():
                for p, saved in zip(params.values(), snapshot[0], strict=True):
                    local(p).copy_(saved)
            optimizer.load_state_dict(snapshot[1])
            snapshot = None
    run.finish()
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "seen": seen, "skipped": skipped, "tags": dict(run.tags), "steps": steps}))
    dist.destroy_process_group()


def _clone_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    state = optimizer.state_dict()
    return {
        "state": {k: {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in s.items()} for k, s in state["state"].items()},
        "param_groups": [dict(g) for g in state["param_groups"]],
    }


def replica_set_of(layout: str, rank: int) -> list[int]:
    """The ranks compared with `rank`: all of them under DDP; under HSDP those holding its shards."""
    if LAYOUTS[layout][0] == "hsdp":
        return [r for r in range(WORLD) if r % (WORLD // 2) == rank % (WORLD // 2)]
    return list(range(WORLD))


def judge(layout: str, windows: list[dict[str, Any]], ranks: list[dict[str, Any]], alerts: list[dict[str, Any]]) -> dict[str, Any]:
    divergence = [a for a in alerts if a["rule"] == "replica_divergence" and a.get("fired_at_ms") is not None]
    by_step: dict[int, list[dict[str, Any]]] = {}
    for a in divergence:
        by_step.setdefault(a["first_step"], []).append(a)
    sha = {r["rank"]: {s["window"]: s["sha1"] for s in r["seen"]} for r in ranks}
    rows: list[dict[str, Any]] = []
    matched: set[str] = set()
    for w in windows:
        group = replica_set_of(layout, w["rank"])
        healthy = [r for r in group if r != w["rank"]]
        persisted = all(sha[w["rank"]][w["window"]] != sha[h][w["window"]] for h in healthy)
        hits = by_step.get(w["detect"], [])
        matched.update(a["id"] for a in hits)
        want = sorted(group) if len(group) == 2 else [w["rank"]]
        named = any(a["outlier_ranks"] == want and f"in tensor {w['param']}" in a["explanation"] for a in hits)
        rows.append({**w, "persisted": persisted, "alerts": len(hits), "named": named, "explanations": [a["explanation"] for a in hits]})
    false = [a for a in divergence if a["id"] not in matched]
    counted = [r for r in rows if not r["ignored"] and r["persisted"]]
    delays = [r["detect"] - r["step"] for r in counted if r["named"]]
    return {
        "layout": layout,
        "flips": sum(not r["ignored"] for r in rows),
        "to_name": len(counted),
        "rounded_away": sum(not r["ignored"] and not r["persisted"] for r in rows),
        "named": sum(r["named"] for r in counted),
        "missed": sum(r["alerts"] == 0 for r in counted),
        "misnamed": sum(r["alerts"] > 0 and not r["named"] for r in counted),
        "ignored_flips": sum(r["ignored"] for r in rows),
        "ignored_alerts": sum(r["alerts"] for r in rows if r["ignored"]),
        "rounded_away_alerts": sum(r["alerts"] for r in rows if not r["ignored"] and not r["persisted"]),
        "false_alerts": len(false),
        "bits": sorted({r["bit"] for r in counted if r["named"]}),
        "tensors": len({r["param"] for r in counted if r["named"]}),
        "delay_median": statistics.median(delays) if delays else None,
        "delay_max": max(delays) if delays else None,
        "ignored_tag": ranks[0]["tags"].get("replica_fingerprint_ignored", ""),
        "skipped_steps": ranks[0]["skipped"],
        "steps": ranks[0]["steps"],
        "rows": rows,
    }


def table(results: list[dict[str, Any]], machine: str, every: int) -> str:
    lines = [
        f"Replica fingerprint, single-bit flips (fingerprint every {every} steps; {machine})",
        "",
        "| layout | flips | to name | named at D, rank + tensor | missed | misnamed | rounded away | ignored-param flips → alerts | false alerts | delay median / max (steps) | bits named |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['layout']} | {r['flips']} | {r['to_name']} | {r['named']} | {r['missed']} | {r['misnamed']} | {r['rounded_away']} "
            f"| {r['ignored_flips']} → {r['ignored_alerts']} | {r['false_alerts']} | {r['delay_median']} / {r['delay_max']} | {len(r['bits'])} |"
        )
    total = sum(r["to_name"] for r in results)
    named = sum(r["named"] for r in results)
    lines += ["", f"All layouts: {named} of {total} flips that persisted to the fingerprint named at it with their rank(s) and tensor."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--flips", type=int, default=0, help="flips per layout (default: each layout's own)")
    parser.add_argument("--every", type=int, default=10, help="fingerprint cadence in steps (the default: 10)")
    parser.add_argument("--seed", type=int, default=20261128)
    parser.add_argument("--out", type=Path, default=ROOT / "target" / "bench" / "replica-flips")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    results = []
    for layout in args.layouts.split(","):
        if layout not in LAYOUTS:
            parser.error(f"unknown layout {layout!r}: {', '.join(LAYOUTS)}")
        windows = plan(layout, args.flips or LAYOUTS[layout][2], args.every, args.seed)
        data = Path(tempfile.mkdtemp(prefix="rankwatch-flips-"))
        collector, url = start_collector(data, None)
        started = time.monotonic()
        try:
            ranks_dir = args.out / layout
            shutil.rmtree(ranks_dir, ignore_errors=True)
            ranks_dir.mkdir(parents=True)
            run_name = f"flips-{layout}"
            spawn_ranks(rank_main, WORLD, layout, url, run_name, windows, args.every, str(ranks_dir))
            ranks = [json.loads((ranks_dir / f"rank-{r}.json").read_text()) for r in range(WORLD)]
            alerts = settle(url, run_name, ranks[0]["steps"] - 1)
            if not alerts:
                alerts = requests.get(f"{url}/api/v1/alerts", params={"run": run_name}, timeout=60).json()["alerts"]
        finally:
            collector.terminate()
            collector.wait(timeout=30)
            shutil.rmtree(data, ignore_errors=True)
        result = judge(layout, windows, ranks, alerts)
        result["seconds"] = round(time.monotonic() - started, 1)
        results.append(result)
        print(f"{layout}: {result['named']}/{result['to_name']} named, {result['false_alerts']} false, {result['seconds']} s", flush=True)
    summary = table(results, machine, args.every)
    (args.out / "flips.json").write_text(json.dumps({"machine": machine, "every": args.every, "seed": args.seed, "results": results}, indent=1))
    (args.out / "summary.md").write_text(summary + "\n")
    print(summary)
    ok = all(r["named"] == r["to_name"] and r["false_alerts"] == 0 and r["ignored_alerts"] == 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
