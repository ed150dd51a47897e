"""The SDK's costs to the training job, side by side with the usual loggers (cargo xtask bench sdk).

1. Training-thread cost of one `log` call with 200 scalars (Python floats), median and p99
   over many calls, for rankwatch, wandb (WANDB_MODE=offline), TensorBoard's SummaryWriter and
   aim, all in this process, one after the other, same values. Target: rankwatch ≤ 10 µs median
   and the lowest.
2. Step-time overhead of the CPU DDP example with every probe on at the default cadence versus
   no monitoring (`--monitor off`). Target: ≤ 3 %.

Usage: python bench/sdk_bench.py [log|overhead|all] [--calls N] [--steps N] [--nproc N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sdk-python"))


def _time_calls(fn: Callable[[int], object], calls: int) -> tuple[float, float]:
    for i in range(200):  # warm-up: caches, first allocations
        fn(i)
    samples = []
    for i in range(calls):
        t = time.perf_counter_ns()
        fn(200 + i)
        samples.append(time.perf_counter_ns() - t)
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(0.99 * len(samples))] / 1e3


def bench_log(calls: int) -> list[tuple[str, str, float, float]]:
    scalars = {f"metric_{i:03d}": 0.5 + i for i in range(200)}
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="rw-bench-"))

    import rankwatch

    run = rankwatch.init(run="bench-log", mode="offline", spool_dir=tmp / "spool")
    rows.append(("rankwatch", "run.log(step, scalars)", *_time_calls(lambda s: run.log(s, scalars), calls)))
    rows.append(("rankwatch", "run.log(step, **scalars)", *_time_calls(lambda s: run.log(s, **scalars), calls)))
    run.finish()

    try:
        os.environ["WANDB_MODE"] = "offline"
        os.environ["WANDB_SILENT"] = "true"
        import wandb

        w = wandb.init(project="rw-bench", dir=str(tmp), mode="offline")
        rows.append(("wandb (offline)", "wandb.log(scalars, step=step)", *_time_calls(lambda s: w.log(scalars, step=s), calls)))
        w.finish()
    except Exception as e:  # noqa: BLE001 - a comparison that cannot run is reported, not fatal
        rows.append(("wandb", f"unavailable: {e}", float("nan"), float("nan")))

    try:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(tmp / "tb"))

        def tb_log(step: int) -> None:
            for k, v in scalars.items():
                tb.add_scalar(k, v, step)

        rows.append(("TensorBoard", "add_scalar × 200", *_time_calls(tb_log, calls)))
        tb.close()
    except Exception as e:  # noqa: BLE001
        rows.append(("TensorBoard", f"unavailable: {e}", float("nan"), float("nan")))

    try:
        import aim

        a = aim.Run(repo=str(tmp / "aim"), experiment="rw-bench")
        rows.append(("aim", "run.track(scalars, step=step)", *_time_calls(lambda s: a.track(scalars, step=s), calls)))
        a.close()
    except Exception as e:  # noqa: BLE001
        rows.append(("aim", f"unavailable: {e}", float("nan"), float("nan")))
    return rows


def bench_overhead(steps: int, nproc: int) -> list[tuple[str, float]]:
    example = ROOT / "sdk-python" / "examples" / "train_ddp.py"
    results = []
    # Interleave off/on twice so drift on a shared machine hits both alike.
    for monitor in ("off", "on", "off", "on"):
        out = Path(tempfile.mkdtemp(prefix=f"rw-overhead-{monitor}-"))
        cmd = [sys.executable, str(example), "--nproc", str(nproc), "--steps", str(steps), "--monitor", monitor, "--mode", "offline", "--spool-dir", str(out / "spool"), "--result-dir", str(out), "--run", "bench-overhead"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times = []
        for f in out.glob("rank-*.json"):
            times += json.loads(f.read_text())["step_times"][10:]  # skip warm-up steps
        results.append((monitor, statistics.median(times)))
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("which", nargs="?", default="all", choices=["log", "overhead", "all"])
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    if args.which in ("log", "all"):
        print(f"\n## log() with 200 scalars, {args.calls} calls each (training-thread time)\n")
        print("| logger | call | median µs | p99 µs |\n|---|---|---|---|")
        for name, call, med, p99 in bench_log(args.calls):
            print(f"| {name} | {call} | {med:.1f} | {p99:.1f} |")
    if args.which in ("overhead", "all"):
        print(f"\n## step time of the CPU DDP example ({args.nproc} ranks, {args.steps} steps, median per step)\n")
        res = bench_overhead(args.steps, args.nproc)
        off = statistics.mean(t for m, t in res if m == "off")
        on = statistics.mean(t for m, t in res if m == "on")
        print("| monitoring | median step ms |\n|---|---|")
        for m, t in res:
            print(f"| {m} | {t * 1e3:.2f} |")
        print(f"\noverhead with every probe on at the default cadence: {100 * (on - off) / off:+.2f} %")


if __name__ == "__main__":
    main()
