"""Two collector binaries side by side on the same Parquet files, with DuckDB beside them.

What a change to the read path did, measured as `bench/collector_bench.py queries` measures
(the same run shape, the same two dashboard queries, the same DuckDB aggregation), but with a
baseline binary serving a copy of the same data directory in the same session, interleaved
round by round so that a noisy machine moves both alike. Also checks that both binaries answer
byte for byte the same.

    python bench/query_ab.py --baseline OLD_BIN --candidate NEW_BIN --rows 10000000 --data /tmp/q10m

The data directory is built by the candidate on first use (kept for later runs); its copy is
removed afterwards. Prints one Markdown row per query and system: the p50 of each round and
their median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import cast

import duckdb
import requests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="the collector binary before the change")
    p.add_argument("--candidate", required=True, help="the collector binary after it")
    p.add_argument("--rows", type=int, default=1_000_000, help="samples in the run (64 layers x 8 ranks)")
    p.add_argument("--data", required=True, type=Path, help="data directory, built on first use and kept")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=25, help="calls per p50")
    args = p.parse_args()
    os.environ["RANKWATCH_BIN"] = args.candidate
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import collector_bench as cb

    if not args.data.exists():
        proc, url = cb.start_collector(args.data, "--hot-budget-bytes", str(256 << 20), cpus=None)
        try:
            rows, layers, ranks = 100_000, 64, 8
            steps_per = rows // (layers * ranks)
            body = lambda i: (cb.ipc_bytes(cb.samples_batch("q", i * (steps_per + 1), rows)), {"content-type": cb.ARROW})
            cb.post_all(f"{url}/api/v1/ingest", body, 4, count=args.rows // rows)
        finally:
            cb.stop(proc)  # flushes everything to Parquet
    copy = Path(f"{args.data}-copy")
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(args.data, copy)

    def serve(binary: str, data: Path) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen([binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env={**os.environ, "RANKWATCH_LOG": "warn"})
        assert proc.stdout is not None  # stdout=PIPE
        return proc, proc.stdout.readline().strip().rsplit(" ", 1)[1]

    servers = [serve(args.baseline, args.data), serve(args.candidate, copy)]
    try:
        session = requests.Session()

        def ask(url: str, what: str) -> bytes:
            params = cast("dict[str, str | int]", {"metric": "spectral.ratio", "points": 1000} | ({"layer": 17, "rank": 3} if what == "series" else {}))
            return session.get(f"{url}/api/v1/runs/q/{what}", params=params, timeout=600, headers={"accept-encoding": "identity"}).content

        (_, old), (_, new) = servers
        width = json.loads(ask(new, "heatmap"))["buckets"]["width"]
        for what in ("series", "heatmap"):
            same = ask(old, what) == ask(new, what)
            print(f"{args.rows:,} samples, {what}: the two binaries' answers are {'identical' if same else 'DIFFERENT'}")
            if not same:
                sys.exit(1)
        files = f"{args.data}/table=samples/*/*.parquet"
        con = duckdb.connect()
        where = {"series": "layer = 17 AND rank = 3", "heatmap": "site IS NULL"}
        group = {"series": "", "heatmap": "layer, "}
        duck = {w: f"""SELECT {group[w]}step // {width} AS b, min(value), max(value), arg_max(value, step), count(*),
                       count(*) FILTER (WHERE isnan(value) OR isinf(value))
                       FROM read_parquet('{files}', hive_partitioning = true)
                       WHERE run = 'q' AND metric = 'spectral.ratio' AND {where[w]} GROUP BY {group[w]}b""" for w in where}
        results: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for what in ("series", "heatmap"):
                for name, fn in ((f"{what}: baseline", lambda w=what: ask(old, w)), (f"{what}: candidate", lambda w=what: ask(new, w)),
                                 (f"{what}: DuckDB", lambda w=what: con.sql(duck[w]).to_arrow_table())):
                    results.setdefault(name, []).append(cb.p50(fn, args.calls))
        parts = len(list(args.data.glob("table=samples/*/*.parquet")))
        print("\n| samples (parts), width | query | p50 per round, ms | median |\n|---|---|---|---|")
        for name, values in results.items():
            print(f"| {args.rows:,} ({parts}), {width} | {name} | {' / '.join(f'{v:.1f}' for v in values)} | {statistics.median(values):.1f} |")
    finally:
        for proc, _ in servers:
            cb.stop(proc)
        shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    main()
