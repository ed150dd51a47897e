"""Detection benchmark (`cargo xtask bench detection`): how often the default rules alert on
healthy training, with confidence intervals, per rule.

Many healthy runs of the real-text harness (sdk-python/examples/train_text.py: a byte-level
GPT on text cut from the Python standard library, warm-up and cosine decay) stream through
the real agent to one real collector running its default rules (or `--rules FILE`). The
matrix varies what changes healthy statistics in practice: model size, number of ranks K,
uniform sampling against per-rank contiguous shards, a data-mix switch part-way, a checkpoint
resume (a fresh set of processes under the same run name), dropout, a higher learning rate,
seeds — and a fine-tune of a pretrained model (sdk-python/examples/finetune_minilm.py:
MiniLM's 6 BERT layers on the same text, masked-LM). Every alert that fires on one of them is
a false alert.

Reported per rule: false alerts per 1,000 steps with an exact Poisson 95 % interval (steps are
counted once per run, not per rank), and the share of runs with at least one, with a
Clopper-Pearson 95 % interval. "0 of 5 runs" allows up to 52 % of runs; 0 of 32 allows 11 %.

Runs are scheduled so their ranks never outnumber the cores (one is kept for the collector);
each run's alerts and losses are written under `--out` as it finishes (runs.jsonl), so a
benchmark cut short still reports what it ran. `summary.md` and `summary.json` hold the table.
Each finished run's samples are exported to `--out/exports/RUN.samples.parquet`, so the same
rows can be judged again under other rules (`rankwatch replay`) without training again.

    python bench/detection_bench.py                      # the full matrix, 2,000 steps a run
    python bench/detection_bench.py --steps 300 --only tiny-k2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "sdk-python" / "examples" / "train_text.py"
FINETUNE = ROOT / "sdk-python" / "examples" / "finetune_minilm.py"
RULES = ("rank_collapse", "silent_inconsistency", "loss_spike", "activation_outlier", "nonfinite", "stale_rank")
TINY = ["--layers", "2", "--width", "64", "--heads", "4"]
SMALL = ["--layers", "4", "--width", "128", "--heads", "4"]


@dataclass
class Scenario:
    name: str
    nproc: int
    args: list[str] = field(default_factory=list)
    script: Path = EXAMPLE  # the training script; it takes train_text.py's run options
    stop_at: int | None = None  # end the run here, its schedule still spanning `steps`


def healthy_matrix(steps: int) -> list[Scenario]:
    """The healthy runs, most varied first (a run cut short by a time limit loses the tail)."""
    half, resume = steps // 2, steps * 3 // 5
    out: list[Scenario] = []

    def add(name: str, nproc: int, seeds: range, *args: str) -> None:
        out.extend(Scenario(f"{name}-s{s}", nproc, [*args, "--seed", str(s)]) for s in seeds)

    add("tiny-k4", 4, range(2), *TINY)
    add("tiny-k4-shard", 4, range(2), *TINY, "--sampling", "shard")
    add("tiny-k4-switch", 4, range(2), *TINY, "--switch", f"{half}:reference")
    add("tiny-k4-resume", 4, range(2), *TINY, "--resume-at", str(resume))
    add("small-k4", 4, range(2), *SMALL)
    add("tiny-k2", 2, range(2), *TINY)
    add("tiny-k8", 8, range(1), *TINY)
    add("tiny-k4-dropout", 4, range(2), *TINY, "--dropout", "0.1")
    add("tiny-k4-lr3e-3", 4, range(2), *TINY, "--lr", "3e-3")
    add("small-k2-shard-switch", 2, range(2), *SMALL, "--sampling", "shard", "--switch", f"{half}:code")
    add("tiny-k4", 4, range(2, 6), *TINY)
    add("tiny-k2", 2, range(2, 4), *TINY)
    add("tiny-k4-shard", 4, range(2, 4), *TINY, "--sampling", "shard")
    add("tiny-k4-switch", 4, range(2, 4), *TINY, "--switch", f"{half}:code")
    add("tiny-k4-resume", 4, range(2, 3), *TINY, "--resume-at", str(resume))
    add("small-k4", 4, range(2, 3), *SMALL)
    add("tiny-k8", 8, range(1, 2), *TINY)
    add("tiny-k4-dropout", 4, range(2, 3), *TINY, "--dropout", "0.1")
    # A fine-tune of a pretrained model (MiniLM, 6 BERT layers): ratios of 4–23 and high token
    # cosine from the first step. Last: at ~0.5 s a step on one core, it is the slowest.
    out.extend(Scenario(f"minilm-ft-k2-s{s}", 2, ["--seed", str(s)], FINETUNE) for s in range(2))
    return out


def seed_matrix(steps: int) -> list[Scenario]:
    """The seed experiment of arXiv 2602.14462 as the paper set it up: each rank draws its
    batches from its own generator over the whole corpus, with dropout, and the data seed is
    the same on every rank, different on rank 0 alone, or different per rank (the correct
    setting), each over three seeds."""
    return [
        Scenario(f"seeds-{mode}-s{seed}", 4, [*TINY, "--dropout", "0.1", "--seed-mode", mode, "--seed", str(seed)])
        for mode in ("same", "rank0", "per-rank")
        for seed in range(3)
    ]


# The cross-rank statistics the paper reports (loss std and range, std of gradient norms, mean
# pairwise cosine) and those the alerts use (CVs, norm-weighted C_w), averaged over a run.
PAPER_METRICS = ("loss_std", "loss_range", "grad_norm_std", "cos_pair_mean")
OUR_METRICS = ("loss_cv", "grad_norm_cv", "cos_weighted")
FROM_STEP = 200


# --- intervals (exact, without scipy) ---------------------------------------------------------


def _poisson_cdf(k: int, lam: float) -> float:
    if lam <= 0:
        return 1.0
    term = math.exp(-lam)
    total = term
    for i in range(1, k + 1):
        term *= lam / i
        total += term
    return min(1.0, total)


def _bisect(f: Callable[[float], bool], lo: float, hi: float) -> float:
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(mid):
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def poisson_interval(k: int, alpha: float = 0.05) -> tuple[float, float]:
    """Exact (Garwood) interval for a Poisson mean given k events."""
    upper = _bisect(lambda lam: _poisson_cdf(k, lam) <= alpha / 2, 0.0, 10.0 * k + 50.0)
    lower = 0.0 if k == 0 else _bisect(lambda lam: 1.0 - _poisson_cdf(k - 1, lam) >= alpha / 2, 0.0, 10.0 * k + 50.0)
    return lower, upper


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def proportion_interval(k: int, n: int, alpha: float = 0.05) -> tuple[float, float]:
    """Clopper-Pearson interval for k successes in n trials."""
    lower = 0.0 if k == 0 else _bisect(lambda p: 1.0 - _binom_cdf(k - 1, n, p) >= alpha / 2, 0.0, 1.0)
    upper = 1.0 if k == n else _bisect(lambda p: _binom_cdf(k, n, p) <= alpha / 2, 0.0, 1.0)
    return lower, upper


# --- the collector and the runs ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_collector(data: Path, rules: str | None) -> tuple[subprocess.Popen[str], str]:
    binary = os.environ.get("RANKWATCH_BIN") or str(ROOT / "target" / "release" / "rankwatch")
    cmd = [binary, "serve", "--listen", f"127.0.0.1:{free_port()}", "--data-dir", str(data), "--flush-interval", "2s"]
    if rules:
        cmd += ["--rules", rules]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, "RANKWATCH_LOG": "warn"})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("rankwatch listening on http://"):
        proc.kill()
        raise SystemExit(f"the collector did not start ({binary}): {line!r}")
    return proc, line.strip().rsplit(" ", 1)[1]


def training_env() -> dict[str, str]:
    """The environment of a training run: this checkout's SDK ahead of the venv's. The venv's
    `rankwatch` is an editable install of whichever checkout last ran `maturin develop`, so
    without this a bench started from a frozen checkout would train with another checkout's
    SDK."""
    path = os.pathsep.join(p for p in (str(ROOT / "sdk-python"), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def check_sdk() -> None:
    """Refuses to train unless the runs import this checkout's SDK and its native module."""
    want = (ROOT / "sdk-python" / "rankwatch").resolve()
    probe = subprocess.run(
        [sys.executable, "-c", "import rankwatch, rankwatch._native as n; print(rankwatch.__file__); print(n.__file__)"],
        env=training_env(), capture_output=True, text=True, check=False,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        raise SystemExit(f"the training runs cannot import this checkout's SDK ({want}): {last}; build its native module there (`maturin develop` in sdk-python, or copy the built cdylib into {want})")
    found = [Path(line).resolve().parent for line in probe.stdout.split()]
    if any(f != want for f in found):
        raise SystemExit(f"the training runs would import the SDK from {', '.join(map(str, found))}, not this checkout's {want}")


def sql(url: str, query: str) -> list[dict[str, Any]]:
    r = requests.post(f"{url}/api/v1/sql", json={"sql": query}, timeout=60)
    r.raise_for_status()
    body = r.json()
    return body["rows"] if isinstance(body, dict) else body


def settle(url: str, run: str, last_step: int) -> list[dict[str, Any]]:
    """The run's alerts once the collector has aligned its last step (or after 30 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = sql(url, f"SELECT max(step) AS s FROM samples WHERE run = '{run}' AND rank IS NULL AND metric = 'loss_mean'")
        if rows and rows[0]["s"] is not None and rows[0]["s"] >= last_step:
            break
        time.sleep(0.5)
    r = requests.get(f"{url}/api/v1/alerts", params={"run": run}, timeout=60)
    r.raise_for_status()
    return list(r.json()["alerts"])


def run_one(s: Scenario, steps: int, url: str, out: Path, timeout: float) -> dict[str, Any]:
    where = out / "runs" / s.name
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    cmd = [sys.executable, str(s.script), "--nproc", str(s.nproc), "--steps", str(steps), "--run", s.name, "--collector", url, "--result-dir", str(where), "--spool-dir", str(where / "spool"), "--corpus-dir", str(out / "corpus"), *s.args]
    cmd += ["--stop-at", str(s.stop_at)] if s.stop_at else []
    env = training_env()
    started = time.monotonic()
    try:
        done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=timeout)
        error = None if done.returncode == 0 else done.stderr[-2000:]
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
    seconds = time.monotonic() - started
    alerts = settle(url, s.name, (s.stop_at or steps) - 1) if error is None else []
    means: dict[str, float | None] = {}
    if error is None:
        names = ", ".join(f"'{m}'" for m in (*PAPER_METRICS, *OUR_METRICS))
        rows = sql(url, f"SELECT metric, avg(value) AS v FROM samples WHERE run = '{s.name}' AND rank IS NULL AND metric IN ({names}) AND step >= {FROM_STEP} AND NOT isnan(value) GROUP BY metric")
        means = {m: None for m in (*PAPER_METRICS, *OUR_METRICS)} | {r["metric"]: r["v"] for r in rows}
    consistency = None
    if error is None:
        # The run's worker-consistency report over the same steps (GET /runs/{run}/consistency).
        answer = requests.get(f"{url}/api/v1/runs/{s.name}/consistency", params={"from": FROM_STEP}, timeout=60)
        consistency = answer.json() if answer.status_code == 200 else {"error": answer.text}
    losses: list[float] = []
    for f in sorted(where.glob("rank-0-from-*.json"), key=lambda p: int(p.stem.rsplit("-", 1)[1])):
        losses += json.loads(f.read_text())["losses"]
    keep = ("rule", "severity", "state", "layer", "rank", "site", "first_step", "last_step", "fired_at_ms", "outlier_ranks", "explanation")
    incidents: list[dict[str, Any]] = []
    if error is None:
        answer = requests.get(f"{url}/api/v1/incidents", params={"run": s.name}, timeout=60)
        if answer.status_code == 200:
            fields = ("id", "severity", "rules", "ranks", "every_rank", "layers", "first_step", "last_step", "fired_at_ms")
            incidents = [{k: i.get(k) for k in fields} for i in answer.json()["incidents"]]
    return {
        "name": s.name,
        "nproc": s.nproc,
        "args": s.args,
        "steps": steps,
        "stop_at": s.stop_at,
        "seconds": round(seconds, 1),
        "error": error,
        "first_loss": losses[0] if losses else None,
        "final_loss": sum(losses[-50:]) / len(losses[-50:]) if losses else None,
        "alerts": [{k: a.get(k) for k in keep} for a in alerts],
        "incidents": incidents,
        "means_from_step_200": means,
        "consistency_from_step_200": consistency,
    }


def schedule(scenarios: list[Scenario], steps: int, url: str, out: Path, cores: int, timeout: float, deadline: float, finished: Callable[[dict[str, Any]], None] = lambda r: None, blind: bool = False) -> list[dict[str, Any]]:
    """Runs scenarios in order, as many at once as `cores` allow; none starts after `deadline`.
    `finished` is called with each run's result as soon as it ends (so a bench killed later
    keeps what it had). `blind`: the progress lines leave out the alerts (a held-out set is
    judged when its part ends, not run by run as it trains)."""
    results: list[dict[str, Any]] = []
    lock = threading.Condition()
    busy = 0
    log = (out / "runs.jsonl").open("a")

    def worker(s: Scenario) -> None:
        nonlocal busy
        result = run_one(s, steps, url, out, timeout)
        finished(result)
        with lock:
            results.append(result)
            log.write(json.dumps(result) + "\n")
            log.flush()
            busy -= min(s.nproc, cores)
            fired = sum(1 for a in result["alerts"] if a["fired_at_ms"] is not None)
            alerts = "" if blind else f"  alerts fired: {fired}"
            print(f"  {s.name:<32} {result['seconds']:>6.1f} s  loss {result['first_loss'] or 0:.2f} → {result['final_loss'] or 0:.2f}{alerts}" + (f"  ERROR {result['error'][-200:]}" if result["error"] else ""), flush=True)
            lock.notify_all()

    threads: list[threading.Thread] = []
    for s in scenarios:
        with lock:
            while busy + min(s.nproc, cores) > cores:
                lock.wait()
            if time.monotonic() > deadline:
                print(f"  time limit reached: {len(scenarios) - len(threads)} runs not started", flush=True)
                break
            busy += min(s.nproc, cores)
        t = threading.Thread(target=worker, args=(s,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    log.close()
    return results


def replayed(binary: str, samples: Path, world_size: int | None = None, rules: Path | None = None) -> dict[str, Any]:
    """The run judged again from its exported rows by `rankwatch replay`, under `rules` (a
    `serve --rules` file), else the binary's defaults: its `alerts` and `incidents`."""
    cmd = [binary, "replay", str(samples)]
    cmd += ["--world-size", str(world_size)] if world_size else []
    cmd += ["--rules", str(rules)] if rules else []
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    judged = json.loads(done.stdout.splitlines()[0])
    return {"alerts": judged["alerts"], "incidents": judged["incidents"]}


def train_and_export(
    scenarios: list[Scenario],
    steps: int,
    out: Path,
    cores: int,
    tables: tuple[str, ...],
    timeout: float = 1800.0,
    rules: str | None = None,
    deadline: float = math.inf,
    data: Path | None = None,
    blind: bool = False,
) -> list[dict[str, Any]]:
    """Runs the scenarios against a fresh collector (`rules`, or its defaults) and saves each
    finished run's `tables` as out/exports/RUN.TABLE.parquet as soon as it ends, for analyses
    and `rankwatch replay` (which judges the same rows again under other rules). The collector's data lives
    in `data` (kept) or in a temporary directory (removed). `blind`: progress lines without the
    alerts (held-out sets)."""
    check_sdk()
    keep = data is not None
    if data is None:
        data = Path(tempfile.mkdtemp(prefix="rankwatch-bench-"))
    else:
        shutil.rmtree(data, ignore_errors=True)
    proc, url = start_collector(data, rules)
    try:
        exports = out / "exports"
        exports.mkdir(exist_ok=True)

        def export(r: dict[str, Any]) -> None:
            if r["error"] is not None:
                print(f"  {r['name']} failed, not exported: {r['error'][-300:]}", flush=True)
                return
            for table in tables:
                try:
                    answer = requests.get(f"{url}/api/v1/runs/{r['name']}/export", params={"table": table}, timeout=300)
                    answer.raise_for_status()
                except requests.RequestException as e:
                    print(f"  {r['name']}: the {table} export failed ({e})", flush=True)
                    continue
                # Written whole under a temporary name, then renamed: a killed bench leaves no
                # truncated file for replay to trip over.
                partial = exports / f".{r['name']}.{table}.parquet.partial"
                partial.write_bytes(answer.content)
                partial.replace(exports / f"{r['name']}.{table}.parquet")

        results = schedule(scenarios, steps, url, out, cores, timeout, deadline, export, blind)
        return results
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if not keep:
            shutil.rmtree(data, ignore_errors=True)


# --- the summary --------------------------------------------------------------------------------


def summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["error"] is None]
    steps = sum(r["steps"] for r in ok)
    rules: dict[str, dict[str, Any]] = {}
    for rule in RULES:
        per_run = [sum(1 for a in r["alerts"] if a["rule"] == rule and a["fired_at_ms"] is not None) for r in ok]
        k = sum(per_run)
        runs_with = sum(1 for n in per_run if n)
        lo, hi = poisson_interval(k)
        plo, phi = proportion_interval(runs_with, len(ok)) if ok else (0.0, 1.0)
        rules[rule] = {
            "false_alerts": k,
            "per_1000_steps": 1000 * k / steps if steps else None,
            "per_1000_steps_ci": [1000 * lo / steps, 1000 * hi / steps] if steps else None,
            "runs_with_alert": runs_with,
            "runs_share_ci": [plo, phi],
        }
    total = sum(v["false_alerts"] for v in rules.values())
    lo, hi = poisson_interval(total)
    any_runs = sum(1 for r in ok if any(a["fired_at_ms"] is not None for a in r["alerts"]))
    return {
        "runs": len(ok),
        "failed_runs": [r["name"] for r in results if r["error"] is not None],
        "steps": steps,
        "rules": rules,
        "all": {
            "false_alerts": total,
            "per_1000_steps": 1000 * total / steps if steps else None,
            "per_1000_steps_ci": [1000 * lo / steps, 1000 * hi / steps] if steps else None,
            "runs_with_alert": any_runs,
            "runs_share_ci": list(proportion_interval(any_runs, len(ok))) if ok else [0.0, 1.0],
        },
    }


def table(summary: dict[str, Any], machine: str) -> str:
    lines = [
        f"{summary['runs']} healthy runs, {summary['steps']:,} steps in all ({machine})" + (f"; failed: {', '.join(summary['failed_runs'])}" if summary["failed_runs"] else ""),
        "",
        "| rule | false alerts | per 1,000 steps (95 % CI) | runs with one (95 % CI) |",
        "|---|---|---|---|",
    ]
    for rule, v in [*summary["rules"].items(), ("all rules", summary["all"])]:
        lo, hi = v["per_1000_steps_ci"] or (0, 0)
        plo, phi = v["runs_share_ci"]
        lines.append(f"| {rule} | {v['false_alerts']} | {v['per_1000_steps'] or 0:.3f} ({lo:.3f}–{hi:.3f}) | {v['runs_with_alert']} of {summary['runs']} ({100 * plo:.0f}–{100 * phi:.0f} %) |")
    return "\n".join(lines)


def _t95(n: int) -> float:
    return {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571}.get(n, 1.96)


def seed_table(results: list[dict[str, Any]], machine: str) -> str:
    """Per setting: each statistic's mean over seeds with a 95 % t-interval, and the alerts."""
    settings = ("same", "rank0", "per-rank")
    cols = (*PAPER_METRICS, *OUR_METRICS)
    lines = [
        f"Seed experiment: {len(results)} runs, 4 ranks, dropout 0.1, means over steps ≥ {FROM_STEP} ({machine})",
        "",
        "| setting | " + " | ".join(cols) + " | alerts fired (rule: named ranks) |",
        "|---|" + "---|" * len(cols) + "---|",
    ]
    for mode in settings:
        runs = [r for r in results if r["name"].startswith(f"seeds-{mode}-") and r["error"] is None]
        cells = []
        for m in cols:
            xs = [r["means_from_step_200"][m] for r in runs if r["means_from_step_200"].get(m) is not None]
            if not xs:
                cells.append("—")
                continue
            mean = sum(xs) / len(xs)
            half = _t95(len(xs)) * (sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5 / len(xs) ** 0.5 if len(xs) > 1 else float("nan")
            cells.append(f"{mean:.4g} ± {half:.2g}")
        fired = [f"{a['rule']}: {a['outlier_ranks']}" for r in runs for a in r["alerts"] if a["fired_at_ms"] is not None]
        lines.append(f"| {mode} ({len(runs)} seeds) | " + " | ".join(cells) + f" | {len(fired)}: {'; '.join(sorted(set(fired))) or '—'} |")
    # The paper's indicators read as the paper reads them: to assess each configuration's
    # worker-level consistency, beside what independent shards give (ratio ≈ 1).
    lines += [
        "",
        f"Worker-consistency report per setting (GET /api/v1/runs/{{run}}/consistency, steps ≥ {FROM_STEP}): each seed's ratio observed/independent shards",
        "",
        "| setting | loss ratio | gradient-norm ratio | C_w median | verdicts |",
        "|---|---|---|---|---|",
    ]
    for mode in settings:
        reports = [r["consistency_from_step_200"] for r in results if r["name"].startswith(f"seeds-{mode}-") and r["error"] is None and (r.get("consistency_from_step_200") or {}).get("verdict")]

        def ratios(key: str, reports: list[dict[str, Any]] = reports) -> str:
            xs = [rep[key]["ratio"] for rep in reports if rep.get(key)]
            return ", ".join(f"{x:.3g}" if isinstance(x, float | int) else str(x) for x in xs) or "—"

        cos = ", ".join(f"{rep['cos_weighted_median']:.3g}" for rep in reports if isinstance(rep.get("cos_weighted_median"), float | int)) or "—"
        verdicts = ", ".join(sorted({rep["verdict"] for rep in reports})) or "—"
        lines.append(f"| {mode} ({len(reports)} seeds) | {ratios('loss')} | {ratios('grad_norm')} | {cos} | {verdicts} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="healthy", choices=["healthy", "seeds"], help="healthy: the false-alert matrix; seeds: the seed experiment")
    p.add_argument("--steps", type=int, default=2000, help="steps per run")
    p.add_argument("--only", action="append", default=[], help="run only scenarios whose name starts with this (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="at most this many runs")
    p.add_argument("--shard", default="0/1", help="I/N: only every N-th scenario from the I-th, to split the matrix between machines")
    p.add_argument("--cores", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="ranks running at once (default: all cores but one)")
    p.add_argument("--rules", default=None, help="a rules file for the collector (default: its documented defaults)")
    p.add_argument("--run-timeout", type=float, default=1800.0)
    p.add_argument("--time-limit", type=float, default=None, help="start no run after this many seconds")
    p.add_argument("--out", default=str(ROOT / "target" / "bench" / "detection"))
    p.add_argument("--keep-data", action="store_true", help="keep the collector's data directory (under --out) instead of a temporary one (each run's samples are exported under --out/exports either way)")
    p.add_argument("--summarise", nargs="+", metavar="RUNS_JSONL", help="only print the table of runs already made (runs.jsonl files, e.g. from several machines)")
    args = p.parse_args(argv)
    if args.summarise:
        results = [json.loads(line) for f in args.summarise for line in Path(f).read_text().splitlines() if line.strip()]
        machines = ", ".join(f"{Path(f).parent.name}/{Path(f).name}" for f in args.summarise)
        if args.suite == "seeds":
            print(seed_table(results, machines))
        else:
            print(table(summarise(results), machines))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runs.jsonl").unlink(missing_ok=True)
    index, _, count = args.shard.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        p.error(f"--shard {args.shard!r}: expected I/N with 0 <= I < N")
    matrix = healthy_matrix(args.steps) if args.suite == "healthy" else seed_matrix(args.steps)
    scenarios = [s for s in matrix if not args.only or any(s.name.startswith(o) for o in args.only)]
    scenarios = scenarios[int(index) :: int(count)][: args.limit]
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}"
    print(f"detection bench ({args.suite}): {len(scenarios)} runs of {args.steps} steps, {args.cores} ranks at once ({machine})", flush=True)
    deadline = time.monotonic() + (args.time_limit if args.time_limit is not None else math.inf)
    data = out / "collector-data" if args.keep_data else None
    results = train_and_export(scenarios, args.steps, out, args.cores, ("samples",), args.run_timeout, args.rules, deadline, data)
    summary = summarise(results)
    summary["machine"] = machine
    summary["shard"] = args.shard
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    text = table(summary, machine) if args.suite == "healthy" else seed_table(results, machine)
    (out / "summary.md").write_text(text + "\n")
    print()
    print(text)
    return 1 if summary["failed_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
