"""Collapse lead time on natural collapses (`cargo xtask bench detection --suite collapse`).

Nothing here sets the measured quantity: the collapses come from training itself. A 4-layer
post-LN GPT (width 64) on the real-text harness trains normally for 300 steps, then either its
learning rate rises ×100 over 100 steps (an LR ramp: a mis-set schedule, a restart at the wrong
step) or its MLPs' learning rate alone does (the "1:1 rule" scenario: the MLPs outgrow
attention); each seed has a healthy twin, the same run without the change. A third kind is the
classic deep post-LN collapse: 8 layers trained without warm-up, which collapse within the first
tens of steps, before any baseline exists; its twin has the usual 100-step warm-up. A fourth,
healthy kind is a pre-LN GPT (4 layers × 128, lr 3e-3) probed as finely: what false alerts the
rules raise on a model without a plateau. Every run
streams through the real agent (token cosine every 5 steps, spectral metrics for every layer
every 10) to a real collector under its default rules.

Per run, the collapse onset is the first step, from the change on, with any of
- token cosine ≥ 0.9 on some layer (the tokens' states are nearly one direction),
- the data-free effective rank of some layer's linearised map at most half what it was over
  the 100 steps before the change (from its first value for the no-warm-up kind),
- loss divergence: the 10-step mean loss 10 % or more above its mean over the 50 steps before
  the change (not for the no-warm-up kind, whose loss never fell);
and the alert step is the step the job had reached when the first `rank_collapse` alert whose
first step is at or after the change fired (`fired_at`, not its first breach). Lead time =
onset − alert step: positive when the alert came first. Twins count as false alerts every
`rank_collapse` alert fired from step 200 on; the early-plateau alerts of post-LN models (their
loss really sits at the unigram level then) are reported apart.

`--thresholds` replays the saved rows under a grid of `rank_collapse`'s `drift_factor` and
`activation_outlier`'s `growth_factor` (each rule alone, the rest at its defaults): the share
of collapses alerted, the lead, and the healthy runs with a false alert per value, tuned on the
LR-ramp runs and the 4-layer twins (the most sensitive value with no false alert there) and
reported on the held-out kinds (MLP-only LR, and no warm-up for `rank_collapse`; 8-layer twins
and pre-LN for false alerts). Ties in detection go to the most sensitive value.

    python bench/detection_collapse.py --seeds 10           # train, then analyse
    python bench/detection_collapse.py --analyse            # analyse target/bench/detection-collapse again
    python bench/detection_collapse.py --analyse --thresholds   # and the threshold grids
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from detection_bench import (
    ROOT,
    Scenario,
    proportion_interval,
    replayed,
    train_and_export,
)

STEPS = 600
CHANGE = 300
MODEL = ["--layers", "4", "--width", "64", "--heads", "4", "--post-ln", "--lr", "1e-3"]
DEEP = ["--layers", "8", "--width", "64", "--heads", "4", "--post-ln", "--lr", "1e-3"]
PRE_LN = ["--layers", "4", "--width", "128", "--heads", "4", "--lr", "3e-3"]
PROBES = ["--cadence", "activations=5", "--cadence", "spectral=10", "--spectral-budget", "1"]
KINDS: dict[str, tuple[list[str], int | None]] = {
    # kind: (arguments, the step the change starts; None for a healthy twin)
    "lr_ramp": ([*MODEL, "--lr-ramp", f"{CHANGE}:100:100"], CHANGE),
    "mlp_lr": ([*MODEL, "--mlp-lr", f"{CHANGE}:100:100"], CHANGE),
    # Graded: the same ramps to ×10 and ×30 (the range), where a collapse may not come.
    "lr_ramp_x10": ([*MODEL, "--lr-ramp", f"{CHANGE}:10:100"], CHANGE),
    "lr_ramp_x30": ([*MODEL, "--lr-ramp", f"{CHANGE}:30:100"], CHANGE),
    "mlp_lr_x10": ([*MODEL, "--mlp-lr", f"{CHANGE}:10:100"], CHANGE),
    "mlp_lr_x30": ([*MODEL, "--mlp-lr", f"{CHANGE}:30:100"], CHANGE),
    "twin": (MODEL, None),
    "no_warmup": ([*DEEP, "--warmup", "0"], 0),
    "deep_twin": (DEEP, None),
    "pre_ln": (PRE_LN, None),
}
# Healthy runs' alerts from this step on are false; before it, post-LN models sit in a real
# early plateau (loss at the unigram level, token cosine ~1). Pre-LN models have none.
FALSE_FROM = {"twin": 200, "deep_twin": 200, "pre_ln": 0}
COSINE = 0.9
RANK_DROP = 0.5
LOSS_RISE = 1.10
# The simple baseline beside the rule: token cosine alone, an alert once some layer's token
# cosine has been at or above the level on this many probes in a row (the rule's persistence).
COSINE_ALONE = (0.5, 0.7)
COSINE_ALONE_PROBES = 3


@dataclass(frozen=True)
class Run:
    name: str
    kind: str
    seed: int

    @property
    def change(self) -> int | None:
        return KINDS[self.kind][1]


def matrix(seeds: int, kinds: list[str] | None = None) -> list[Run]:
    return [Run(f"collapse-{kind.replace('_', '-')}-s{s}", kind, s) for s in range(seeds) for kind in KINDS if not kinds or kind in kinds]


def train(runs: list[Run], out: Path, cores: int) -> None:
    scenarios = [Scenario(r.name, 1, [*KINDS[r.kind][0], *PROBES, "--seed", str(r.seed)]) for r in runs]
    train_and_export(scenarios, STEPS, out, cores, ("samples",), timeout=900.0)


# --- one run ------------------------------------------------------------------------------------


@dataclass
class Series:
    loss: dict[int, float]
    cosine: dict[int, dict[int, float]]  # layer -> step -> value
    erank: dict[int, dict[int, float]]
    steps: np.ndarray  # loss steps, ascending
    times: np.ndarray  # their measurement times, ms

    def step_when(self, time_ms: int) -> int:
        """The step the job had reached at `time_ms`."""
        i = int(np.searchsorted(self.times, time_ms, side="right")) - 1
        return int(self.steps[max(i, 0)])


def read_series(samples: Path) -> Series:
    table = pq.read_table(samples, columns=["rank", "step", "time", "metric", "layer", "value"])
    cols = {c: table.column(c).to_pylist() for c in ("rank", "step", "metric", "layer", "value")}
    stamps = table.column("time").cast("int64").to_pylist()  # milliseconds, as fired_at_ms
    loss: dict[int, float] = {}
    times: dict[int, int] = {}
    cosine: dict[int, dict[int, float]] = {}
    erank: dict[int, dict[int, float]] = {}
    for rank, step, metric, layer, value, stamp in zip(cols["rank"], cols["step"], cols["metric"], cols["layer"], cols["value"], stamps, strict=True):
        if metric == "loss" and rank == 0:
            loss[step], times[step] = value, stamp
        elif metric == "token_cosine" and rank in (0, None):
            cosine.setdefault(layer, {})[step] = value
        elif metric == "effective_rank" and rank in (0, None):
            erank.setdefault(layer, {})[step] = value
    steps = np.array(sorted(loss))
    return Series(loss, cosine, erank, steps, np.array([times[s] for s in steps]))


def first_cosine(s: Series, start: int) -> int | None:
    hits = [step for per in s.cosine.values() for step, v in per.items() if step >= start and v >= COSINE]
    return min(hits, default=None)


def first_rank_drop(s: Series, start: int) -> int | None:
    hits = []
    for per in s.erank.values():
        before = [v for step, v in per.items() if start - 100 <= step < start]
        ref = float(np.median(before)) if before else per[min(per)]
        hits += [step for step, v in per.items() if step >= max(start, 1) and v <= RANK_DROP * ref]
    return min(hits, default=None)


def cosine_alone(s: Series, start: int, level: float) -> int | None:
    """The step token cosine alone would alert at: the first probe from `start` that ends
    `COSINE_ALONE_PROBES` probes in a row at or above `level` on one layer."""
    hits = []
    for per in s.cosine.values():
        run = 0
        for step in sorted(per):
            run = run + 1 if per[step] >= level else 0
            if run >= COSINE_ALONE_PROBES and step >= start:
                hits.append(step)
                break
    return min(hits, default=None)


def first_divergence(s: Series, start: int) -> int | None:
    if start < 50:
        return None
    before = [s.loss[k] for k in range(start - 50, start) if k in s.loss]
    ref = float(np.mean(before))
    for step in range(start + 9, STEPS):
        window = [s.loss[k] for k in range(step - 9, step + 1) if k in s.loss]
        if window and (not all(map(math.isfinite, window)) or float(np.mean(window)) >= LOSS_RISE * ref):
            return step
    return None


def judge(run: Run, result: dict[str, Any], series: Series) -> dict[str, Any]:
    fired = [a for a in result["alerts"] if a["rule"] == "rank_collapse" and a["fired_at_ms"] is not None]
    out: dict[str, Any] = {"name": run.name, "kind": run.kind, "seed": run.seed, "final_loss": result["final_loss"]}
    if run.change is None:
        start = FALSE_FROM[run.kind]
        late = [a for a in fired if a["first_step"] >= start]
        early = [a for a in fired if a["first_step"] < start]
        out.update(false_alerts=len(late), plateau_alerts=len(early), plateau_last_step=max((a["last_step"] for a in early), default=None))
        out["other_alerts"] = sorted({a["rule"] for a in result["alerts"] if a["fired_at_ms"] is not None and a["rule"] != "rank_collapse" and a["first_step"] >= start})
        out["cosine_alone_false"] = {str(level): cosine_alone(series, start, level) is not None for level in COSINE_ALONE}
        return out
    start = run.change
    # The first alert to fire after the change (step_when grows with time: its step is the earliest).
    first = min((a for a in fired if a["first_step"] >= start), key=lambda a: a["fired_at_ms"], default=None)
    alert = None if first is None else series.step_when(first["fired_at_ms"])
    outcomes = {"cosine": first_cosine(series, start), "rank": first_rank_drop(series, start), "loss": first_divergence(series, start)}
    onset = min((v for v in outcomes.values() if v is not None), default=None)
    out.update(alert_step=alert, onset=onset, **{f"onset_{k}": v for k, v in outcomes.items()})
    out["lead"] = None if alert is None or onset is None else onset - alert
    for k in ("cosine", "rank", "loss"):
        out[f"lead_to_{k}"] = None if alert is None or outcomes[k] is None else cast(int, outcomes[k]) - alert
    for level in COSINE_ALONE:
        step = cosine_alone(series, start, level)
        out[f"cosine_alone_{level}"] = step
        out[f"cosine_alone_{level}_lead"] = None if step is None or onset is None else onset - step
    out["alert"] = None if first is None else f"{first['severity']} layer {first['layer']}: {first['explanation'][:140]}"
    out["alert_first_step"] = None if first is None else first["first_step"]
    return out


# Threshold grids: (key, values); each rules file sets one value of one rule.
GRIDS: dict[str, tuple[str, tuple[float, ...]]] = {
    "rank_collapse": ("drift_factor", (2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)),
    "activation_outlier": ("growth_factor", (3.0, 5.0, 10.0, 20.0, 50.0)),
}
TUNING = ("lr_ramp", "twin")
DEFAULTS = {"rank_collapse": 4.0, "activation_outlier": 10.0}


def saved_runs(out: Path) -> list[tuple[Run, dict[str, Any], Path]]:
    """Every finished, exported run under `out`: the run, its result line, its samples."""
    results = {}
    for line in (out / "runs.jsonl").read_text().splitlines():
        r = json.loads(line)
        results[r["name"]] = r  # a re-run replaces an earlier line
    saved = []
    for name, result in sorted(results.items()):
        kind, seed = name.removeprefix("collapse-").rsplit("-s", 1)
        samples = out / "exports" / f"{name}.samples.parquet"
        if result["error"] is None and samples.exists():
            saved.append((Run(name, kind.replace("-", "_"), int(seed)), result, samples))
    return saved


def analyse(out: Path, replay: str | None = None) -> dict[str, Any]:
    """Judges every exported run: by the alerts the live collector raised, or with `replay`
    (a rankwatch binary) by the alerts its rules raise on the same rows."""
    judged = []
    for run, result, samples in saved_runs(out):
        if replay is not None:
            result = {**result, "alerts": replayed(replay, samples)["alerts"]}
        judged.append(judge(run, result, read_series(samples)))
    summary = {}
    for kind, (_, change) in KINDS.items():
        rows = [j for j in judged if j["kind"] == kind]
        if not rows:
            continue
        if change is None:
            with_false = sum(1 for j in rows if j["false_alerts"])
            summary[kind] = {
                "runs": len(rows),
                "runs_with_false_alert": with_false,
                "runs_with_false_alert_ci": proportion_interval(with_false, len(rows)),
                "runs_with_plateau_alert": sum(1 for j in rows if j["plateau_alerts"]),
                "other_alerts": {rule: sum(1 for j in rows if rule in j["other_alerts"]) for rule in sorted({r for j in rows for r in j["other_alerts"]})},
                "cosine_alone_false": {str(level): sum(1 for j in rows if j["cosine_alone_false"][str(level)]) for level in COSINE_ALONE},
            }
            continue
        collapsed = [j for j in rows if j["onset"] is not None]
        leads = [j["lead"] for j in collapsed if j["lead"] is not None]
        summary[kind] = {
            "runs": len(rows),
            "collapsed": len(collapsed),
            "alerted": sum(1 for j in collapsed if j["alert_step"] is not None),
            "before_onset": sum(1 for v in leads if v > 0),
            "lead": _quantiles(leads),
            **{f"lead_to_{k}": _quantiles([j[f"lead_to_{k}"] for j in collapsed if j[f"lead_to_{k}"] is not None]) for k in ("cosine", "rank", "loss")},
            "first_outcome": {k: sum(1 for j in collapsed if j[f"onset_{k}"] == j["onset"]) for k in ("cosine", "rank", "loss")},
            # Runs that did not collapse: what the rule and the baseline said about them anyway.
            "not_collapsed_alerted": sum(1 for j in rows if j["onset"] is None and j["alert_step"] is not None),
            "cosine_alone": {
                str(level): {
                    "alerted": sum(1 for j in collapsed if j[f"cosine_alone_{level}"] is not None),
                    "before_onset": sum(1 for j in collapsed if (j[f"cosine_alone_{level}_lead"] or 0) > 0),
                    "lead": _quantiles([j[f"cosine_alone_{level}_lead"] for j in collapsed if j[f"cosine_alone_{level}_lead"] is not None]),
                    "not_collapsed_alerted": sum(1 for j in rows if j["onset"] is None and j[f"cosine_alone_{level}"] is not None),
                }
                for level in COSINE_ALONE
            },
        }
    return {"runs": judged, "summary": summary, "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs", "judged_by": "replay" if replay else "live", "date": time.strftime("%Y-%m-%d")}


def threshold_sweep(out: Path, binary: str) -> dict[str, Any]:
    """Replays every saved run once per grid value (`GRIDS`) and scores each value: for
    `rank_collapse`, collapses alerted after their change and the lead (as `judge` does), and
    healthy runs with a false alert; for `activation_outlier`, LR-ramp and MLP-LR runs alerted
    after the change (their activations grow with the step size) and healthy runs with an alert
    from `FALSE_FROM` on. Tuned on `TUNING`, reported on the other kinds."""
    folder = out / "rules"
    folder.mkdir(exist_ok=True)
    files: list[tuple[str, float, Path]] = []
    for rule, (key, values) in GRIDS.items():
        for v in values:
            path = folder / f"{rule}-{v:g}.toml"
            path.write_text(f"[{rule}]\n{key} = {v}\n")
            files.append((rule, v, path))
    # outcome[rule][value] = list of (kind, alerted or None, lead or None, false alert or None)
    outcome: dict[str, dict[float, list[tuple[str, bool | None, int | None, bool | None]]]] = {}
    for run, result, samples in saved_runs(out):
        series = read_series(samples)
        cmd = [binary, "replay", str(samples)] + [a for _, _, path in files for a in ("--rules", str(path))]
        lines = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
        for (rule, v, _), line in zip(files, lines, strict=True):
            alerts = json.loads(line)["alerts"]
            if rule == "rank_collapse":
                j = judge(run, {**result, "alerts": alerts}, series)
                if run.change is None:
                    row: tuple[str, bool | None, int | None, bool | None] = (run.kind, None, None, j["false_alerts"] > 0)
                else:
                    row = (run.kind, j["alert_step"] is not None, j["lead"], None)
            else:
                fired = [a for a in alerts if a["rule"] == rule and a["fired_at_ms"] is not None]
                if run.change is None:
                    row = (run.kind, None, None, any(a["first_step"] >= FALSE_FROM[run.kind] for a in fired))
                elif run.kind.startswith(("lr_ramp", "mlp_lr")):
                    row = (run.kind, any(a["first_step"] >= run.change for a in fired), None, None)
                else:
                    continue
            outcome.setdefault(rule, {}).setdefault(v, []).append(row)
    result = {}
    for rule, by_value in outcome.items():
        points = {}
        for v, rows in by_value.items():
            point = {}
            kinds: Callable[[str], bool]  # which kinds a split holds
            for split, kinds in (("tuning", lambda k: k in TUNING), ("held_out", lambda k: k not in TUNING)):
                part = [r for r in rows if kinds(r[0])]
                faults = [r for r in part if r[1] is not None]
                healthy = [r for r in part if r[3] is not None]
                leads = [r[2] for r in faults if r[2] is not None]
                point[split] = {
                    "alerted": sum(1 for r in faults if r[1]),
                    "collapses": len(faults),
                    "median_lead": float(np.median(leads)) if leads else None,
                    "healthy_with_false": sum(1 for r in healthy if r[3]),
                    "healthy": len(healthy),
                }
            point["per_kind"] = {k: sum(1 for r in rows if r[0] == k and (r[1] or r[3])) for k in sorted({r[0] for r in rows})}
            points[v] = point
        quiet = [v for v, p in points.items() if p["tuning"]["healthy_with_false"] == 0]
        tuned = max(quiet, key=lambda v: (points[v]["tuning"]["alerted"], -v)) if quiet else None
        result[rule] = {"key": GRIDS[rule][0], "points": {str(v): p for v, p in points.items()}, "tuned": tuned, "default": DEFAULTS[rule]}
    return result


def threshold_report(sweep: dict[str, Any]) -> str:
    lines = [
        "Threshold grids (each value replayed on every saved run; tuned on the LR-ramp runs and the 4-layer twins, the most sensitive value with no false alert there, ties to the most sensitive; held out: MLP-only LR (and no warm-up, for rank_collapse), 8-layer twins, pre-LN). The last column counts, per kind, the runs alerted: detections for collapse kinds, false alerts for healthy ones:",
        "",
        "| rule | value | tuning: alerted / faults | tuning: median lead to onset | tuning: healthy with a false alert | held out: alerted / faults | held out: median lead to onset | held out: healthy with a false alert (95 % CI) | per kind: runs alerted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for rule, d in sweep.items():
        for v, p in d["points"].items():
            t, h = p["tuning"], p["held_out"]
            lo, hi = proportion_interval(h["healthy_with_false"], h["healthy"]) if h["healthy"] else (0.0, 1.0)
            mark = " (tuned)" if d["tuned"] is not None and float(v) == d["tuned"] else ""
            mark += " (default)" if float(v) == d["default"] else ""
            lead, tuning_lead = ("—" if x["median_lead"] is None else f"{x['median_lead']:g}" for x in (h, t))
            kinds = ", ".join(f"{k} {n}" for k, n in p["per_kind"].items())
            lines.append(f"| {rule} | {d['key']} = {float(v):g}{mark} | {t['alerted']}/{t['collapses']} | {tuning_lead} | {t['healthy_with_false']}/{t['healthy']} | {h['alerted']}/{h['collapses']} | {lead} | {h['healthy_with_false']}/{h['healthy']} ({100 * lo:.0f}–{100 * hi:.0f} %) | {kinds} |")
    return "\n".join(lines) + "\n"


def _quantiles(values: list[int]) -> dict[str, float] | None:
    if not values:
        return None
    v = np.array(values, dtype=float)
    return {"n": len(values), "min": float(v.min()), "q25": float(np.percentile(v, 25)), "median": float(np.median(v)), "q75": float(np.percentile(v, 75)), "max": float(v.max())}


def report(result: dict[str, Any]) -> str:
    lines = [f"Natural collapses ({result['machine']}, {result['date']}): lead time = collapse onset − step the first `rank_collapse` alert fired (steps; > 0: warned first)", ""]
    lines += ["| kind | runs | collapsed | alerted | before onset | lead to onset: min / q25 / median / q75 / max | lead to cosine ≥ 0.9 / eff. rank halved / loss divergence: median (runs) | onset first seen by cosine / eff. rank / loss |", "|---|---|---|---|---|---|---|---|"]
    for kind, s in result["summary"].items():
        if "collapsed" not in s:
            continue
        lead = s["lead"]
        spread = " / ".join(f"{lead[k]:g}" for k in ("min", "q25", "median", "q75", "max")) if lead else "—"
        to_loss = " / ".join(f"{s[f'lead_to_{k}']['median']:g} ({s[f'lead_to_{k}']['n']})" if s[f"lead_to_{k}"] else "—" for k in ("cosine", "rank", "loss"))
        firsts = " / ".join(str(s["first_outcome"][k]) for k in ("cosine", "rank", "loss"))
        lines.append(f"| {kind} | {s['runs']} | {s['collapsed']} | {s['alerted']} | {s['before_onset']} | {spread} | {to_loss} | {firsts} |")
    levels = " / ".join(f"{level:g}" for level in COSINE_ALONE)
    lines += ["", f"Against token cosine alone (an alert once some layer's token cosine stayed ≥ {levels} for {COSINE_ALONE_PROBES} probes in a row), on the same runs:", "",
              f"| kind | collapsed | `rank_collapse`: alerted, before onset, median lead | cosine alone ≥ {levels}: alerted, before onset, median lead | runs that did not collapse, alerted by `rank_collapse` / cosine alone ≥ {levels} |", "|---|---|---|---|---|"]
    for kind, s in result["summary"].items():
        if "collapsed" not in s:
            continue
        rule = f"{s['alerted']}, {s['before_onset']}, {s['lead']['median']:g}" if s["lead"] else f"{s['alerted']}, {s['before_onset']}, —"
        alone = " / ".join(f"{c['alerted']}, {c['before_onset']}, {c['lead']['median']:g}" if c["lead"] else f"{c['alerted']}, {c['before_onset']}, —" for c in s["cosine_alone"].values())
        quiet = s["runs"] - s["collapsed"]
        never = f"{s['not_collapsed_alerted']} / " + " / ".join(str(c["not_collapsed_alerted"]) for c in s["cosine_alone"].values()) + f" of {quiet}" if quiet else "—"
        lines.append(f"| {kind} | {s['collapsed']} of {s['runs']} | {rule} | {alone} | {never} |")
    lines += ["", "| healthy runs | runs | with a false `rank_collapse` alert (95 % CI) | with one in the early plateau | other rules fired | false alerts of cosine alone ≥ " + levels + " |", "|---|---|---|---|---|---|"]
    for kind, s in result["summary"].items():
        if "collapsed" in s:
            continue
        lo, hi = s["runs_with_false_alert_ci"]
        others = ", ".join(f"{rule} ×{n}" for rule, n in s["other_alerts"].items()) or "none"
        alone = " / ".join(str(n) for n in s["cosine_alone_false"].values())
        lines.append(f"| {kind} (false from step {FALSE_FROM[kind]}) | {s['runs']} | {s['runs_with_false_alert']} ({100 * lo:.0f}–{100 * hi:.0f} %) | {s['runs_with_plateau_alert']} | {others} | {alone} |")
    lines += ["", "| run | alert step | onset (cosine / eff. rank / loss) | lead | first alert |", "|---|---|---|---|---|"]
    for j in result["runs"]:
        if "onset" in j:
            parts = " / ".join("—" if j[f"onset_{k}"] is None else str(j[f"onset_{k}"]) for k in ("cosine", "rank", "loss"))
            lines.append(f"| {j['name']} | {j['alert_step'] if j['alert_step'] is not None else '—'} | {parts} | {j['lead'] if j['lead'] is not None else '—'} | {(j['alert'] or '—').replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--kinds", nargs="+", choices=list(KINDS), default=None, help="train only these kinds (the analysis reads every run under --out)")
    p.add_argument("--cores", type=int, default=2, help="runs at once (each is one process)")
    p.add_argument("--out", type=Path, default=ROOT / "target" / "bench" / "detection-collapse")
    p.add_argument("--analyse", action="store_true", help="only analyse the runs already under --out")
    p.add_argument("--replay", action="store_true", help="with --analyse: judge the saved rows again with `rankwatch replay` ($RANKWATCH_BIN) instead of the live alerts")
    p.add_argument("--thresholds", action="store_true", help="also replay the saved rows under threshold grids of rank_collapse and activation_outlier ($RANKWATCH_BIN)")
    p.add_argument("--figures", type=Path, default=None, help="also copy the summary and raw results here (docs/figures)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.analyse:
        runs = matrix(args.seeds, args.kinds)
        print(f"training {len(runs)} runs of {STEPS} steps", flush=True)
        train(runs, args.out, args.cores)
    binary = os.environ.get("RANKWATCH_BIN") or str(ROOT / "target" / "release" / "rankwatch")
    result = analyse(args.out, binary if args.replay else None)
    text = report(result)
    if args.thresholds:
        result["thresholds"] = threshold_sweep(args.out, binary)
        text += "\n" + threshold_report(result["thresholds"])
    (args.out / "collapse.json").write_text(json.dumps(result, indent=1))
    (args.out / "summary.md").write_text(text)
    if args.figures is not None:
        args.figures.mkdir(parents=True, exist_ok=True)
        (args.figures / "detection-collapse.md").write_text(text)
        (args.figures / "detection-collapse.json").write_text(json.dumps(result, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
