"""Collector benchmarks, printed as tables (run by `cargo xtask bench`).

1. Ingest: Arrow IPC batches of 10,000 rows, fsync group commit on, the collector pinned to
   one core (taskset), several concurrent clients; beside it VictoriaMetrics (Debian package
   `victoria-metrics`) ingesting the same samples through its JSON-lines import API, also
   pinned to one core. Reports samples/s and the ratio.
2. Queries over a run of 10 M samples (64 layers x 8 ranks): `series` at 1,000 points and the
   64 x 1,000 `heatmap`, p50 over repeated calls, each beside DuckDB running the equivalent
   aggregation over the same Parquet files.
3. Storage: one 2 M-sample run through a collector on local disk and one on
   `--storage s3://` (moto's S3 server from PyPI): ingest rate, final flush, restart, and a
   series query reading the parts back.
4. Memory: 1,024 simulated ranks x 200 metrics at one step per second; peak RSS and rejects.
   Ten minutes by default (RANKWATCH_BENCH_MEMORY_SECONDS shortens it).

Numbers are targets, not assertions: the script prints them and the machine they ran on.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.ipc as ipc
import requests

BIN = os.environ["RANKWATCH_BIN"]
ARROW = "application/vnd.apache.arrow.stream"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_collector(data: Path, *extra: str, cpus: str | None = "0") -> tuple[subprocess.Popen, str]:
    cmd = [BIN, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data), *extra]
    if cpus and shutil.which("taskset"):
        cmd = ["taskset", "-c", cpus, *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "RANKWATCH_LOG": "warn"})
    line = proc.stdout.readline()
    assert line.startswith("rankwatch listening on"), line
    return proc, line.strip().rsplit(" ", 1)[1]


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=600)


def samples_batch(run: str, step0: int, rows: int, ranks: int = 8, layers: int = 64) -> pa.Table:
    """`rows` samples of spectral.ratio over layers x ranks, steps from step0."""
    per_step = ranks * layers
    idx = range(rows)
    return pa.table({
        "run": pa.array([run] * rows, pa.string()),
        "rank": pa.array([(i // layers) % ranks for i in idx], pa.uint32()),
        "step": pa.array([step0 + i // per_step for i in idx], pa.uint64()),
        "time": pa.array([1_700_000_000_000 + (step0 + i // per_step) * 1000 for i in idx], pa.timestamp("ms", tz="UTC")),
        "metric": pa.array(["spectral.ratio"] * rows, pa.string()),
        "layer": pa.array([i % layers for i in idx], pa.uint32()),
        "site": pa.array([None] * rows, pa.string()),
        "value": pa.array([1.0 + (i % 997) / 1000.0 for i in idx], pa.float64()),
    })


def ipc_bytes(table: pa.Table, compression: str | None = "zstd") -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema, options=ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def post_all(url: str, bodies: list[tuple[bytes, dict]], clients: int) -> float:
    session_local = threading.local()

    def send(item: tuple[bytes, dict]) -> None:
        s = getattr(session_local, "s", None)
        if s is None:
            s = session_local.s = requests.Session()
        body, headers = item
        while True:
            r = s.post(url, data=body, headers=headers, timeout=120)
            if r.status_code == 429:
                time.sleep(float(r.headers.get("retry-after", "1")))
                continue
            if r.status_code not in (200, 204):
                raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
            return

    started = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        list(pool.map(send, bodies))
    return time.perf_counter() - started


def bench_ingest(batches: int = 200, rows: int = 10_000, clients: int = 8) -> list[tuple]:
    print(f"\n# ingest: {batches} Arrow batches x {rows:,} rows, {clients} clients, server pinned to CPU 0", flush=True)
    tables = [samples_batch("ingest", i * (rows // 512 + 1), rows) for i in range(batches)]
    bodies = [(ipc_bytes(t), {"content-type": ARROW, "idempotency-key": f"ingest/0/bench/{i}"}) for i, t in enumerate(tables)]
    out = []
    with tempfile.TemporaryDirectory() as d:
        proc, url = start_collector(Path(d) / "data")
        try:
            secs = post_all(f"{url}/api/v1/ingest", bodies, clients)
        finally:
            stop(proc)
    rw = batches * rows / secs
    out.append(("rankwatch (Arrow IPC, zstd, WAL fsync group commit)", rw))

    vm = shutil.which("victoria-metrics") or "/usr/bin/victoria-metrics"
    if Path(vm).exists():
        lines = []
        for t in tables:
            cols = t.to_pydict()
            by_series: dict[tuple, tuple[list, list]] = {}
            for rank, layer, ts, v in zip(cols["rank"], cols["layer"], cols["time"], cols["value"]):
                key = (rank, layer)
                ms = int(ts.timestamp() * 1000)
                by_series.setdefault(key, ([], []))
                by_series[key][0].append(v)
                by_series[key][1].append(ms)
            body = "\n".join(
                json.dumps({"metric": {"__name__": "spectral_ratio", "run": "ingest", "rank": str(r), "layer": str(l)},
                            "values": vs, "timestamps": ts})
                for (r, l), (vs, ts) in by_series.items()
            ).encode()
            lines.append((body, {"content-type": "application/json"}))
        with tempfile.TemporaryDirectory() as d:
            port = free_port()
            cmd = [vm, f"-storageDataPath={d}", f"-httpListenAddr=127.0.0.1:{port}", "-retentionPeriod=100y"]
            if shutil.which("taskset"):
                cmd = ["taskset", "-c", "0", *cmd]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                for _ in range(100):
                    try:
                        requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
                        break
                    except requests.RequestException:
                        time.sleep(0.1)
                secs = post_all(f"http://127.0.0.1:{port}/api/v1/import", lines, clients)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
        out.append(("VictoriaMetrics (JSON-lines import)", batches * rows / secs))
    else:
        out.append(("VictoriaMetrics (not installed: apt-get install victoria-metrics)", float("nan")))
    print(f"{'system':60} {'samples/s':>14} {'vs rankwatch':>14}")
    for name, rate in out:
        print(f"{name:60} {rate:>14,.0f} {rate / out[0][1]:>14.2f}")
    return out


def p50(fn, n: int = 25) -> float:
    fn()  # warm caches, as a dashboard refresh would find them
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def bench_queries(total: int = 10_000_000) -> None:
    layers, ranks = 64, 8
    rows = 100_000
    print(f"\n# queries over one run of {total:,} samples ({layers} layers x {ranks} ranks), p50 of 25 calls", flush=True)
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "data"
        proc, url = start_collector(data, "--hot-budget-bytes", str(256 << 20), cpus=None)
        try:
            steps_per = rows // (layers * ranks)
            bodies = [(ipc_bytes(samples_batch("q", i * (steps_per + 1), rows)), {"content-type": ARROW})
                      for i in range(total // rows)]
            post_all(f"{url}/api/v1/ingest", bodies, 4)
        finally:
            stop(proc)  # flushes everything to Parquet
        proc, url = start_collector(data, cpus=None)
        try:
            s = requests.Session()
            run = s.get(f"{url}/api/v1/runs", timeout=60).json()["runs"][0]
            last = run["last_step"]
            series = lambda: s.get(f"{url}/api/v1/runs/q/series", params={"metric": "spectral.ratio", "layer": 17, "rank": 3, "points": 1000}, timeout=60).json()  # noqa: E731
            heat = lambda: s.get(f"{url}/api/v1/runs/q/heatmap", params={"metric": "spectral.ratio", "points": 1000}, timeout=60).json()  # noqa: E731
            rw_series, rw_heat = p50(series), p50(heat)
        finally:
            stop(proc)
        files = str(data / "table=samples" / "*" / "*.parquet")
        con = duckdb.connect()
        width = (last + 1 + 999) // 1000
        q_series = f"""SELECT step // {width} AS b, min(value), max(value), arg_max(value, step), count(*),
                       count(*) FILTER (WHERE isnan(value) OR isinf(value))
                       FROM read_parquet('{files}', hive_partitioning = true)
                       WHERE run = 'q' AND metric = 'spectral.ratio' AND layer = 17 AND rank = 3 GROUP BY b"""
        q_heat = f"""SELECT layer, step // {width} AS b, min(value), max(value), arg_max(value, step), count(*),
                     count(*) FILTER (WHERE isnan(value) OR isinf(value))
                     FROM read_parquet('{files}', hive_partitioning = true)
                     WHERE run = 'q' AND metric = 'spectral.ratio' AND site IS NULL GROUP BY layer, b"""
        duck_series = p50(lambda: con.execute(q_series).fetchall())
        duck_heat = p50(lambda: con.execute(q_heat).fetchall())
    print(f"{'query':34} {'rankwatch p50 ms':>17} {'DuckDB p50 ms':>14} {'DuckDB/rankwatch':>17} {'target':>10}")
    print(f"{'series, 1,000 points':34} {rw_series:>17.1f} {duck_series:>14.1f} {duck_series / rw_series:>17.2f} {'<= 50 ms':>10}")
    print(f"{'heatmap, 64 x 1,000':34} {rw_heat:>17.1f} {duck_heat:>14.1f} {duck_heat / rw_heat:>17.2f} {'<= 100 ms':>10}")


def start_moto() -> tuple[subprocess.Popen, str]:
    """moto's S3 server (a Python process: a floor for object storage, not S3's speed)."""
    import boto3

    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            requests.get(endpoint, timeout=1)
            break
        except requests.RequestException:
            time.sleep(0.1)
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench", aws_secret_access_key="bench",
                 region_name="us-east-1").create_bucket(Bucket="rankwatch-bench")
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": endpoint, "AWS_ALLOW_HTTP": "true"})
    return proc, endpoint


def bench_storage(total: int = 2_000_000) -> None:
    """The same run through a collector on local disk and one on object storage: ingest rate,
    the final flush (SIGTERM), a cold restart, and query latency reading the parts back."""
    rows = 100_000
    print(f"\n# storage: one run of {total:,} samples, local disk vs --storage s3:// (moto server)", flush=True)
    bodies = [(ipc_bytes(samples_batch("st", i * (rows // 512 + 1), rows)), {"content-type": ARROW})
              for i in range(total // rows)]
    moto, _ = start_moto()
    results = []
    try:
        for name, extra in [("local disk", ()), ("s3:// (moto)", ("--storage", "s3://rankwatch-bench/ds", "--node-id", "bench"))]:
            with tempfile.TemporaryDirectory() as d:
                data = Path(d) / "data"
                proc, url = start_collector(data, "--hot-budget-bytes", str(256 << 20), "--flush-interval", "1h", *extra, cpus=None)
                try:
                    secs = post_all(f"{url}/api/v1/ingest", bodies, 4)
                finally:
                    t = time.perf_counter()
                    stop(proc)
                    flush = time.perf_counter() - t
                t = time.perf_counter()
                proc, url = start_collector(data, *extra, cpus=None)
                start = time.perf_counter() - t
                try:
                    s = requests.Session()
                    series = lambda: s.get(f"{url}/api/v1/runs/st/series", params={"metric": "spectral.ratio", "layer": 17, "rank": 3, "points": 1000}, timeout=60).json()  # noqa: E731
                    q = p50(series, 10)
                finally:
                    stop(proc)
            results.append((name, total / secs, flush, start, q))
    finally:
        moto.terminate()
        moto.wait(timeout=30)
    print(f"{'storage':16} {'ingest samples/s':>17} {'final flush s':>14} {'restart s':>10} {'series p50 ms':>14}")
    for name, rate, flush, start, q in results:
        print(f"{name:16} {rate:>17,.0f} {flush:>14.2f} {start:>10.2f} {q:>14.1f}")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def bench_memory(seconds: int) -> None:
    ranks, metrics = 1024, 200
    print(f"\n# memory: {ranks} ranks x {metrics} metrics, one step per second, {seconds} s", flush=True)
    names = [f"user/m{i}" for i in range(metrics)]
    with tempfile.TemporaryDirectory() as d:
        proc, url = start_collector(Path(d) / "data", cpus=None)
        peak, rejected, sent = 0.0, 0, 0
        session = requests.Session()
        try:
            for step in range(seconds):
                t0 = time.perf_counter()
                n = ranks * metrics
                table = pa.table({
                    "run": pa.array(["mem"] * n, pa.string()),
                    "rank": pa.array([i // metrics for i in range(n)], pa.uint32()),
                    "step": pa.array([step] * n, pa.uint64()),
                    "time": pa.array([1_700_000_000_000 + step * 1000] * n, pa.timestamp("ms", tz="UTC")),
                    "metric": pa.array([names[i % metrics] for i in range(n)], pa.string()),
                    "layer": pa.array([None] * n, pa.uint32()),
                    "site": pa.array([None] * n, pa.string()),
                    "value": pa.array([float(i % 1000) for i in range(n)], pa.float64()),
                })
                r = session.post(f"{url}/api/v1/ingest", data=ipc_bytes(table), headers={"content-type": ARROW}, timeout=60)
                if r.status_code != 200:
                    rejected += n
                else:
                    sent += n
                peak = max(peak, rss_mib(proc.pid))
                time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
        finally:
            stop(proc)
    print(f"{'samples sent':>14} {'rejected':>10} {'peak RSS MiB':>14} {'target':>12}")
    print(f"{sent:>14,} {rejected:>10,} {peak:>14.1f} {'< 512 MiB':>12}")


def main() -> None:
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    which = sys.argv[1:] or ["ingest", "queries", "storage", "memory"]
    if "ingest" in which:
        bench_ingest()
    if "queries" in which:
        bench_queries()
    if "storage" in which:
        bench_storage()
    if "memory" in which:
        bench_memory(int(os.environ.get("RANKWATCH_BENCH_MEMORY_SECONDS", "600")))


if __name__ == "__main__":
    main()
