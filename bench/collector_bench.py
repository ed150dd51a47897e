"""Collector benchmarks, printed as tables (run by `cargo xtask bench`).

1. Ingest: Arrow IPC batches of 10,000 rows, fsync group commit on, the collector pinned to
   one core (taskset), several concurrent clients; beside it VictoriaMetrics (Debian package
   `victoria-metrics`) ingesting the same samples through its JSON-lines import API, also
   pinned to one core. Reports samples/s and the ratio.
2. Queries over runs of 1 M, 10 M and 100 M samples (64 layers x 8 ranks;
   RANKWATCH_BENCH_QUERY_ROWS picks the sizes): `series` at 1,000 points and the 64 x 1,000
   `heatmap`, p50 over repeated calls, each beside DuckDB running the equivalent aggregation
   over the same Parquet files; the scaling curves are written to target/bench/query_scaling.svg.
3. Storage: one 2 M-sample run through a collector on local disk and one on
   `--storage s3://` (moto's S3 server from PyPI): ingest rate, final flush, restart, and a
   series query reading the parts back.
   `ingest-ab OLD NEW` runs the sustained case only, for two collector binaries and
   VictoriaMetrics' remote write interleaved (RANKWATCH_BENCH_AB_ROUNDS rounds, 3 by default):
   a change to ingest measured side by side in one run. `ingest-fsync` runs the collector with
   and without its fsyncs (libeatmydata) beside VictoriaMetrics: what the durability costs.
   `alerts-ab OLD NEW [RUNS]` runs `ingest-floor`'s as-shipped case for two collector binaries,
   alternated, with each run's 429s and slowest alert, and alert p50 / p99 over all its faults.
   `ingest-floor` takes the promised work away piece by piece (alert engine, Parquet flushes
   and rollups during the run, fsync) beside VictoriaMetrics: what each costs per sample.
4. Memory: 1,024 simulated ranks x 200 metrics, each rank posting its own batch once a second
   as the agent does; RSS over time, p50/p99 ingest latency, refusals. Ten minutes by default
   (RANKWATCH_BENCH_MEMORY_SECONDS shortens it).
5. `operator [RANKS ...]` (issue 47; not in the default run): 16,384 and then 65,536 simulated
   ranks of one job at one step a second, each posting the agent's default report through at
   most 4,096 connections for ten minutes (RANKWATCH_BENCH_OPERATOR_SECONDS), sent by
   bench/loadgen (the agent's own encoder, keys and headers) on CPU 1, the collector on CPU 0:
   ack latency by minute, refusals, RSS, and "ranks per collector core".

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
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import agent_mix
import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import requests

if TYPE_CHECKING:
    from collections.abc import Callable

    # A request's body and its headers.
    Body = tuple[bytes, dict[str, str]]
    # Samples by series (metric, rank, layer, site): their values and their times in ms.
    Series = dict[tuple[str, int | None, int | None, str | None], tuple[list[float], list[int]]]

BIN = os.environ["RANKWATCH_BIN"]
ARROW = "application/vnd.apache.arrow.stream"
# The ranks whose reports the side-by-side benches send (bench/agent_mix.py).
AGENT_RANKS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_collector(data: Path, *extra: str, cpus: str | None = "0", binary: str | None = None,
                    env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    cmd = [binary or BIN, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data), *extra]
    if cpus and shutil.which("taskset"):
        cmd = ["taskset", "-c", cpus, *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "RANKWATCH_LOG": "warn", **(env or {})})
    assert proc.stdout is not None  # stdout=PIPE
    line = proc.stdout.readline()
    assert line.startswith("rankwatch listening on"), line
    return proc, line.strip().rsplit(" ", 1)[1]


def stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=600)


def samples_batch(run: str, step0: int, rows: int, ranks: int = 8, layers: int = 64) -> pa.Table:
    """`rows` samples of spectral.ratio over layers x ranks, steps from step0."""
    per_step = ranks * layers
    i = np.arange(rows, dtype=np.int64)
    steps = step0 + i // per_step
    return pa.table({
        "run": pa.array(np.full(rows, run, dtype=object), pa.string()),
        "rank": pa.array(((i // layers) % ranks).astype(np.uint32)),
        "step": pa.array(steps.astype(np.uint64)),
        "time": pa.array(1_700_000_000_000 + steps * 1000, pa.timestamp("ms", tz="UTC")),
        "metric": pa.array(np.full(rows, "spectral.ratio", dtype=object), pa.string()),
        "layer": pa.array((i % layers).astype(np.uint32)),
        "site": pa.nulls(rows, pa.string()),
        "value": pa.array(1.0 + (i % 997) / 1000.0),
    })


def ipc_bytes(table: pa.Table, compression: str | None = "zstd") -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema, options=ipc.IpcWriteOptions(compression=compression)) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


_sessions = threading.local()


def session() -> requests.Session:
    """This thread's HTTP session (kept-alive connections, as an agent's)."""
    s = getattr(_sessions, "s", None)
    if s is None:
        s = _sessions.s = requests.Session()
    return s


def post_retrying(url: str, body: bytes, headers: dict[str, str], timeout: float = 120,
                  attempt: Callable[[requests.Response, float], None] | None = None) -> requests.Response:
    """POSTs until the answer is not 429, waiting its Retry-After between tries as the agent
    does; `attempt(response, seconds)` sees every try."""
    while True:
        t = time.perf_counter()
        r = session().post(url, data=body, headers=headers, timeout=timeout)
        if attempt is not None:
            attempt(r, time.perf_counter() - t)
        if r.status_code != 429:
            return r
        time.sleep(float(r.headers.get("retry-after", "1")))


def post_all(url: str, bodies: list[Body] | Callable[[int], Body], clients: int, count: int | None = None,
             acked: dict[int, float] | None = None, in_order: bool = False,
             sent: dict[int, float] | None = None) -> float:
    """POSTs every body (a list, or a function of the index making one) from `clients` threads;
    `acked`, if given, gets the time (perf_counter) each of its keys' bodies was acknowledged,
    `sent` the time each was first sent (before any 429 and wait).
    With `in_order`, client k sends bodies k, k + clients, ... one after another (an agent's
    batches, which must arrive in order); else each takes the next body left."""
    make = bodies if callable(bodies) else bodies.__getitem__
    count = len(cast("list[Body]", bodies)) if count is None else count  # a function comes with its count

    def send(i: int) -> None:
        body, headers = make(i)
        if sent is not None and i in sent:
            sent[i] = time.perf_counter()
        r = post_retrying(url, body, headers)
        if r.status_code not in (200, 204):
            raise RuntimeError(f"{url}: {r.status_code} {r.text[:200]}")
        if acked is not None and i in acked:
            acked[i] = time.perf_counter()

    def client(k: int) -> None:
        for i in range(k, count, clients):
            send(i)

    started = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        if in_order:
            list(pool.map(client, range(clients)))
        else:
            list(pool.map(send, range(count)))
    return time.perf_counter() - started


INGEST_CLIENTS = [int(c) for c in os.environ.get("RANKWATCH_BENCH_INGEST_CLIENTS", "1,8,64").split(",")]
INGEST_REPEATS = 3


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def series_labels(key: tuple[str, int | None, int | None, str | None]) -> dict[str, str]:
    """A series' Prometheus labels: its metric as a metric name (`.` and `/` as `_`), the run,
    and the rank, layer and site it has."""
    metric, rank, layer, site = key
    labels = {"__name__": metric.replace(".", "_").replace("/", "_"), "run": "ingest"}
    labels.update({k: str(v) for k, v in (("rank", rank), ("layer", layer), ("site", site)) if v is not None})
    return labels


def remote_write_body(series: Series) -> bytes:
    """A Prometheus remote-write WriteRequest (protobuf, snappy block), encoded by hand:
    TimeSeries{labels: Label{name, value}..., samples: Sample{double value, int64 ms}...}."""
    import cramjam

    out = bytearray()
    for key, (values, stamps) in series.items():
        # Sorted by name, as Prometheus sends them.
        labels = sorted(series_labels(key).items())
        ts = b"".join(field(1, field(1, k.encode()) + field(2, v.encode())) for k, v in labels)
        ts += b"".join(field(2, b"\x09" + struct.pack("<d", v) + b"\x10" + varint(t)) for v, t in zip(values, stamps))
        out += field(1, ts)
    return bytes(cramjam.snappy.compress_raw(bytes(out)))


def by_series(table: pa.Table) -> Series:
    cols = table.to_pydict()
    series: Series = {}
    for metric, rank, layer, site, ts, v in zip(cols["metric"], cols["rank"], cols["layer"], cols["site"], cols["time"], cols["value"]):
        values, stamps = series.setdefault((metric, rank, layer, site), ([], []))
        values.append(v)
        stamps.append(int(ts.timestamp() * 1000))
    return series


def json_lines_body(series: Series) -> bytes:
    return "\n".join(
        json.dumps({"metric": series_labels(key), "values": vs, "timestamps": ts}) for key, (vs, ts) in series.items()
    ).encode()


def victoria_metrics_rate(path: str, bodies: list[Body], clients: int, samples: int, nans: int = 0) -> float:
    """VictoriaMetrics' samples/s for `bodies`; afterwards (untimed) the samples are counted
    back, less the `nans` NaN values among them, which its queries do not count (a NaN is
    how Prometheus marks a series stale)."""
    vm = shutil.which("victoria-metrics") or "/usr/bin/victoria-metrics"
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
            secs = post_all(f"http://127.0.0.1:{port}{path}", bodies, clients, in_order=True)
            # Everything acknowledged must also be stored: count it back (not timed).
            requests.get(f"http://127.0.0.1:{port}/internal/force_flush", timeout=60)
            q = {"query": 'sum(count_over_time({run="ingest"}[10y]))', "time": "1800000000"}
            got = requests.get(f"http://127.0.0.1:{port}/api/v1/query", params=q, timeout=120).json()
            counted = float(got["data"]["result"][0]["value"][1])
            assert counted == samples - nans, f"VictoriaMetrics holds {counted:,.0f} of {samples - nans:,} samples"
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return samples / secs


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_until_idle(pid: int, quiet: float = 0.01, every: float = 0.25, limit: float = 60) -> float:
    """The process's CPU seconds once it has used less than `quiet` seconds in `every`."""
    deadline = time.monotonic() + limit
    last = cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(every)
        now = cpu_seconds(pid)
        if now - last < quiet:
            return now
        last = now
    return last


def metric_sum(url: str, prefix: str, *labels: str) -> float:
    """The sum of the collector's /metrics lines starting with `prefix` and holding every one
    of `labels`."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(prefix) and all(label in line for label in labels))


class AlertClock:
    """Times each injected fault from its batch's acknowledgement (and from its first send,
    which counts the time its batch was refused or held for backpressure) to its alert: polls the
    collector's firing `nonfinite` alerts every `every` seconds (so a latency is known to that
    resolution, and late by up to it), the k-th firing taken as the k-th fault's, in batch
    order (faults are tens of batches apart)."""

    def __init__(self, url: str, faults: list[int], every: float = 0.05) -> None:
        self.url, self.faults, self.every = url, faults, every
        self.acked: dict[int, float] = dict.fromkeys(faults, 0.0)
        self.sent: dict[int, float] = dict.fromkeys(faults, 0.0)
        self.fired: list[float] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()

    def poll(self) -> None:
        while not self.done.is_set() and len(self.fired) < len(self.faults):
            count = int(metric_sum(self.url, "rankwatch_alert_transitions_total{", 'rule="nonfinite"', 'state="firing"'))
            now = time.perf_counter()
            self.fired.extend([now] * (count - len(self.fired)))
            time.sleep(self.every)

    def latencies(self, grace: float = 10.0, since: Literal["acked", "sent"] = "acked") -> list[float]:
        """Milliseconds to each fault's alert from its batch's ack (`since="acked"`) or first
        send (`"sent"`); waits up to `grace` s for the last."""
        self.thread.join(timeout=grace)
        self.done.set()
        self.thread.join()
        if len(self.fired) != len(self.faults):
            raise RuntimeError(f"{len(self.fired)} nonfinite alerts fired for {len(self.faults)} injected faults")
        start = self.acked if since == "acked" else self.sent
        return [(fired - start[b]) * 1000 for b, fired in zip(self.faults, self.fired, strict=True)]


def nearest_rank(ordered: list[float], f: float) -> float:
    """The `f` quantile of already sorted values by the nearest rank (the p50 / p99 every table
    here prints)."""
    return ordered[min(len(ordered) - 1, int(f * len(ordered)))]


def rankwatch_rate(bodies: list[Body], clients: int, samples: int, binary: str | None = None,
                   env: dict[str, str] | None = None, busy: list[float] | None = None,
                   extra: tuple[str, ...] = (), cpu: list[float] | None = None,
                   faults: list[int] | None = None, latency: list[float] | None = None,
                   world: int | None = AGENT_RANKS, refused: list[float] | None = None,
                   latency_sent: list[float] | None = None) -> float:
    """Samples/s; `busy`, if given, gets the server's CPU time over the wall time of the sends;
    `cpu` its CPU seconds from the first send until it is idle again after the last ack (the
    alert engine's queue drained, a flush under way finished); `latency` the milliseconds from
    the ack of each batch in `faults` (each carries a NaN loss) to its alert firing. `world`:
    the run's world size, announced first as the agent does (None: not announced); `refused`
    the requests the collector answered 429 for backpressure; `latency_sent` the same
    latencies from each batch's first send (counting a 429's wait, or the collector's own)."""
    with tempfile.TemporaryDirectory() as d:
        proc, url = start_collector(Path(d) / "data", *extra, binary=binary, env=env)
        try:
            # The run's info, as the agent sends it first: with its world size, a step closes
            # once every rank moved past it, not on the aligner's timeout.
            if world is not None:
                r = session().post(f"{url}/api/v1/ingest", json={"run": "ingest", "info": {"world_size": world}, "samples": []}, timeout=60)
                assert r.status_code == 200, r.text
            clock = AlertClock(url, faults) if faults and latency is not None else None
            # taskset execs the collector, which execs itself once more: one process id.
            cpu_before = cpu_seconds(proc.pid)
            secs = post_all(f"{url}/api/v1/ingest", bodies, clients, acked=clock.acked if clock else None, in_order=True,
                            sent=clock.sent if clock else None)
            if busy is not None:
                busy.append((cpu_seconds(proc.pid) - cpu_before) / secs)
            if cpu is not None:
                cpu.append(cpu_until_idle(proc.pid) - cpu_before)
            if clock is not None and latency is not None:
                latency.extend(clock.latencies())
                if latency_sent is not None:
                    latency_sent.extend(clock.latencies(since="sent"))
            ingested = metric_sum(url, 'rankwatch_ingest_rows_total{table="samples"')
            assert ingested == samples, f"{ingested} of {samples} rows ingested"
            if refused is not None:
                refused.append(metric_sum(url, "rankwatch_ingest_rejects_total", 'reason="backpressure"'))
        finally:
            stop(proc)
    return samples / secs


REMOTE_WRITE_HEADERS = {"content-type": "application/x-protobuf", "content-encoding": "snappy",
                        "x-prometheus-remote-write-version": "0.1.0"}


def pin_off_cpu0() -> set[int]:
    """Moves this process (the clients) off CPU 0, where the servers run; returns its CPUs."""
    others = set(range(os.cpu_count() or 1)) - {0}
    if others and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, others)
    return others


def ingest_tables(count: int, rows: int) -> list[pa.Table]:
    """`count` batches of `rows` samples, steps continuing from batch to batch."""
    return [samples_batch("ingest", i * (rows // 512 + 1), rows) for i in range(count)]


def arrow_bodies(tables: list[pa.Table]) -> list[Body]:
    """rankwatch's ingest requests for `tables`, each with its idempotency key."""
    return [(ipc_bytes(t), {"content-type": ARROW, "idempotency-key": f"ingest/0/bench/{i}"}) for i, t in enumerate(tables)]


def victoria_metrics_installed() -> bool:
    return Path(shutil.which("victoria-metrics") or "/usr/bin/victoria-metrics").exists()


def bench_ingest(batches: int = 200, rows: int = 10_000, sustained: int = 1_000) -> dict[str, dict[int, float]]:
    """Samples/s per system and number of concurrent clients, median of INGEST_REPEATS fresh
    servers each, the server pinned to CPU 0 and this client to the other CPUs; then one
    sustained run of `sustained` batches at 8 clients, long enough that each system's
    background work (rankwatch's Parquet flushes and rollups, VictoriaMetrics' part merges)
    runs several times within it."""
    others = pin_off_cpu0()
    print(f"\n# ingest: {batches} batches x {rows:,} samples (8 ranks x 64 layers; {batches * rows / 1e6:g} M), each server pinned to CPU 0 "
          f"and started afresh, the clients on CPU {','.join(map(str, sorted(others))) or '0'}; "
          f"samples/s, median of {INGEST_REPEATS}", flush=True)
    tables = ingest_tables(max(batches, sustained), rows)
    arrow = arrow_bodies(tables)
    # Each system: how it is fed, the rate of some bodies sent by so many clients, its bodies.
    systems: dict[str, tuple[str, Callable[[list[Body], int], float], list[Body]]] = {
        "rankwatch": ("Arrow IPC + zstd; acknowledged after the WAL's fsync",
                      lambda bodies, c: rankwatch_rate(bodies, c, len(bodies) * rows, world=None), arrow),
    }
    if victoria_metrics_installed():
        grouped = [by_series(t) for t in tables]
        remote = [(remote_write_body(g), REMOTE_WRITE_HEADERS) for g in grouped]
        lines = [(json_lines_body(g), {"content-type": "application/json"}) for g in grouped]
        systems["VictoriaMetrics, remote write"] = (
            "Prometheus remote write (protobuf + snappy); acknowledged before it reaches disk",
            lambda bodies, c: victoria_metrics_rate("/api/v1/write", bodies, c, len(bodies) * rows), remote)
        systems["VictoriaMetrics, JSON lines"] = (
            "/api/v1/import; acknowledged before it reaches disk",
            lambda bodies, c: victoria_metrics_rate("/api/v1/import", bodies, c, len(bodies) * rows), lines)
    else:
        print("VictoriaMetrics not installed (apt-get install victoria-metrics): rankwatch alone")
    rates: dict[str, dict[int, float]] = {}
    steady: dict[str, float] = {}
    for name, (_, measure, bodies) in systems.items():
        rates[name] = {c: statistics.median(measure(bodies[:batches], c) for _ in range(INGEST_REPEATS)) for c in INGEST_CLIENTS}
        steady[name] = measure(bodies[:sustained], 8)
    sustained_label = f"{sustained * rows / 1e6:g} M, 8 clients"
    print(f"{'system':32} " + " ".join(f"{f'{c} clients':>14}" for c in INGEST_CLIENTS) + f" {sustained_label:>18}")
    for name, by_clients in rates.items():
        print(f"{name:32} " + " ".join(f"{by_clients[c]:>14,.0f}" for c in INGEST_CLIENTS) + f" {steady[name]:>18,.0f}")
    for name in list(rates)[1:]:
        print(f"{'rankwatch / ' + name:32} " + " ".join(f"{rates['rankwatch'][c] / rates[name][c]:>14.2f}" for c in INGEST_CLIENTS)
              + f" {steady['rankwatch'] / steady[name]:>18.2f}")
    for name, (how, _, _) in systems.items():
        print(f"  {name}: {how}")
    print("target: rankwatch >= 1.2x VictoriaMetrics at every client count, release binary")
    if len(INGEST_CLIENTS) > 1:
        plot = Path(os.environ.get("RANKWATCH_BENCH_OUT", "target/bench")) / "ingest_scaling.svg"
        svg_panels(plot, "concurrent clients", [("ingest: samples/s", {n: sorted(r.items()) for n, r in rates.items()})],
                   lambda x: f"{x:g}")
        print(f"plot: {plot}")
    return rates


def side_by_side_inputs(count: int, rows: int, eatmydata: bool = False, faults_every: int = 0) -> tuple[int, list[Body], list[Body] | None, list[int]]:
    """What the interleaved ingest benches share: the clients moved off CPU 0, the number of
    rounds (RANKWATCH_BENCH_AB_ROUNDS, 3 by default), `count` batches of `rows` samples of the
    agent's default report from AGENT_RANKS ranks (bench/agent_mix.py; before 2026-11-29 these
    benches sent spectral.ratio of 64 layers x 8 ranks at every step) as rankwatch's Arrow
    requests and as VictoriaMetrics' remote write (None where it is not installed), and the
    batches given a NaN loss when `faults_every` is set (see `inject_nan_losses`). With
    `eatmydata`, first checks that libeatmydata is there."""
    if eatmydata and not EATMYDATA.exists():
        sys.exit(f"{EATMYDATA} is missing: apt-get install eatmydata")
    pin_off_cpu0()
    rounds = int(os.environ.get("RANKWATCH_BENCH_AB_ROUNDS", "3"))
    tables = agent_mix.tables("ingest", AGENT_RANKS, count, rows, clients=8)
    faults = inject_nan_losses(tables, faults_every) if faults_every else []
    remote = [(remote_write_body(by_series(t)), REMOTE_WRITE_HEADERS) for t in tables] if victoria_metrics_installed() else None
    return rounds, arrow_bodies(tables), remote, faults


def inject_nan_losses(tables: list[pa.Table], every: int) -> list[int]:
    """Gives one rank a NaN loss in every `every`-th batch (from the middle of the first such
    span), at the batch's second step, a different rank of the batch's client each time round;
    returns those batches."""
    faults: list[int] = []
    for b in range(every // 2, len(tables), every):
        table = tables[b]
        steps = table["step"].to_numpy()
        ranks = table["rank"].to_numpy(zero_copy_only=False)
        metrics = table["metric"].to_numpy(zero_copy_only=False)
        # The batch's ranks' losses at its second step; a different one each time round.
        at = np.flatnonzero((steps == steps[0] + 1) & (metrics == "loss") & ~np.isnan(ranks.astype(float)))
        if len(at) == 0:
            continue
        values = table["value"].to_numpy().copy()
        values[at[len(faults) % len(at)]] = np.nan
        tables[b] = table.set_column(table.schema.get_field_index("value"), "value", pa.array(values))
        faults.append(b)
    return faults


def bench_ingest_ab(old: str, new: str, rows: int = 10_000, sustained: int = 1_000) -> None:
    """The sustained ingest case for two collector binaries and VictoriaMetrics, interleaved
    round by round so that a machine whose speed drifts affects all three alike."""
    rounds, arrow, remote, _ = side_by_side_inputs(sustained, rows)
    samples = sustained * rows
    print(f"\n# sustained ingest, side by side: {samples / 1e6:g} M samples, 8 clients, each server pinned to CPU 0; "
          f"samples/s per round")
    print(f"{'round':>5} {'old':>14} {'new':>14} {'VictoriaMetrics':>16}")
    results: dict[str, list[float]] = {"old": [], "new": [], "vm": []}
    for r in range(rounds):
        results["old"].append(rankwatch_rate(arrow, 8, samples, binary=old))
        results["new"].append(rankwatch_rate(arrow, 8, samples, binary=new))
        if remote is not None:
            results["vm"].append(victoria_metrics_rate("/api/v1/write", remote, 8, samples))
        vm_text = f"{results['vm'][-1]:>16,.0f}" if results["vm"] else f"{'-':>16}"
        print(f"{r + 1:>5} {results['old'][-1]:>14,.0f} {results['new'][-1]:>14,.0f} {vm_text}", flush=True)
    print(f"old: {old}\nnew: {new}")
    print(f"new / old, median: {statistics.median(results['new']) / statistics.median(results['old']):.2f}")
    if results["vm"]:
        print(f"new / VictoriaMetrics remote write, median: {statistics.median(results['new']) / statistics.median(results['vm']):.2f}")


def bench_alerts_ab(old: str, new: str, runs: int = 4, rows: int = 10_000, sustained: int = 1_000) -> None:
    """Alert latency under sustained load for two collector binaries, alternated run by run
    (the first of each pair swapped every run): the as-shipped case of `ingest-floor` (10 M
    samples of the agent's report, a NaN loss every 50th batch), with each run's CPU per sample,
    its 429s for backpressure and its slowest alert, then p50 / p99 over all of a binary's
    faults. With ~20 faults a run the tail is a few events: compare over several runs."""
    _, arrow, _, faults = side_by_side_inputs(sustained, rows, faults_every=50)
    samples = sustained * rows
    print(f"\n# alert latency, side by side: {samples / 1e6:g} M samples, 8 clients, server on CPU 0, "
          f"{len(faults)} NaN losses a run, {runs} runs each")
    print(f"{'run':>3} {'binary':>6} {'samples/s':>12} {'CPU ns/sample':>14} {'429s':>6} {'slowest alert ms':>17} "
          f"{'from first send':>16}")
    latencies: dict[tuple[str, str], list[float]] = {}
    for r in range(runs):
        pair = [("old", old), ("new", new)]
        for name, binary in pair if r % 2 == 0 else pair[::-1]:
            cpu: list[float] = []
            refused: list[float] = []
            latency: list[float] = []
            sent: list[float] = []
            rate = rankwatch_rate(arrow, 8, samples, binary=binary, cpu=cpu, faults=faults,
                                  latency=latency, refused=refused, latency_sent=sent)
            latencies.setdefault((name, "ack"), []).extend(latency)
            latencies.setdefault((name, "first send"), []).extend(sent)
            print(f"{r + 1:>3} {name:>6} {rate:>12,.0f} {cpu[0] / samples * 1e9:>14.0f} {refused[0]:>6.0f} "
                  f"{max(latency, default=float('nan')):>17.0f} {max(sent, default=float('nan')):>16.0f}", flush=True)
    for name, binary in (("old", old), ("new", new)):
        for since in ("ack", "first send"):
            lat = sorted(latencies.get((name, since), []))
            if lat:
                p50, p99 = (nearest_rank(lat, f) for f in (0.5, 0.99))
                print(f"{name} ({binary}): alert p50 {p50:.0f} ms, p99 {p99:.0f} ms from the batch's {since}, over {len(lat)} faults")


EATMYDATA = Path("/usr/lib/x86_64-linux-gnu/libeatmydata.so")
# The environment that makes every fsync of the collector a no-op.
NO_FSYNC = {"LD_PRELOAD": str(EATMYDATA)}


def bench_ingest_fsync(rows: int = 10_000, bursts: int = 200, sustained: int = 1_000) -> None:
    """What acknowledging after the fsync costs: the collector as it is, the same binary with
    every fsync made a no-op (libeatmydata, Debian package `eatmydata`: what acknowledging
    before disk would give), and VictoriaMetrics' remote write, interleaved round by round;
    with the collector's CPU time over the wall time of each run (1.0: one core busy
    throughout, so the rate is its CPU cost per sample, not waiting)."""
    rounds, arrow, remote, _ = side_by_side_inputs(sustained, rows, eatmydata=True)
    cases = [("1 client, 2 M", 1, bursts), ("8 clients, 2 M", 8, bursts), ("8 clients, 10 M sustained", 8, sustained)]
    systems = [("rankwatch, fsync before the ack", {}), ("rankwatch, fsync a no-op", NO_FSYNC)]
    rates: dict[tuple[str, str], list[float]] = {}
    busy: dict[tuple[str, str], list[float]] = {}
    print(f"\n# ingest with and without fsync: {rows:,}-sample batches, each server pinned to CPU 0, {rounds} rounds; samples/s")
    for r in range(rounds):
        for case, clients, count in cases:
            for name, env in systems:
                rates.setdefault((case, name), []).append(
                    rankwatch_rate(arrow[:count], clients, count * rows, env=env, busy=busy.setdefault((case, name), [])))
            if remote is not None:
                rates.setdefault((case, "VictoriaMetrics, remote write"), []).append(
                    victoria_metrics_rate("/api/v1/write", remote[:count], clients, count * rows))
        print(f"round {r + 1} done", flush=True)
    print(f"{'case':28} {'system':34} {'median':>12} {'rounds':>28} {'server CPU / wall':>18}")
    for (case, name), values in rates.items():
        cpu = f"{statistics.median(busy[(case, name)]):.2f}" if (case, name) in busy else "-"
        print(f"{case:28} {name:34} {statistics.median(values):>12,.0f} {' / '.join(f'{v / 1e6:.2f} M' for v in values):>28} {cpu:>18}")


def bench_ingest_floor(rows: int = 10_000, sustained: int = 1_000) -> None:
    """Where the sustained case's budget goes: the same binary with the work it promises taken
    away piece by piece (the alert engine off; no Parquet flush or rollups while the samples
    arrive, the hot buffer made large enough to hold them all; fsync a no-op) beside
    VictoriaMetrics' remote write, interleaved round by round. The samples are the agent's
    default report from 64 ranks (bench/agent_mix.py). Each case's CPU nanoseconds per sample
    (server CPU time, counted until the server is idle after the last ack, over samples) say
    what that work costs on this core; the ratio column is the rate over VictoriaMetrics' in
    the same round. Every 50th batch carries one rank's NaN loss, and where the alert engine
    runs, the time from that batch's ack to its `nonfinite` alert firing is reported (polled
    every 50 ms). Only the first case is the collector as users run it: the others bound what
    any tuning of the rest could reach."""
    rounds, arrow, remote, faults = side_by_side_inputs(sustained, rows, eatmydata=True, faults_every=50)
    samples = sustained * rows
    no_flush = ("--hot-budget-bytes", str(16 << 30), "--flush-interval", "1h")
    cases = [
        ("as shipped", (), {}),
        ("no alert engine", ("--no-alert-engine",), {}),
        ("no flush during the run", no_flush, {}),
        ("neither", ("--no-alert-engine", *no_flush), {}),
        ("neither, fsync a no-op", ("--no-alert-engine", *no_flush), NO_FSYNC),
    ]
    rates: dict[str, list[float]] = {}
    cpu_ns: dict[str, list[float]] = {}
    ratio: dict[str, list[float]] = {}
    latency: dict[str, list[float]] = {}
    print(f"\n# where the sustained budget goes: {samples / 1e6:g} M samples of the agent's default report "
          f"({AGENT_RANKS} ranks), 8 clients, each server pinned to CPU 0, {rounds} rounds, "
          f"{len(faults)} NaN losses a run", flush=True)
    for r in range(rounds):
        vm = victoria_metrics_rate("/api/v1/write", remote, 8, samples, nans=len(faults)) if remote is not None else None
        if vm is not None:
            rates.setdefault("VictoriaMetrics, remote write", []).append(vm)
        for name, extra, env in cases:
            cpu: list[float] = []
            engine = "--no-alert-engine" not in extra
            rate = rankwatch_rate(arrow, 8, samples, env=env, extra=extra, cpu=cpu, faults=faults if engine else None,
                                  latency=latency.setdefault(name, []) if engine else None)
            rates.setdefault(name, []).append(rate)
            cpu_ns.setdefault(name, []).append(cpu[0] / samples * 1e9)
            if vm is not None:
                ratio.setdefault(name, []).append(rate / vm)
        print(f"round {r + 1} done", flush=True)
    print(f"{'collector':28} {'samples/s, median':>18} {'CPU ns/sample':>14} {'/ VictoriaMetrics':>18} "
          f"{'alert p50 ms':>13} {'alert p99 ms':>13}")
    for name, values in rates.items():
        ns = f"{statistics.median(cpu_ns[name]):>14.0f}" if name in cpu_ns else f"{'-':>14}"
        vs = f"{statistics.median(ratio[name]):>18.2f}" if name in ratio else f"{'-':>18}"
        lat = sorted(latency.get(name, []))
        q: Callable[[float], str] = lambda f: f"{nearest_rank(lat, f):>13.0f}" if lat else f"{'-':>13}"  # noqa: E731
        print(f"{name:28} {statistics.median(values):>18,.0f} {ns} {vs} {q(0.5)} {q(0.99)}")
    print("CPU ns/sample: the server's CPU time from the first send until it is idle after the last ack (work still\n"
          "  queued then, the alert engine's and a flush under way, counted; the rows left in the hot buffer not);\n"
          "  / VictoriaMetrics: the median of each round's ratio to VictoriaMetrics in that round;\n"
          "  alert: from the ack of a batch with a NaN loss to its nonfinite alert firing, all rounds, polled every 50 ms")
    print("targets (issue 47): as shipped >= 1.0x VictoriaMetrics remote write with the fsync before the ack (stretch 1.2x);\n"
          "  alert p99 <= 1 s at that rate. VictoriaMetrics acknowledges before its data is on disk.")


def p50(fn: Callable[[], object], n: int = 25) -> float:
    fn()  # warm caches, as a dashboard refresh would find them
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


QUERY_SIZES = [int(n) for n in os.environ.get("RANKWATCH_BENCH_QUERY_ROWS", "1000000,10000000,100000000").split(",")]


def query_point(total: int) -> dict[str, Any]:
    """One run of `total` samples (64 layers x 8 ranks), flushed to Parquet; p50 of the two
    dashboard queries against the same aggregation in DuckDB over the same files."""
    layers, ranks, rows = 64, 8, 100_000
    calls = 25 if total <= 10_000_000 else 7
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "data"
        proc, url = start_collector(data, "--hot-budget-bytes", str(256 << 20), cpus=None)
        try:
            steps_per = rows // (layers * ranks)
            body: Callable[[int], Body] = lambda i: (ipc_bytes(samples_batch("q", i * (steps_per + 1), rows)), {"content-type": ARROW})  # noqa: E731
            t = time.perf_counter()
            post_all(f"{url}/api/v1/ingest", body, 4, count=total // rows)
        finally:
            stop(proc)  # flushes everything to Parquet
        ingest = time.perf_counter() - t
        proc, url = start_collector(data, cpus=None)
        try:
            s = requests.Session()
            # The whole answer received, not parsed (as DuckDB's is fetched as Arrow, not turned
            # into Python objects): each system's own work. Uncompressed, on loopback.
            get: Callable[..., bytes] = lambda path, **params: s.get(f"{url}/api/v1/runs/q/{path}", params=params, timeout=600,  # noqa: E731
                                               headers={"accept-encoding": "identity"}).content
            series: Callable[[], bytes] = lambda: get("series", metric="spectral.ratio", layer=17, rank=3, points=1000)  # noqa: E731
            heat: Callable[[], bytes] = lambda: get("heatmap", metric="spectral.ratio", points=1000)  # noqa: E731
            width = json.loads(heat())["buckets"]["width"]
            metrics: Callable[[], dict[str, float]] = lambda: {  # noqa: E731
                line.split()[0]: float(line.split()[1]) for line in s.get(f"{url}/metrics", timeout=60).text.splitlines()
                if line.startswith("rankwatch_downsampled_")}
            before = metrics()
            heat()
            after = metrics()
            read = {k.removeprefix("rankwatch_downsampled_").removesuffix("_rows_total"): after[k] - before[k] for k in after}
            rw_series, rw_heat = p50(series, calls), p50(heat, calls)
        finally:
            stop(proc)
        files = str(data / "table=samples" / "*" / "*.parquet")
        con = duckdb.connect()
        # The same aligned buckets the collector used.
        q_series = f"""SELECT step // {width} AS b, min(value), max(value), arg_max(value, step), count(*),
                       count(*) FILTER (WHERE isnan(value) OR isinf(value))
                       FROM read_parquet('{files}', hive_partitioning = true)
                       WHERE run = 'q' AND metric = 'spectral.ratio' AND layer = 17 AND rank = 3 GROUP BY b"""
        q_heat = f"""SELECT layer, step // {width} AS b, min(value), max(value), arg_max(value, step), count(*),
                     count(*) FILTER (WHERE isnan(value) OR isinf(value))
                     FROM read_parquet('{files}', hive_partitioning = true)
                     WHERE run = 'q' AND metric = 'spectral.ratio' AND site IS NULL GROUP BY layer, b"""
        duck_series = p50(lambda: con.sql(q_series).to_arrow_table(), calls)
        duck_heat = p50(lambda: con.sql(q_heat).to_arrow_table(), calls)
    return {"rows": total, "ingest_s": ingest, "width": width, "rw_series": rw_series, "duck_series": duck_series,
            "rw_heat": rw_heat, "duck_heat": duck_heat, "heat_read": read}


COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]


def svg_panels(path: Path, x_label: str, panels: list[tuple[str, dict[str, list[tuple[float, float]]]]], x_text: Callable[[float], str]) -> None:
    """Log-log panels side by side, one line per system; `x_text` labels an x value."""
    w, h, pad = 360, 260, 50
    xs = sorted({x for _, lines in panels for pts in lines.values() for x, _ in pts})
    ys = [y for _, lines in panels for pts in lines.values() for _, y in pts]
    lo_x, hi_x = np.log10(min(xs)), np.log10(max(xs)) + 1e-9
    lo_y, hi_y = np.floor(np.log10(min(ys))), np.ceil(np.log10(max(ys)))
    hi_y += hi_y == lo_y
    px: Callable[[float], float] = lambda x: pad + (np.log10(x) - lo_x) / (hi_x - lo_x) * (w - 2 * pad)  # noqa: E731
    py: Callable[[float], float] = lambda y: h - pad - (np.log10(y) - lo_y) / (hi_y - lo_y) * (h - 2 * pad)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{len(panels) * w}" height="{h}" font-family="sans-serif" font-size="11">']
    for n, (title, lines) in enumerate(panels):
        out.append(f'<g transform="translate({n * w},0)"><text x="{w / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>')
        out.append(f'<rect x="{pad}" y="{pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" stroke="#999"/>')
        for e in range(int(lo_y), int(hi_y) + 1):
            y = py(10 ** e)
            out.append(f'<line x1="{pad}" x2="{w - pad}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/><text x="{pad - 4}" y="{y + 4:.1f}" text-anchor="end">{10 ** e:g}</text>')
        for x in xs:
            out.append(f'<text x="{px(x):.1f}" y="{h - pad + 15}" text-anchor="middle">{x_text(x)}</text>')
        out.append(f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">{x_label}</text>')
        for i, (name, pts) in enumerate(lines.items()):
            colour = COLOURS[i % len(COLOURS)]
            out.append(f'<polyline points="{" ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)}" fill="none" stroke="{colour}" stroke-width="2"/>')
            out.extend(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in pts)
            out.append(f'<text x="{pad + 8}" y="{pad + 14 + 14 * i}" fill="{colour}">{name}</text>')
        out.append("</g>")
    out.append("</svg>")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))


def bench_queries() -> None:
    print(f"\n# queries: one run per size (64 layers x 8 ranks, spectral.ratio), flushed to Parquet; "
          f"p50 of 25 warm calls (7 at 100 M); DuckDB over the same files, same buckets; answers received, "
          f"not parsed (rankwatch: JSON bytes, uncompressed; DuckDB: fetched as Arrow)", flush=True)
    points = []
    for total in QUERY_SIZES:
        p = query_point(total)
        points.append(p)
        print(f"  {total:,} samples: ingested and flushed in {p['ingest_s']:.0f} s; one heatmap read "
              f"{p['heat_read']['raw']:,.0f} raw rows and {p['heat_read']['rollup']:,.0f} rollup rows", flush=True)
    print(f"{'query':22} {'samples':>12} {'width':>6} {'rankwatch p50 ms':>17} {'DuckDB p50 ms':>14} {'DuckDB/rankwatch':>17}")
    for name, a, b in (("series, 1,000 points", "rw_series", "duck_series"), ("heatmap, 64 x 1,000", "rw_heat", "duck_heat")):
        for p in points:
            print(f"{name:22} {p['rows']:>12,} {p['width']:>6} {p[a]:>17.1f} {p[b]:>14.1f} {p[b] / p[a]:>17.2f}")
    print("targets: heatmap <= 20 ms at 10 M and <= 50 ms at 100 M; both queries ahead of DuckDB at every size")
    if len(points) > 1:
        plot = Path(os.environ.get("RANKWATCH_BENCH_OUT", "target/bench")) / "query_scaling.svg"
        panels = [(f"{title}: p50 ms", {name: [(p["rows"], p[key]) for p in points] for name, key in systems})
                  for title, systems in (("series, 1,000 points", (("rankwatch", "rw_series"), ("DuckDB", "duck_series"))),
                                         ("heatmap, 64 x 1,000", (("rankwatch", "rw_heat"), ("DuckDB", "duck_heat"))))]
        svg_panels(plot, "samples in the run", panels, lambda x: f"{x / 1e6:g}M")
        print(f"plot: {plot}")


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
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
                    series: Callable[[], Any] = lambda: s.get(f"{url}/api/v1/runs/st/series", params=cast("dict[str, str | int]", {"metric": "spectral.ratio", "layer": 17, "rank": 3, "points": 1000}), timeout=60).json()  # noqa: E731
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


class AgentPosts:
    """Ranks posting the agent's per-step report (one Arrow IPC stream of `metrics` user
    scalars, zstd, with its idempotency key and version headers), retried on 429 as the agent
    does; every try's latency and refusal is recorded."""

    def __init__(self, run: str, metrics: int) -> None:
        self.run = run
        self.metrics = metrics
        self.names = pa.array([f"user/m{i}" for i in range(metrics)], pa.string())
        self.version = subprocess.run([BIN, "--version"], capture_output=True, text=True, check=True).stdout.split()[-1]
        self.latencies: list[float] = []
        self.refused = {"429": 0, "other": 0}
        self.lock = threading.Lock()

    def record(self, r: requests.Response, seconds: float) -> None:
        with self.lock:
            self.latencies.append(seconds * 1000)
            if r.status_code == 429:
                self.refused["429"] += 1
            elif r.status_code != 200:
                self.refused["other"] += 1

    def post(self, url: str, rank: int, step: int) -> None:
        n = self.metrics
        table = pa.table({
            "run": pa.array(np.full(n, self.run, dtype=object), pa.string()),
            "rank": pa.array(np.full(n, rank, dtype=np.uint32)),
            "step": pa.array(np.full(n, step, dtype=np.uint64)),
            "time": pa.array(np.full(n, 1_700_000_000_000 + step * 1000), pa.timestamp("ms", tz="UTC")),
            "metric": self.names,
            "layer": pa.nulls(n, pa.uint32()),
            "site": pa.nulls(n, pa.string()),
            "value": pa.array(np.arange(n, dtype=np.float64) * 0.001 + rank),
        })
        headers = {"content-type": ARROW, "idempotency-key": f"{self.run}/{rank}/bench/{step}",
                   "rankwatch-version": self.version, "rankwatch-protocol": "1"}
        post_retrying(f"{url}/api/v1/ingest?table=samples", ipc_bytes(table), headers, timeout=60, attempt=self.record)


def bench_memory(seconds: int, ranks: int = 1024, metrics: int = 200) -> None:
    """Every rank posts its own batch once a second, as the agent does (one Arrow IPC stream of
    its 200 values, zstd, with the agent's idempotency key and version headers); the
    collector runs with its default limits. Prints RSS over time, ingest latency and what was
    refused."""
    print(f"\n# memory: {ranks} ranks x {metrics} metrics, each rank one batch per second, {seconds} s, "
          f"default limits", flush=True)
    posts = AgentPosts("mem", metrics)
    post, latencies, refused = posts.post, posts.latencies, posts.refused

    with tempfile.TemporaryDirectory() as d:
        proc, url = start_collector(Path(d) / "data", cpus=None)
        timeline: list[tuple[float, float]] = []
        behind = 0
        try:
            started = time.perf_counter()
            with cf.ThreadPoolExecutor(64) as pool:
                for step in range(seconds):
                    t0 = time.perf_counter()
                    futures = [pool.submit(post, url, rank, step) for rank in range(ranks)]
                    for f in futures:
                        f.result()
                    timeline.append((time.perf_counter() - started, rss_mib(proc.pid)))
                    spare = 1.0 - (time.perf_counter() - t0)
                    if spare < 0:
                        behind += 1
                    time.sleep(max(0.0, spare))
            elapsed = time.perf_counter() - started
            stored = requests.get(f"{url}/api/v1/runs", timeout=60).json()["runs"][0]["samples"]
        finally:
            stop(proc)
    lat = sorted(latencies)
    q: Callable[[float], float] = lambda f: nearest_rank(lat, f)  # noqa: E731
    print(f"{'minute':>6} {'RSS MiB min':>12} {'RSS MiB max':>12}")
    for m in range(int(timeline[-1][0] // 60) + 1):
        window = [r for t, r in timeline if m * 60 <= t < (m + 1) * 60]
        if window:
            print(f"{m:>6} {min(window):>12.1f} {max(window):>12.1f}")
    sent = seconds * ranks * metrics
    print(f"{'samples sent':>14} {'stored':>14} {'429 (retried)':>14} {'refused':>8} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'max ms':>8} {'peak RSS MiB':>13} {'samples/s':>10}")
    print(f"{sent:>14,} {stored:>14,} {refused['429']:>14,} {refused['other']:>8,} {q(0.5):>8.1f} {q(0.99):>8.1f} "
          f"{lat[-1]:>8.1f} {max(r for _, r in timeline):>13.1f} {sent / elapsed:>10,.0f}")
    print(f"steps where the {ranks} posts took longer than the second: {behind} of {seconds} "
          f"(the client's pace, on the same two cores); target: RSS < 512 MiB, nothing refused")


def bench_hostile(seconds: int = 60, agents: int = 8, ranks: int = 64, metrics: int = 200,
                  never_readers: int = 1000) -> None:
    """Issue 45's load test: 8 agents post a 64-rank run (each rank one batch a second, as the
    agent does) while hostile clients attack at full strength, all at once: `never_readers`
    connections pipelining requests and reading nothing (item 2), 32 concurrent zstd bodies
    decoding to 64 MiB each (item 4), stalled chunked bodies (item 6), and SQL built to
    allocate (item 7). Default limits. Prints the agents' latency, what was refused, and RSS."""
    print(f"\n# hostile: {agents} agents x {ranks // agents} ranks posting {metrics} metrics a second for "
          f"{seconds} s, beside {never_readers} never-reading connections, 32 zstd bombs, 8 stalled "
          f"chunked bodies and 4 SQL amplifiers at a time; default limits", flush=True)
    posts = AgentPosts("hostile", metrics)
    post, latencies, refused, lock = posts.post, posts.latencies, posts.refused, posts.lock
    attacks = {"bombs": 0, "bombs_413": 0, "sql": 0, "sql_400": 0, "stalls": 0, "never_readers": 0, "per_address_429": 0}
    stop_attacks = threading.Event()

    # A zstd bomb: one 64 MiB metric name that compresses ~100-fold.
    rng = np.random.default_rng(0)
    text = np.full(64 << 20, ord("m"), dtype=np.uint8)
    text[::100] = rng.integers(ord("a"), ord("z"), size=text[::100].shape[0], dtype=np.uint8)
    bomb = ipc_bytes(pa.table({
        "run": pa.array(["bomb"], pa.string()), "rank": pa.array([0], pa.uint32()),
        "step": pa.array([0], pa.uint64()), "time": pa.array([0], pa.timestamp("ms", tz="UTC")),
        "metric": pa.array([text.tobytes().decode()], pa.string()), "layer": pa.nulls(1, pa.uint32()),
        "site": pa.nulls(1, pa.string()), "value": pa.array([1.0]),
    }))

    def host_port(url: str) -> tuple[str, int]:
        host, port = url.removeprefix("http://").split(":")
        return host, int(port)

    # The attackers come from another address than the agents, as from another host (every
    # 127/8 address is this one): the collector caps connections per address.
    attacker = ("127.0.0.2", 0)

    class FromAttacker(requests.adapters.HTTPAdapter):
        def init_poolmanager(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            kwargs["source_address"] = attacker
            super().init_poolmanager(*args, **kwargs)

    def attacker_session() -> requests.Session:
        s = requests.Session()
        s.mount("http://", FromAttacker())
        return s

    def never_reader(url: str) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.bind(attacker)
        s.connect(host_port(url))
        s.setblocking(False)
        try:
            s.send(b"GET /api/v1/openapi.json HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 200)
        except BlockingIOError:
            pass
        return s

    def bombs(url: str) -> None:
        http = attacker_session()
        while not stop_attacks.is_set():
            r = http.post(f"{url}/api/v1/ingest", data=bomb, headers={"content-type": ARROW}, timeout=60)
            with lock:
                attacks["bombs"] += 1
                attacks["bombs_413"] += r.status_code == 413
                attacks["per_address_429"] += r.status_code == 429

    # Queries built to allocate outside DataFusion's pool (decision 0110), in turn: a function
    # whose result's size is an argument, a value doubled by thirty WITH levels, a one-row
    # 8,000-byte literal copied by a join into every row of the agents' samples thirty times
    # over, and a chain of a thousand `||` (once a stack overflow).
    doubled = "WITH l0 AS (SELECT 'x' AS s)" + "".join(
        f", l{i} AS (SELECT s || s AS s FROM l{i - 1})" for i in range(1, 31)) + " SELECT length(s) FROM l30"
    wide = ("WITH w AS (SELECT " + ", ".join(f"'{'w' * 8000}' AS c{i}" for i in range(30))
            + ") SELECT w.*, s.value FROM w CROSS JOIN samples s")
    amplifiers = ["SELECT repeat('x', 2000000000) AS x", doubled, wide,
                  "SELECT length(" + "'x' || " * 1000 + "'x')"]

    def sql(url: str) -> None:
        http = attacker_session()
        turn = 0
        while not stop_attacks.is_set():
            turn += 1
            r = http.post(f"{url}/api/v1/sql", data=amplifiers[turn % len(amplifiers)],
                          headers={"content-type": "text/plain"}, timeout=60)
            with lock:
                attacks["sql"] += 1
                attacks["sql_400"] += r.status_code == 400
                attacks["per_address_429"] += r.status_code == 429

    def stalls(url: str) -> None:
        while not stop_attacks.is_set():
            held = []
            for _ in range(8):
                s = socket.create_connection(host_port(url), source_address=attacker)
                s.sendall(b"POST /api/v1/ingest HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: " + ARROW.encode()
                          + b"\r\nTransfer-Encoding: chunked\r\n\r\n10000\r\n" + b"x" * 65536)
                held.append(s)
            with lock:
                attacks["stalls"] += len(held)
            stop_attacks.wait(20)
            for s in held:
                s.close()

    with tempfile.TemporaryDirectory() as d:
        proc, url = start_collector(Path(d) / "data", cpus=None)
        timeline: list[tuple[float, float]] = []
        sockets: list[socket.socket] = []
        try:
            for _ in range(never_readers):
                try:
                    sockets.append(never_reader(url))
                except OSError:
                    break
            attacks["never_readers"] = len(sockets)
            attackers = [threading.Thread(target=bombs, args=(url,), daemon=True) for _ in range(32)]
            attackers += [threading.Thread(target=sql, args=(url,), daemon=True) for _ in range(4)]
            attackers += [threading.Thread(target=stalls, args=(url,), daemon=True)]
            for a in attackers:
                a.start()
            started = time.perf_counter()
            with cf.ThreadPoolExecutor(agents) as pool:
                for step in range(seconds):
                    t0 = time.perf_counter()
                    # Each agent posts its ranks' batches one after another, as 8 processes would.
                    futures = [pool.submit(cast("Callable[[int], list[None]]",
                                                lambda a, s=step: [post(url, r, s) for r in range(a * ranks // agents, (a + 1) * ranks // agents)]), a)
                               for a in range(agents)]
                    for f in futures:
                        f.result()
                    timeline.append((time.perf_counter() - started, rss_mib(proc.pid)))
                    time.sleep(max(0.0, 1.0 - (time.perf_counter() - t0)))
            stop_attacks.set()
            for a in attackers:
                a.join(timeout=90)
            stored = requests.get(f"{url}/api/v1/runs", timeout=60).json()["runs"]
            stored = next(r["samples"] for r in stored if r["run"] == "hostile")
        finally:
            for s in sockets:
                s.close()
            stop(proc)
    lat = sorted(latencies)
    q: Callable[[float], float] = lambda f: nearest_rank(lat, f)  # noqa: E731
    sent = seconds * ranks * metrics
    print(f"{'samples sent':>13} {'stored':>10} {'429 (retried)':>14} {'refused':>8} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'max ms':>8} {'peak RSS MiB':>13}")
    print(f"{sent:>13,} {stored:>10,} {refused['429']:>14,} {refused['other']:>8,} {q(0.5):>7.1f} {q(0.99):>7.1f} "
          f"{lat[-1]:>8.1f} {max(r for _, r in timeline):>13.1f}")
    print(f"attacks: {attacks['never_readers']} never-reading connections; {attacks['bombs']} zstd bombs "
          f"({attacks['bombs_413']} refused 413); {attacks['stalls']} stalled chunked bodies; {attacks['sql']} "
          f"SQL amplifiers ({attacks['sql_400']} refused 400); {attacks['per_address_429']} attacker requests "
          f"refused 429 by the per-address connection cap. Targets: every batch stored, p99 <= 250 ms, "
          f"RSS <= 1 GiB")


def loadgen_binary() -> str:
    """The operator's load generator (bench/loadgen), beside the collector's binary unless
    RANKWATCH_LOADGEN names it."""
    path = os.environ.get("RANKWATCH_LOADGEN") or str(Path(BIN).parent / "rankwatch-loadgen")
    if not Path(path).exists():
        sys.exit(f"no load generator at {path}: cargo build --release -p rankwatch-loadgen")
    return path


def bench_operator(seconds: int, sizes: list[int], connections: int = 4096) -> None:
    """The figure an operator plans with (issue 47): `ranks` simulated ranks of one job, one
    step a second, each posting the agent's default per-step report (bench/agent_mix.json, with
    its gradient sketch every tenth step; the agent's own encoder, idempotency keys and version
    headers, bench/loadgen) through `connections` keep-alive connections, for `seconds`. The
    collector runs on CPU 0 with its default limits (but the ones a job this size needs: its
    world size, its series, and no per-address connection cap, since every simulated host is
    127.0.0.1), the generator on CPU 1. Reports the ack latency, what was refused, the
    collector's RSS by minute and its CPU as "ranks per collector core", with the generator's
    own lag beside it so that a schedule it could not keep is not read as the collector's."""
    import resource
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    loadgen = loadgen_binary()
    mix = Path(__file__).with_name("agent_mix.json")
    rows: list[str] = []
    for ranks in sizes:
        conns = min(connections, ranks)
        print(f"\n# operator: {ranks:,} ranks, one step a second, {conns:,} connections, {seconds} s", flush=True)
        with tempfile.TemporaryDirectory() as d:
            extra = ("--max-world-size", str(ranks), "--max-connections-per-peer", "0",
                     "--max-connections", str(conns + 64),
                     "--max-series-per-run", str(max(1 << 20, ranks * 64)),
                     "--max-series", str(max(5_000_000, ranks * 80)))
            proc, url = start_collector(Path(d) / "data", *extra, cpus="0")
            timeline: list[tuple[float, float, float]] = []  # (s, RSS MiB, CPU s)
            done = threading.Event()

            def sample() -> None:
                t0 = time.perf_counter()
                while not done.wait(1.0):
                    timeline.append((time.perf_counter() - t0, rss_mib(proc.pid), cpu_seconds(proc.pid)))

            out = Path(d) / "loadgen.json"
            cmd = [loadgen, "--collector", url, "--ranks", str(ranks), "--connections", str(conns),
                   "--seconds", str(seconds), "--mix", str(mix), "--out", str(out)]
            if shutil.which("taskset"):
                cmd = ["taskset", "-c", "1", *cmd]
            sampler = threading.Thread(target=sample, daemon=True)
            try:
                cpu0 = cpu_seconds(proc.pid)
                sampler.start()
                gen = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 600)
                cpu_load = cpu_seconds(proc.pid) - cpu0
                cpu_all = cpu_until_idle(proc.pid, limit=120) - cpu0
                done.set()
                sampler.join()
                if gen.returncode != 0:
                    sys.exit(f"load generator failed ({gen.returncode}):\n{gen.stdout[-3000:]}\n{gen.stderr[-3000:]}")
                progress = [line for line in gen.stdout.splitlines() if line.startswith("t=")]
                print("\n".join(progress[::6]), flush=True)
                report = json.loads(out.read_text())
                ingested = metric_sum(url, 'rankwatch_ingest_rows_total{table="samples"')
                derived = metric_sum(url, "rankwatch_derived_samples_total")
                alerts = requests.get(f"{url}/api/v1/alerts?run=operator", timeout=60).json()["alerts"]
            finally:
                done.set()
                stop(proc)
        wall = report["seconds"]
        cores = cpu_load / wall
        print(f"{'minute':>6} {'answers':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'RSS MiB max':>12} {'collector cores':>16}")
        for m in report["by_minute"]:
            window = [(r, c) for t, r, c in timeline if m["minute"] * 60 <= t < (m["minute"] + 1) * 60]
            rss = max((r for r, _ in window), default=float("nan"))
            busy = (window[-1][1] - window[0][1]) / max(1, len(window) - 1) if len(window) > 1 else float("nan")
            print(f"{m['minute']:>6} {m['answers']:>9,} {m['p50_ms']:>8.1f} {m['p99_ms']:>8.1f} {m['max_ms']:>8.1f} "
                  f"{rss:>12.1f} {busy:>16.2f}")
        peak = max(r for _, r, _ in timeline)
        print(f"requests {report['requests']:,} ({report['requests_per_second']:,.0f}/s), answered 2xx {report['ok']:,}, "
              f"refused {report['refused']:,} {report['statuses']}, without an answer {report['without_answer']:,}")
        print(f"rows sent {report['rows']:,} ({report['rows_per_second']:,.0f}/s), sketches {report['sketches']:,}; "
              f"collector ingested {ingested:,.0f} of them (+ {derived:,.0f} all-ranks statistics of its own); "
              f"alerts raised on the run: {len(alerts)}")
        print(f"generator: {report['late_steps']:,} connection slots begun over a step late (each then posts every step due), max lag "
              f"{report['max_lag_ms']:,.0f} ms; its own CPU {report['generator_cpu_seconds'] / wall:.2f} cores")
        print(f"collector CPU: {cpu_load:,.1f} s over {wall:,.0f} s of load = {cores:.2f} cores; "
              f"{cpu_all - cpu_load:,.1f} s more until idle; {ranks / cores:,.0f} ranks per collector core "
              f"({ranks * wall / cpu_all:,.0f} with everything after the load counted)")
        rows.append(f"{ranks:>7,} {conns:>6,} {report['p50_ms']:>7.1f} {report['p99_ms']:>7.1f} {report['refused'] + report['without_answer']:>8,} "
                    f"{peak:>9.0f} {cores:>6.2f} {ranks / cores:>12,.0f} {report['late_steps']:>6,}")
    print(f"\n{'ranks':>7} {'conns':>6} {'p50 ms':>7} {'p99 ms':>7} {'refused':>8} {'RSS peak':>9} {'cores':>6} "
          f"{'ranks/core':>12} {'late':>6}")
    print("\n".join(rows))


def main() -> None:
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}")
    which = sys.argv[1:] or ["ingest", "queries", "storage", "memory"]
    if which[0] == "ingest-ab":
        if len(which) != 3:
            sys.exit("usage: collector_bench.py ingest-ab OLD_BINARY NEW_BINARY")
        bench_ingest_ab(which[1], which[2])
        return
    if which[0] == "alerts-ab":
        if len(which) not in (3, 4):
            sys.exit("usage: collector_bench.py alerts-ab OLD_BINARY NEW_BINARY [RUNS]")
        bench_alerts_ab(which[1], which[2], int(which[3]) if len(which) == 4 else 4)
        return
    if which[0] == "ingest-fsync":
        bench_ingest_fsync()
        return
    if which[0] == "ingest-floor":
        bench_ingest_floor()
        return
    if which[0] == "operator":
        sizes = [int(n) for n in which[1:]] or [16_384, 65_536]
        bench_operator(int(os.environ.get("RANKWATCH_BENCH_OPERATOR_SECONDS", "600")), sizes)
        return
    if which[0] == "hostile":
        bench_hostile(int(os.environ.get("RANKWATCH_BENCH_HOSTILE_SECONDS", "60")))
        return
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
