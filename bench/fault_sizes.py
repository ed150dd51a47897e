"""Which fault sizes a user must be told of (`cargo xtask bench detection --suite sizes`): the
first step of the held-out protocol (docs/detection.md § Held-out protocol), run on the tuning
harness only.

Every fault kind of the held-out sweep is injected at several sizes into the tuning
configuration — the real-text GPT of 2 layers × width 64 (`TINY`), 4 ranks, 400 steps, the
fault from step 200 on rank 1, seeds 0 and 1 — beside healthy twins of the same seeds (seed 2
too, for the seed-to-seed spread). A twin and its fault run are bit-identical up to the fault
(same seed, deterministic CPU kernels), so their difference *is* the fault's effect. What is
measured, per run, from its exported rows:

* **persistent**: the shift of the averaged loss over the last 50 steps against the twin, over
  the healthy spread (the standard deviation of that final loss across the healthy seeds);
* **transient**: the largest excursion of the averaged loss against the twin in the 20 steps
  from the fault, over the twin's own step-to-step noise (1.4826 · MAD of its loss differences
  over the 100 steps before the fault);
* **replicas differ**: whether the ranks' parameter fingerprints disagree at the run's last
  fingerprinted step (the replicas hold different weights for good).

The policy that turns these into "the smallest size to tell a user of" was fixed before any of
these runs (docs/detection.md): every size whose replicas differ (exact evidence: a replica that
no longer holds the others' weights is corrupt state every later step averages in); otherwise a
size whose persistent shift is ≥ 1 healthy spread or whose transient excursion is ≥ 5 × the
step noise, on every seed. A size below both is not a fault to page anyone for. Writes
`sizes.json` and `summary.md` under `--out`; exports stay under `--out/exports`, so
`--analyse` judges them again without training.

    python bench/fault_sizes.py                # train what is missing, then analyse
    python bench/fault_sizes.py --kinds skip_step,nan --analyse
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from detection_bench import ROOT, TINY, Scenario, train_and_export  # noqa: E402

STEPS = 400
FAULT_STEP = 200
RANK = 1
WORLD = 4
SEEDS = (0, 1)
HEALTHY_SEEDS = (0, 1, 2)
TAIL = 50  # steps at the end over which the persistent shift is averaged
AFTER = 20  # steps from the fault in which a transient excursion counts
BEFORE = 100  # steps before the fault that give the twin's step-to-step noise
# The policy, fixed before the runs (docs/detection.md § Held-out protocol).
PERSISTENT_SPREADS = 1.0
TRANSIENT_NOISES = 5.0

# kind: (option, sizes, smallest first); option None: the kind has one size.
KINDS: dict[str, tuple[str | None, tuple[float, ...]]] = {
    "weight_bit_flip": ("bit", (0, 20, 30)),
    "optim_bit_flip": ("bit", (0, 20, 30)),
    "gemm_corrupt": ("bit", (20, 26, 29, 30)),
    "grad_scale": ("factor", (1.25, 1.5, 2.0, 4.0, 8.0)),
    "shuffle_labels": ("rate", (0.1, 0.3, 1.0)),
    "duplicate_data": (None, (1,)),
    "old_checkpoint": ("steps", (1, 10, 100)),
    "skip_step": (None, (1,)),
    "nan": (None, (1,)),
}


@dataclass(frozen=True)
class Run:
    name: str
    kind: str | None
    size: float | None
    seed: int


def label(kind: str, size: float) -> str:
    option, _ = KINDS[kind]
    return kind if option is None else f"{kind}-{size:g}"


def matrix(kinds: list[str]) -> list[Run]:
    runs = [Run(f"sizes-healthy-s{s}", None, None, s) for s in HEALTHY_SEEDS]
    for kind in kinds:
        _, sizes = KINDS[kind]
        runs += [Run(f"sizes-{label(kind, size)}-s{s}", kind, size, s) for size in sizes for s in SEEDS]
    return runs


def scenario(run: Run) -> Scenario:
    args = [*TINY, "--seed", str(run.seed)]
    if run.kind is not None:
        option, _ = KINDS[run.kind]
        fault = f"{run.kind}@{FAULT_STEP}:rank={RANK}"
        if option is not None:
            fault += f":{option}={run.size:g}"
        args += ["--fault", fault]
    return Scenario(run.name, WORLD, args)


def series(samples: Path) -> tuple[dict[int, float], dict[int, set[float]]]:
    """The run's averaged loss by step, and its ranks' parameter fingerprints by step."""
    table = pq.read_table(samples, columns=["rank", "step", "metric", "value"]).to_pylist()
    loss = {int(r["step"]): float(r["value"]) for r in table if r["metric"] == "loss_mean" and r["rank"] is None}
    digests: dict[int, set[float]] = {}
    for r in table:
        if r["metric"] == "param_fingerprint" and r["rank"] is not None:
            digests.setdefault(int(r["step"]), set()).add(float(r["value"]))
    return loss, digests


def effects(out: Path, runs: list[Run]) -> dict[str, Any]:
    exports = out / "exports"
    loaded = {r.name: series(exports / f"{r.name}.samples.parquet") for r in runs if (exports / f"{r.name}.samples.parquet").exists()}
    healthy = {r.seed: loaded[r.name][0] for r in runs if r.kind is None and r.name in loaded}
    last = range(STEPS - TAIL, STEPS)

    def final(loss: dict[int, float]) -> float:
        return statistics.fmean(loss[s] for s in last if s in loss)

    spread = statistics.stdev(final(l) for l in healthy.values()) if len(healthy) >= 2 else math.nan
    rows: list[dict[str, Any]] = []
    for r in runs:
        if r.kind is None or r.name not in loaded or r.seed not in healthy:
            continue
        loss, digests = loaded[r.name]
        twin = healthy[r.seed]
        before = np.array([twin[s] for s in range(FAULT_STEP - BEFORE, FAULT_STEP) if s in twin])
        noise = 1.4826 * float(np.median(np.abs(np.diff(before) - np.median(np.diff(before))))) if len(before) > 2 else math.nan
        window = [abs(loss[s] - twin[s]) for s in range(FAULT_STEP, FAULT_STEP + AFTER) if s in loss and s in twin]
        # A NaN loss is an excursion beyond any noise.
        transient = math.inf if any(math.isnan(w) for w in window) else (max(window) / noise if window and noise > 0 else math.nan)
        shift = final(loss) - final(twin)
        persistent = math.inf if math.isnan(shift) else abs(shift) / spread
        fingerprinted = sorted(digests)
        differ = bool(fingerprinted) and len(digests[fingerprinted[-1]]) > 1
        rows.append({"name": r.name, "kind": r.kind, "size": r.size, "seed": r.seed, "persistent": persistent, "transient": transient, "replicas_differ": differ, "final_shift": shift})
    sizes: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        option, candidates = KINDS[kind]
        verdicts: list[dict[str, Any]] = []
        for size in candidates:
            seeds = [r for r in rows if r["kind"] == kind and r["size"] == size]
            if not seeds:
                continue
            tell = [r["replicas_differ"] or r["persistent"] >= PERSISTENT_SPREADS or r["transient"] >= TRANSIENT_NOISES for r in seeds]
            verdicts.append({"size": size, "seeds": len(seeds), "tell": all(tell), "replicas_differ": [r["replicas_differ"] for r in seeds], "persistent": [round(r["persistent"], 2) for r in seeds], "transient": [round(r["transient"], 1) for r in seeds]})
        told = [v["size"] for v in verdicts if v["tell"]]
        sizes[kind] = {"option": option, "smallest_to_tell": min(told) if told else None, "sizes": verdicts}
    return {"healthy_final_spread": spread, "healthy_seeds": sorted(healthy), "runs": rows, "kinds": sizes}


def report(result: dict[str, Any], machine: str) -> str:
    lines = [
        f"Fault sizes on the tuning harness (TINY, 4 ranks, {STEPS} steps, fault at {FAULT_STEP} on rank {RANK}; {machine})",
        f"healthy spread of the final loss: {result['healthy_final_spread']:.4f} over seeds {result['healthy_seeds']}",
        "",
        "| kind | size | replicas differ | persistent shift (healthy spreads) | transient excursion (step noises) | tell a user |",
        "|---|---|---|---|---|---|",
    ]
    for kind, k in result["kinds"].items():
        for v in k["sizes"]:
            size = "—" if k["option"] is None else f"{k['option']} {v['size']:g}"
            lines.append(f"| {kind} | {size} | {', '.join('yes' if d else 'no' for d in v['replicas_differ'])} | {', '.join(map(str, v['persistent']))} | {', '.join(map(str, v['transient']))} | {'yes' if v['tell'] else 'no'} |")
    lines += ["", "Smallest size to tell a user of, per kind:"]
    for kind, k in result["kinds"].items():
        smallest, option = k["smallest_to_tell"], k["option"]
        if smallest is None:
            text = "none of the sizes tried (below the healthy spread)"
        elif option is None:
            text = "every occurrence"
        elif option == "bit":
            text = f"every bit from {smallest:g}"
        else:
            text = f"{option} ≥ {smallest:g}"
        lines.append(f"- {kind}: {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "target" / "bench" / "fault-sizes"))
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--cores", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--analyse", action="store_true", help="only analyse the runs already exported under --out")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        p.error(f"unknown kinds {unknown}: {', '.join(KINDS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = matrix(kinds)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
    if not args.analyse:
        todo = [r for r in runs if not (out / "exports" / f"{r.name}.samples.parquet").exists()]
        print(f"fault sizes: {len(runs)} runs of {STEPS} steps, {len(todo)} to train ({machine})", flush=True)
        train_and_export([scenario(r) for r in todo], STEPS, out, args.cores, ("samples",))
    result = effects(out, runs)
    text = report(result, machine)
    (out / "sizes.json").write_text(json.dumps({"machine": machine, **result}, indent=1, default=str))
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
