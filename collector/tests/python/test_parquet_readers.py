"""The Parquet files the collector writes are read by pyarrow and DuckDB as they are — Hive
partitions, zstd, sorted — with exactly the rows that were ingested, NaN and ±Inf included.
A batch is also sent the way a non-Rust client would: an Arrow IPC stream with zstd buffers
written by pyarrow."""

from __future__ import annotations

import math

import duckdb
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import requests


def rows_for(run: str, ranks: int, steps: int) -> list[dict]:
    rows = []
    for step in range(steps):
        for rank in range(ranks):
            rows.append({"rank": rank, "step": step, "metric": "loss", "value": 3.0 - step * 0.01 + rank})
            for layer in range(2):
                rows.append({"rank": rank, "step": step, "metric": "spectral.ratio", "layer": layer, "value": 1.0 + layer + step / 100})
    return rows


def canon(value: float) -> object:
    return "nan" if isinstance(value, float) and math.isnan(value) else value


def key(r: dict) -> tuple:
    return (r["run"], r.get("rank"), r["step"], r["metric"], r.get("layer"), r.get("site"), canon(r["value"]))


def arrow_stream(run: str) -> bytes:
    n = 40
    table = pa.table(
        {
            "run": pa.array([run] * n, pa.string()),
            "rank": pa.array([i % 4 for i in range(n)], pa.uint32()),
            "step": pa.array([100 + i // 4 for i in range(n)], pa.uint64()),
            "time": pa.array([1_700_000_000_000 + i for i in range(n)], pa.timestamp("ms", tz="UTC")),
            "metric": pa.array(["grad_norm"] * n, pa.string()),
            "layer": pa.array([None] * n, pa.uint32()),
            "site": pa.array([None] * n, pa.string()),
            "value": pa.array([float("inf") if i == 7 else 0.5 * i for i in range(n)], pa.float64()),
        }
    )
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema, options=ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def test_pyarrow_and_duckdb_read_back_exactly_the_ingested_rows(store_only, tmp_path):
    collector = store_only
    expected: list[dict] = []
    for run in ["alpha", "beta-2"]:
        rows = rows_for(run, ranks=3, steps=25)
        rows.append({"rank": 0, "step": 30, "metric": "loss", "value": "NaN"})
        rows.append({"rank": 1, "step": 30, "metric": "loss", "value": "-Infinity"})
        r = collector.post_json({"run": run, "samples": rows}, key=f"{run}/0/py/0")
        assert r.status_code == 200, r.text
        for row in rows:
            value = {"NaN": float("nan"), "-Infinity": float("-inf")}.get(row["value"], row["value"])
            expected.append({"run": run, **row, "value": value})
    r = requests.post(
        f"{collector.url}/api/v1/ingest",
        data=arrow_stream("alpha"),
        headers={"content-type": "application/vnd.apache.arrow.stream", "idempotency-key": "alpha/9/py/1"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert r.json()["nonfinite"] == 1
    for i in range(40):
        expected.append({"run": "alpha", "rank": i % 4, "step": 100 + i // 4, "metric": "grad_norm",
                         "value": float("inf") if i == 7 else 0.5 * i})
    collector.stop()

    root = collector.data_dir / "table=samples"
    files = sorted(root.glob("run=*/part-*.parquet"))
    assert files, "flushed on shutdown"
    # Each file is zstd-compressed and sorted by (metric, layer, site, rank, step).
    for f in files:
        meta = pq.ParquetFile(f).metadata
        assert meta.row_group(0).column(0).compression == "ZSTD"
        t = pq.read_table(f).to_pylist()
        keys = [(r["metric"], r["layer"] if r["layer"] is not None else -1, r["site"] or "", r["rank"], r["step"]) for r in t]
        assert keys == sorted(keys)

    want = sorted(key(r) for r in expected)

    dataset = ds.dataset(root, format="parquet", partitioning="hive")
    got = sorted(key(r) for r in dataset.to_table().to_pylist())
    assert got == want

    con = duckdb.connect()
    duck = con.execute(
        "SELECT run, rank, step, metric, layer, site, value FROM read_parquet(?, hive_partitioning = true)",
        [str(root / "*" / "*.parquet")],
    ).fetchall()
    cols = ["run", "rank", "step", "metric", "layer", "site", "value"]
    got = sorted(key(dict(zip(cols, row))) for row in duck)
    assert got == want
    nonfinite = con.execute(
        "SELECT count(*) FROM read_parquet(?, hive_partitioning = true) WHERE isnan(value) OR isinf(value)",
        [str(root / "*" / "*.parquet")],
    ).fetchone()[0]
    assert nonfinite == 5
