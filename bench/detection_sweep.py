"""Fault-size sweep with detection curves (`cargo xtask bench detection --suite faults`).

Each fault that `silent_inconsistency` exists for is injected into the real-text harness at
several sizes — one rank's gradient scaled ×1.05 … ×8, gradient noise of relative size
0.1 … 3, a share 0.1 … 1 of one rank's labels shuffled, a bit of one element of one rank's
gradient flipped every step (bits 26, 29, 30 of a float32: ×/÷2^8, ×/÷2^64, ×/÷2^128), a bit
of one element of one rank's weights flipped once (the same bits), one rank computing its
gradient on weights 1, 4 or 16 updates old — from step 300 of a 600-step, 4-rank run, beside
healthy twins of the same configuration. Every run streams through the real agent to a real
collector, and its rows are exported.

The runs are then judged offline under many thresholds: `rankwatch replay` feeds a run's
exported rows through the detectors exactly as the engine feeds the live stream, once per
rules file, so a threshold grid costs seconds instead of a training run per point. Beside
the rule's two tests (the run-level robust z-score, the per-rank stand-out test) three simple
baselines see the same rows: a spike of the averaged loss, a per-rank loss z-score across
ranks, and a per-rank gradient-norm threshold. "Any rule" counts an alert of every rule as it
ships (a bit flip that turns the loss NaN is `nonfinite`'s to report, not this rule's).

For each detector and threshold: detection probability per fault size, delay from the fault
to the alert firing (in steps), and false alerts per 1,000 steps (healthy twins, and fault
runs before their fault). Thresholds are tuned on the gradient-scale runs and healthy seed 0
(the most sensitive threshold with no false alert there) and reported on the held-out kinds
(noise, labels, bit flips, stale weights) and healthy seeds. Writes sweep.json, summary.md and two SVG plots (ROC,
delay against false alerts) under --out; `--analyse` redoes the analysis from saved runs.

    python bench/detection_sweep.py                 # train the sweep, then analyse
    python bench/detection_sweep.py --analyse       # analyse target/bench/detection-sweep again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from detection_bench import (
    ROOT,
    TINY,
    Scenario,
    poisson_interval,
    proportion_interval,
    train_and_export,
)

STEPS = 600
FAULT_STEP = 300
RANK = 1
WORLD = 4
SIZES = {
    "grad_scale": ("factor", (1.05, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0)),
    "grad_noise": ("sigma", (0.1, 0.3, 1.0, 3.0)),
    "shuffle_labels": ("rate", (0.1, 0.3, 1.0)),
    "grad_bit_flip": ("bit", (26, 29, 30)),
    "weight_bit_flip": ("bit", (26, 29, 30)),
    "stale_weights": ("steps", (1, 4, 16)),
}
ANY_RULE = "any rule, defaults"
TUNING_KINDS = ("grad_scale",)
WINDOW = 100  # steps after the fault within which an alert counts as its detection
PERSIST = 3  # steps in a row a baseline must breach before it fires (the rule's pending_for)
REARM = 10  # clear steps before a baseline can fire again (the rule's resolve_after)


@dataclass(frozen=True)
class Run:
    name: str
    kind: str | None  # None: healthy twin
    size: float | None
    seed: int

    @property
    def fault_step(self) -> int | None:
        return None if self.kind is None else FAULT_STEP


def matrix(seeds: int, healthy: int) -> list[Run]:
    runs = [Run(f"sweep-healthy-s{s}", None, None, s) for s in range(healthy)]
    for kind, (_, sizes) in SIZES.items():
        runs += [Run(f"sweep-{kind}-{size:g}-s{s}", kind, size, s) for size in sizes for s in range(seeds)]
    return runs


def scenario(run: Run) -> Scenario:
    args = [*TINY, "--seed", str(run.seed)]
    if run.kind is not None:
        key, _ = SIZES[run.kind]
        args += ["--fault", f"{run.kind}@{FAULT_STEP}:rank={RANK}:{key}={run.size:g}"]
    return Scenario(run.name, WORLD, args)


# --- training and export ----------------------------------------------------------------------


def train(runs: list[Run], out: Path, cores: int) -> None:
    train_and_export([scenario(r) for r in runs], STEPS, out, cores, ("samples", "sketches"))


# --- one run's rows ---------------------------------------------------------------------------


@dataclass
class Rows:
    steps: np.ndarray  # the steps every rank reported, ascending
    loss: np.ndarray  # [step, rank]
    grad: np.ndarray  # [step, rank]
    times: np.ndarray  # latest measurement time of each step, ms

    def step_at(self, time_ms: int) -> int:
        """The first step measured at or after `time_ms` (when an alert fired)."""
        i = int(np.searchsorted(self.times, time_ms))
        return int(self.steps[min(i, len(self.steps) - 1)])


def read_rows(samples: Path, ranks: int = WORLD) -> Rows:
    """Each rank's loss and gradient norm at the steps every one of `ranks` reported."""
    table = pq.read_table(samples, columns=["rank", "step", "time", "metric", "value"])
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in ("rank", "step", "metric", "value")}
    times = table.column("time").cast("int64").to_numpy()
    by: dict[str, dict[tuple[int, int], float]] = {"loss": {}, "grad_norm": {}}
    latest: dict[int, int] = {}
    for rank, step, metric, value, t in zip(cols["rank"], cols["step"], cols["metric"], cols["value"], times):
        if metric in by and rank is not None and not (isinstance(rank, float) and math.isnan(rank)):
            by[metric][(int(step), int(rank))] = float(value)
            latest[int(step)] = max(latest.get(int(step), 0), int(t))
    steps = sorted({s for (s, _) in by["loss"]} & {s for (s, _) in by["grad_norm"]})
    steps = [s for s in steps if all((s, r) in by["loss"] and (s, r) in by["grad_norm"] for r in range(ranks))]
    loss = np.array([[by["loss"][(s, r)] for r in range(ranks)] for s in steps]).reshape(len(steps), ranks)
    grad = np.array([[by["grad_norm"][(s, r)] for r in range(ranks)] for s in steps]).reshape(len(steps), ranks)
    return Rows(np.array(steps), loss, grad, np.array([latest[s] for s in steps]))


# --- detectors --------------------------------------------------------------------------------


def fire_steps(breach: np.ndarray, steps: np.ndarray) -> list[int]:
    """Steps at which a detector fires: PERSIST breaching steps in a row, re-armed after REARM
    clear ones (the rule's own lifecycle, so the comparison is of the statistic alone)."""
    fired, run, clear, armed = [], 0, 0, True
    for b, s in zip(breach, steps):
        run = run + 1 if b else 0
        clear = 0 if b else clear + 1
        if armed and run >= PERSIST:
            fired.append(int(s))
            armed = False
        if not armed and clear >= REARM:
            armed = True
    return fired


def robust_z(x: np.ndarray, centre: np.ndarray, scale: np.ndarray, floor: np.ndarray) -> np.ndarray:
    return (x - centre) / np.maximum(1.4826 * scale, floor)


def avg_loss_spike(rows: Rows, t: float) -> list[int]:
    """The averaged loss (what ordinary trackers plot) against its last 50 steps."""
    mean = rows.loss.mean(axis=1)
    breach = np.zeros(len(mean), dtype=bool)
    for i in range(50, len(mean)):
        w = mean[i - 50 : i]
        med = np.median(w)
        z = robust_z(mean[i], med, np.median(np.abs(w - med)), 0.001 * abs(med) + 1e-12)
        breach[i] = z > t
    return fire_steps(breach, rows.steps)


def rank_loss_z(rows: Rows, t: float) -> list[int]:
    """Each rank's loss against the other ranks' at the same step (cross-rank robust z)."""
    med = np.median(rows.loss, axis=1, keepdims=True)
    mad = np.median(np.abs(rows.loss - med), axis=1, keepdims=True)
    z = np.abs(robust_z(rows.loss, med, mad, 0.01 * np.abs(med) + 1e-12))
    return fire_steps(z.max(axis=1) > t, rows.steps)


def grad_norm_threshold(rows: Rows, t: float) -> list[int]:
    """Any rank's gradient norm over t× the median of every rank's over the last 50 steps."""
    breach = np.zeros(len(rows.steps), dtype=bool)
    for i in range(50, len(rows.steps)):
        ref = np.median(rows.grad[i - 50 : i])
        breach[i] = rows.grad[i].max() > t * ref
    return fire_steps(breach, rows.steps)


BASELINES = {
    "averaged-loss spike (z)": (avg_loss_spike, (3.0, 4.0, 6.0, 8.0, 12.0, 20.0)),
    "per-rank loss z across ranks": (rank_loss_z, (2.0, 3.0, 3.5, 5.0, 8.0, 12.0)),
    "grad-norm threshold (× median)": (grad_norm_threshold, (1.25, 1.5, 2.0, 3.0, 5.0, 8.0)),
}

# The rule's two tests apart, each with the other off, and its defaults as they ship.
RULE_GRIDS = {
    "rule: run-level z (peers off)": ("z_threshold", (3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 20.0), "peer_window = 0\nidentical_steps = 0\nsame_batch_closeness = 0\n"),
    "rule: peer stand-out (z off)": ("peer_min_effect", (0.05, 0.1, 0.15, 0.25, 0.4, 0.6), "z_threshold = 1e9\nz_exit = 1e8\nidentical_steps = 0\nsame_batch_closeness = 0\n"),
    "rule: defaults": ("default", (0.0,), ""),
}


def rules_files(out: Path) -> list[tuple[str, float, Path]]:
    folder = out / "rules"
    folder.mkdir(exist_ok=True)
    files: list[tuple[str, float, Path]] = []
    for family, (key, values, rest) in RULE_GRIDS.items():
        for v in values:
            path = folder / f"{len(files):02d}.toml"
            body = "[silent_inconsistency]\n" + rest
            if key == "z_threshold":
                body += f"z_threshold = {v}\nz_exit = {min(3.0, v / 2)}\n"
            elif key == "peer_min_effect":
                body += f"peer_min_effect = {v}\n"
            path.write_text(body)
            files.append((family, v, path))
    return files


def replay(binary: str, samples: Path, files: list[tuple[str, float, Path]]) -> list[list[dict[str, Any]]]:
    sketches = samples.with_name(samples.name.replace(".samples.", ".sketches."))
    cmd = [binary, "replay", str(samples), "--world-size", str(WORLD)]
    if sketches.exists():
        cmd += ["--sketches", str(sketches)]
    for _, _, path in files:
        cmd += ["--rules", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return [json.loads(line)["alerts"] for line in done.stdout.splitlines() if line.strip()]


# --- scoring ----------------------------------------------------------------------------------


def score(runs: list[Run], fired: dict[str, list[int]]) -> dict[str, Any]:
    """Detection per (kind, size), delays, and false alerts, from each run's firing steps. A fault
    is detected by an alert that fires within WINDOW steps of it (one already firing from a
    false alarm does not count); beside it, the detections chance alone would give."""
    false, steps, delays = 0, 0, []
    per_size: dict[str, list[bool]] = {}
    for r in runs:
        events = fired[r.name]
        if r.fault_step is None:
            false += len(events)
            steps += STEPS
            continue
        false += sum(1 for s in events if s < r.fault_step)
        steps += r.fault_step
        after = [s for s in events if r.fault_step <= s <= r.fault_step + WINDOW]
        per_size.setdefault(f"{r.kind} {r.size:g}", []).append(bool(after))
        if after:
            delays.append(after[0] - r.fault_step)
    detected = sum(sum(v) for v in per_size.values())
    total = sum(len(v) for v in per_size.values())
    rate = false / steps if steps else 0.0
    return {
        # Detections a detector that knows nothing would score from its false-alert rate alone.
        "chance_detections": total * (1 - math.exp(-rate * (WINDOW + 1))),
        "false_alerts": false,
        "steps": steps,
        "false_per_1000": 1000 * false / steps if steps else None,
        "detected": detected,
        "fault_runs": total,
        "detection": detected / total if total else None,
        "median_delay": float(np.median(delays)) if delays else None,
        "per_size": {k: sum(v) / len(v) for k, v in per_size.items()},
    }


def analyse(out: Path, binary: str) -> dict[str, Any]:
    manifest = json.loads((out / "sweep.json").read_text())
    runs = [Run(**r) for r in manifest["runs"]]
    runs = [r for r in runs if (out / "exports" / f"{r.name}.samples.parquet").exists()]
    files = rules_files(out)
    # fired[detector][threshold][run] = firing steps
    fired: dict[str, dict[float, dict[str, list[int]]]] = {}
    for r in runs:
        samples = out / "exports" / f"{r.name}.samples.parquet"
        rows = read_rows(samples)
        for (family, value, _), alerts in zip(files, replay(binary, samples, files)):
            steps = [rows.step_at(a["fired_at_ms"]) for a in alerts if a["rule"] == "silent_inconsistency" and a["fired_at_ms"] is not None]
            fired.setdefault(family, {}).setdefault(value, {})[r.name] = sorted(steps)
            if family == "rule: defaults":
                every = [rows.step_at(a["fired_at_ms"]) for a in alerts if a["fired_at_ms"] is not None]
                fired.setdefault(ANY_RULE, {}).setdefault(value, {})[r.name] = sorted(every)
        for family, (fn, values) in BASELINES.items():
            for value in values:
                fired.setdefault(family, {}).setdefault(value, {})[r.name] = fn(rows, value)
    tuning = [r for r in runs if r.kind in TUNING_KINDS or (r.kind is None and r.seed == 0)]
    held = [r for r in runs if r not in tuning]
    result: dict[str, Any] = {"machine": manifest.get("machine"), "runs": len(runs), "detectors": {}}
    for family, by_value in fired.items():
        points = {v: {"all": score(runs, f), "tuning": score(tuning, f), "held_out": score(held, f)} for v, f in by_value.items()}
        # Tuned: the most sensitive threshold with no false alert on the tuning runs.
        quiet = [v for v, p in points.items() if p["tuning"]["false_alerts"] == 0]
        tuned = max(quiet, key=lambda v: (points[v]["tuning"]["detection"] or 0, -(points[v]["tuning"]["median_delay"] or 1e9))) if quiet else None
        result["detectors"][family] = {"points": {str(v): p for v, p in points.items()}, "tuned": tuned}
    return result


# --- report -----------------------------------------------------------------------------------


def report(result: dict[str, Any], runs: int) -> str:
    lines = [
        f"Fault sweep: {runs} runs of {STEPS} steps, {WORLD} ranks, faults on rank {RANK} from step {FAULT_STEP} ({result.get('machine')})",
        "",
        "Tuned on gradient-scale runs and healthy seed 0 (the most sensitive threshold without a false alert there); reported on the held-out kinds (gradient noise, label shuffles, bit flips, stale weights) and healthy seeds.",
        "",
        "| detector | tuned threshold | held-out detection | held-out median delay (steps) | held-out false alerts / 1,000 steps (95 % CI) | all runs: detection (by chance), false / 1,000 |",
        "|---|---|---|---|---|---|",
    ]
    for family, d in result["detectors"].items():
        if d["tuned"] is None:
            lines.append(f"| {family} | none quiet on the tuning runs | — | — | — | — |")
            continue
        p = d["points"][str(d["tuned"])]
        h, a = p["held_out"], p["all"]
        detection = "—"
        if h["fault_runs"]:
            dlo, dhi = proportion_interval(h["detected"], h["fault_runs"])
            detection = f"{h['detected']}/{h['fault_runs']} ({100 * dlo:.0f}–{100 * dhi:.0f} %)"
        false = "—"
        if h["steps"]:
            lo, hi = poisson_interval(h["false_alerts"])
            false = f"{h['false_per_1000']:.2f} ({1000 * lo / h['steps']:.2f}–{1000 * hi / h['steps']:.2f})"
        delay = "—" if h["median_delay"] is None else f"{h['median_delay']:g}"
        tuned = "—" if len(d["points"]) == 1 else f"{d['tuned']:g}"  # a single point is no tuning
        lines.append(f"| {family} | {tuned} | {detection} | {delay} | {false} | {a['detected']}/{a['fault_runs']} ({a['chance_detections']:.1f}), {a['false_per_1000']:.2f} |")
    lines += ["", "Detection by fault size at the tuned threshold (share of seeds detected):", ""]
    sizes = sorted({k for d in result["detectors"].values() for p in d["points"].values() for k in p["all"]["per_size"]}, key=lambda k: (k.split()[0], float(k.split()[1])))
    at_tuned = {family: d["points"][str(d["tuned"])]["all"]["per_size"] for family, d in result["detectors"].items() if d["tuned"] is not None}
    lines.append("| fault | " + " | ".join(at_tuned) + " |")
    lines.append("|---|" + "---|" * len(at_tuned))
    for k in sizes:
        lines.append(f"| {k} | " + " | ".join(f"{per[k]:.0%}" if k in per else "—" for per in at_tuned.values()) + " |")
    return "\n".join(lines)


def tick(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2f}".rstrip("0").rstrip(".")


def svg_plot(result: dict[str, Any], path: Path, y_key: str, y_label: str, y_max: float | None) -> None:
    """One polyline per detector over its thresholds: false alerts per 1,000 steps (x) against
    `y_key` (detection share, or median delay), all runs. A fault counts as detected when an
    alert fires at or after its step: one already firing from a false alarm does not count."""
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    series = []
    for family, d in result["detectors"].items():
        # Traced in threshold order (every grid runs from lenient to strict), as an ROC is.
        pts = sorted(((p["all"]["false_per_1000"], p["all"][y_key], float(v)) for v, p in d["points"].items() if p["all"][y_key] is not None), key=lambda t: t[2])
        series.append((family, pts))
    xs = [x for _, pts in series for x, _, _ in pts] or [1.0]
    ys = [y for _, pts in series for _, y, _ in pts] or [1.0]
    x_max = max(max(xs) * 1.1, 0.5)
    y_top = y_max if y_max is not None else max(max(ys) * 1.1, 1.0)
    w, h, left, bottom, top, right = 760, 460, 70, 50, 20, 260
    def px(x: float) -> float:
        return left + (w - left - right) * x / x_max
    def py(y: float) -> float:
        return h - bottom - (h - bottom - top) * y / y_top
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">', f'<rect width="{w}" height="{h}" fill="white"/>']
    parts.append(f'<line x1="{left}" y1="{py(0)}" x2="{w - right}" y2="{py(0)}" stroke="black"/><line x1="{left}" y1="{py(0)}" x2="{left}" y2="{top}" stroke="black"/>')
    for i in range(6):
        xv, yv = x_max * i / 5, y_top * i / 5
        parts.append(f'<text x="{px(xv)}" y="{h - bottom + 16}" text-anchor="middle">{tick(xv)}</text><text x="{left - 6}" y="{py(yv) + 4}" text-anchor="end">{tick(yv)}</text>')
    parts.append(f'<text x="{(left + w - right) / 2}" y="{h - 12}" text-anchor="middle">false alerts per 1,000 steps (healthy twins and pre-fault steps)</text>')
    parts.append(f'<text transform="translate(16,{(top + h - bottom) / 2}) rotate(-90)" text-anchor="middle">{y_label}</text>')
    for i, (family, pts) in enumerate(series):
        c = colours[i % len(colours)]
        if pts:
            parts.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(c, " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y, _ in pts)))
            for x, y, v in pts:
                parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.5" fill="{c}"><title>{family} at {v}: {x:.2f}, {y:.2f}</title></circle>')
        parts.append(f'<rect x="{w - right + 12}" y="{top + 18 * i}" width="12" height="12" fill="{c}"/><text x="{w - right + 30}" y="{top + 18 * i + 10}">{family}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "target" / "bench" / "detection-sweep"))
    p.add_argument("--seeds", type=int, default=2, help="seeds per fault size")
    p.add_argument("--healthy", type=int, default=5, help="healthy twins (seed 0 tunes, the rest are held out)")
    p.add_argument("--cores", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--analyse", action="store_true", help="only analyse the runs already under --out")
    p.add_argument("--figures", default=None, help="also copy the plots and table into this folder (docs/figures)")
    p.add_argument("--quick", action="store_true", help="a check of the script: one healthy and one faulty run of 120 steps")
    args = p.parse_args(argv)
    global STEPS, FAULT_STEP, SIZES
    if args.quick:
        STEPS, FAULT_STEP, SIZES = 120, 60, {"grad_scale": ("factor", (8.0,))}
        args.healthy, args.seeds = 1, 1
    out = Path(args.out)
    binary = os.environ.get("RANKWATCH_BIN") or str(ROOT / "target" / "release" / "rankwatch")
    if not args.analyse:
        out.mkdir(parents=True, exist_ok=True)
        runs = matrix(args.seeds, args.healthy)
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}"
        (out / "sweep.json").write_text(json.dumps({"machine": machine, "runs": [r.__dict__ for r in runs]}, indent=1))
        # Runs exported by an earlier call (more seeds asked for later) are not trained again.
        todo = [r for r in runs if not (out / "exports" / f"{r.name}.samples.parquet").exists()]
        print(f"fault sweep: {len(runs)} runs of {STEPS} steps, {len(todo)} to train ({machine})", flush=True)
        started = time.monotonic()
        train(todo, out, args.cores)
        print(f"trained in {time.monotonic() - started:.0f} s", flush=True)
    result = analyse(out, binary)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    text = report(result, result["runs"])
    (out / "summary.md").write_text(text + "\n")
    svg_plot(result, out / "detection-roc.svg", "detection", "detection probability (all fault runs)", 1.0)
    svg_plot(result, out / "detection-delay.svg", "median_delay", "median delay, fault to firing (steps)", None)
    if args.figures:
        figures = Path(args.figures)
        for name in ("detection-roc.svg", "detection-delay.svg"):
            (figures / name.replace("detection-", "detection-sweep-")).write_text((out / name).read_text())
        (figures / "detection-sweep.md").write_text(text + "\n")
        (figures / "detection-sweep.json").write_text(json.dumps(result, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
