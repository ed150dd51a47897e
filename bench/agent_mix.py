"""The agent's default report, as the collector receives it: captured from a real training job,
replayed at any number of ranks and steps by the ingest benchmarks (issue 47).

`python bench/agent_mix.py capture` trains `sdk-python/examples/train_ddp.py` (its default model,
4 layers, 4 gloo ranks) for 300 steps with every probe at its default cadence (`Cadence()`:
gradients every step, sketches and the replica fingerprint every 10, activations every 25, the
spectral probe every 50, the optimizer's fingerprint every 100) against a collector, reads back
every row the agent sent, and writes one whole period of the schedule, steps 200-299 (the loss
flat by then), to `bench/agent_mix.json`: for each step of the period, each rank's rows (metric,
layer, site, value) and whether it sent a gradient sketch. Rows without a rank (the spectral
probe's, which a rank sends for the layers it measures: layer i on rank i mod world) are given
to that rank. The all-ranks rows the collector derives are not the agent's and are left out.

`steps(ranks, first, count)` replays the period over any number of ranks: rank r sends what
rank r mod 4 of the capture sent, and rank-less layer rows are sent by rank `layer mod ranks`.
Except its loss and gradient norm: replica g = r div 4 sends the values its captured rank had
g steps later in the period (and past 4 · 100 ranks, where they repeat, scaled by
1 + (g div 100) · 2⁻⁴⁰), the rule of `rankwatch_analytics::agent_mix`. Replayed as captured,
groups of ranks would agree to the bit at every step, which healthy ranks never do, and the
identical-data test would name them at every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
MIX = Path(__file__).resolve().parent / "agent_mix.json"
PERIOD = 100  # the schedule's period: lcm of the default cadences (1, 10, 25, 50, 100)
CAPTURED_FROM = 200  # the first step of the period kept


@dataclass(frozen=True)
class Row:
    rank: int | None
    metric: str
    layer: int | None
    site: str | None
    value: float


@dataclass(frozen=True)
class Report:
    """What one rank sends at one step."""

    rank: int
    step: int
    rows: list[Row]
    sketch: bool


def capture(bin_path: str) -> None:
    """Trains the example against a fresh collector and writes `agent_mix.json`."""
    import requests

    def sql(url: str, query: str) -> list[dict[str, object]]:
        r = requests.post(f"{url}/api/v1/sql", json={"sql": query}, timeout=120)
        r.raise_for_status()
        body = r.json()
        assert not body["truncated"], "the capture's answer was cut; raise --sql-max-result-bytes"
        return list(body["rows"])

    ranks, steps = 4, CAPTURED_FROM + PERIOD
    with tempfile.TemporaryDirectory() as d:
        proc = subprocess.Popen([bin_path, "serve", "--listen", "127.0.0.1:0", "--data-dir", f"{d}/data"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().strip().rsplit(" ", 1)[1]
            subprocess.run([sys.executable, str(ROOT / "sdk-python/examples/train_ddp.py"), "--nproc", str(ranks),
                            "--steps", str(steps), "--run", "mix", "--collector", url],
                           check=True, timeout=3600, cwd=ROOT / "sdk-python", stdout=subprocess.DEVNULL)
            window = f"run = 'mix' AND step >= {CAPTURED_FROM} AND step < {steps}"
            # The agent's rows: a rank's, or a layer's (the spectral probe's); the collector's
            # derived all-ranks rows have neither.
            rows = sql(url, f"SELECT rank, step, metric, layer, site, value FROM samples WHERE {window} "
                            "AND (rank IS NOT NULL OR layer IS NOT NULL) AND metric <> 'finished' "
                            "ORDER BY step, rank, metric, layer, site")
            sketches = sql(url, f"SELECT rank, step FROM sketches WHERE {window}")
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    period: list[dict[str, object]] = []
    for offset in range(PERIOD):
        step = CAPTURED_FROM + offset
        per_rank: list[list[list[object]]] = [[] for _ in range(ranks)]
        for r in rows:
            if r["step"] == step:
                sender = r["rank"] if r["rank"] is not None else int(str(r["layer"])) % ranks
                per_rank[int(str(sender))].append([r["rank"] is not None, r["metric"], r["layer"], r["site"], r["value"]])
        sketched = sorted(int(str(s["rank"])) for s in sketches if s["step"] == step)
        period.append({"offset": offset, "ranks": per_rank, "sketches": sketched})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    MIX.write_text(json.dumps({
        "source": f"sdk-python/examples/train_ddp.py --nproc {ranks} --steps {steps}, default model and cadence, "
                  f"steps {CAPTURED_FROM}-{steps - 1}, captured at {commit}",
        "world": ranks,
        "period": period,
    }, indent=None, separators=(",", ":")) + "\n")
    total = len(rows)
    print(f"{MIX}: {total} rows over {PERIOD} steps x {ranks} ranks ({total / PERIOD / ranks:.2f} a rank a step), "
          f"{len(sketches)} sketches")


# A captured row: (has a rank, metric, layer, site, value).
Captured = tuple[bool, str, "int | None", "str | None", float]


@dataclass(frozen=True)
class PeriodStep:
    ranks: list[list[Captured]]  # by captured rank
    sketches: list[int]  # captured ranks that sent a sketch


@cache
def _period() -> tuple[int, list[PeriodStep]]:
    data = json.loads(MIX.read_text())
    steps = [PeriodStep([[(bool(r[0]), str(r[1]), r[2], r[3], float(r[4])) for r in rank] for rank in e["ranks"]],
                        [int(x) for x in e["sketches"]]) for e in data["period"]]
    return int(data["world"]), steps


# What a replica reads from a later step: the values of the rank's own batch that the
# identical-data test compares to the bit.
BATCH_VALUES = ("loss", "grad_norm")


def report(rank: int, step: int, ranks: int) -> Report:
    """What rank `rank` of a `ranks`-rank job sends at `step`, from the captured period."""
    world, period = _period()
    entry = period[step % PERIOD]
    # This rank's own rows, as the captured rank of the same residue sent them; a replica's
    # loss and gradient norm from that rank's step `replica` steps on.
    replica = rank // world
    later = {metric: value for ranked, metric, _, _, value in period[(step + replica) % PERIOD].ranks[rank % world]
             if ranked and metric in BATCH_VALUES}
    scale = 1.0 + float(replica // PERIOD) * 2.0**-40

    def value_of(metric: str, value: float) -> float:
        if replica > 0 and metric in later:
            return later[metric] * scale
        return value

    rows = [Row(rank, metric, layer, site, value_of(metric, value))
            for ranked, metric, layer, site, value in entry.ranks[rank % world] if ranked]
    # The layer rows this rank measures (layer i on rank i mod ranks).
    rows += [Row(None, metric, layer, site, value) for captured in entry.ranks
             for ranked, metric, layer, site, value in captured if not ranked and layer is not None and layer % ranks == rank]
    return Report(rank, step, rows, rank % world in entry.sketches)


def tables(run: str, ranks: int, count: int, rows: int, clients: int) -> list[pa.Table]:
    """`count` samples batches of `rows` rows each, for `clients` clients each sending the
    reports of its share of `ranks` ranks (ranks c, c + clients, ...; each rank's report whole,
    its rows in metric order) step after step, cut every `rows` rows. Batch i is client
    i mod `clients`'s: each client must send its batches in order, as an agent does, or a
    rank's steps would arrive after the steps they precede had closed."""
    out: list[pa.Table | None] = [None] * count
    for client in range(clients):
        ranked, steps, metrics, layers, sites, values = [], [], [], [], [], []
        for offset in range(PERIOD):
            for rank in range(client, ranks, clients):
                for row in report(rank, offset, ranks).rows:
                    ranked.append(row.rank)
                    steps.append(offset)
                    metrics.append(row.metric)
                    layers.append(row.layer)
                    sites.append(row.site)
                    values.append(row.value)
        period = len(steps)
        columns = {
            "rank": pa.array(ranked, pa.uint32()),
            "metric": pa.array(metrics, pa.string()),
            "layer": pa.array(layers, pa.uint32()),
            "site": pa.array(sites, pa.string()),
            "value": pa.array(values, pa.float64()),
        }
        step_of = np.asarray(steps, dtype=np.int64)
        for j, b in enumerate(range(client, count, clients)):
            i = np.arange(j * rows, (j + 1) * rows, dtype=np.int64)
            at = pa.array(i % period)
            step = step_of[i % period] + (i // period) * PERIOD
            out[b] = pa.table({
                "run": pa.array(np.full(rows, run, dtype=object), pa.string()),
                "rank": columns["rank"].take(at),
                "step": pa.array(step.astype(np.uint64)),
                "time": pa.array(1_700_000_000_000 + step * 1000, pa.timestamp("ms", tz="UTC")),
                "metric": columns["metric"].take(at),
                "layer": columns["layer"].take(at),
                "site": columns["site"].take(at),
                "value": columns["value"].take(at),
            })
    return [t for t in out if t is not None]


def rows_per_rank_step() -> float:
    """The mix's mean rows a rank a step (at the captured world size)."""
    world, period = _period()
    return sum(len(rows) for e in period for rows in e.ranks) / len(period) / world


if __name__ == "__main__":
    if sys.argv[1:] != ["capture"]:
        sys.exit("usage: RANKWATCH_BIN=... python bench/agent_mix.py capture")
    capture(os.environ["RANKWATCH_BIN"])
