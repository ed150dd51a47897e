"""`--storage s3://bucket/prefix` against a local S3-compatible server (moto's server mode):
two collectors sharded by run write one Hive-partitioned dataset with only their write-ahead
logs on local disk; DuckDB reads the dataset directly across runs and shards; a restarted
collector reads its runs back from the bucket; a part uploaded but never committed is removed
at start without touching another collector's parts; deleting a run removes its objects."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import boto3
import duckdb
import pytest
import requests
import s3fs

from conftest import Collector, free_port, samples

BUCKET = "rankwatch"
PREFIX = "datasets/prod"
STORAGE = f"s3://{BUCKET}/{PREFIX}"


class S3:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.client = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1"
        )

    def keys(self, under: str = PREFIX) -> set[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=under + "/")
        return {o["Key"][len(under) + 1 :] for page in pages for o in page.get("Contents", [])}


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[S3]:
    port = free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "moto.log", "w"),
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                requests.get(endpoint, timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.1)
        store = S3(endpoint)
        store.client.create_bucket(Bucket=BUCKET)
        # What the collector reads (object_store's AmazonS3Builder::from_env).
        for key, value in {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ALLOW_HTTP": "true",
        }.items():
            monkeypatch.setenv(key, value)
        yield store
    finally:
        server.terminate()
        server.wait(timeout=30)


def shard(tmp_path: Path, node: str, *extra: str, data: str | None = None) -> Collector:
    """A collector on the shared prefix; its data directory is named after the node unless given."""
    return Collector(tmp_path / (data or node), "--storage", STORAGE, "--node-id", node, "--no-alert-engine", *extra)


def sql(c: Collector, query: str) -> list[dict]:
    r = requests.post(f"{c.url}/api/v1/sql", json={"sql": query}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["rows"]


def expected(run: str, steps: range) -> tuple[int, float]:
    """Rows and value sum of `samples(run, steps)` (losses and ratios together)."""
    values = [s["value"] for s in samples(run, steps)["samples"]]
    return len(values), math.fsum(values)


def local_parquet(data_dir: Path) -> list[Path]:
    return sorted(data_dir.rglob("*.parquet"))


def test_two_shards_write_one_hive_dataset_that_duckdb_reads_across_runs(s3: S3, tmp_path: Path) -> None:
    runs = {"shard-a": {"alpha": range(0, 120), "beta": range(0, 40)}, "shard-b": {"gamma": range(0, 75)}}
    shards = {node: shard(tmp_path, node) for node in runs}
    for node, of_node in runs.items():
        for run, steps in of_node.items():
            assert shards[node].post_json(samples(run, steps)).status_code == 200
    for c in shards.values():
        c.stop()  # SIGTERM flushes to the bucket

    keys = s3.keys()
    for node, of_node in runs.items():
        assert f"_rankwatch/manifest-{node}.json" in keys
        assert f"_rankwatch/node-{node}.json" in keys
        for run in of_node:
            parts = [k for k in keys if k.startswith(f"table=samples/run={run}/")]
            assert parts and all(k.split("/")[-1].startswith(f"part-{node}-") and k.endswith(".parquet") for k in parts), parts
            assert any(k.startswith(f"table=runs/run={run}/part-{node}-") for k in keys), run
    # Only the write-ahead log stays local.
    for node in runs:
        assert local_parquet(tmp_path / node) == []
        assert not (tmp_path / node / "manifest.json").exists()
        assert (tmp_path / node / "wal").is_dir()

    # DuckDB, straight from the bucket, across every run of both shards, through fsspec.
    fs = s3fs.S3FileSystem(key="test", secret="test", endpoint_url=s3.endpoint, client_kwargs={"region_name": "us-east-1"})
    con = duckdb.connect()
    con.execute("SET autoinstall_known_extensions = false")
    con.register_filesystem(fs)
    rows = con.execute(
        f"""SELECT run, count(*) AS n, sum(value) AS total, max(step) AS last
            FROM read_parquet('s3://{BUCKET}/{PREFIX}/table=samples/*/*.parquet', hive_partitioning = true)
            GROUP BY run ORDER BY run"""
    ).fetchall()
    want = sorted((run, *expected(run, steps), steps[-1]) for of_node in runs.values() for run, steps in of_node.items())
    assert [r[0] for r in rows] == [w[0] for w in want]
    for got, (run, n, total, last) in zip(rows, want):
        assert got[1] == n and got[3] == last, (got, run)
        assert got[2] == pytest.approx(total, rel=1e-12), run
    # The run metadata too: one row per run, the world size as sent.
    meta = con.execute(
        f"SELECT run, world_size FROM read_parquet('s3://{BUCKET}/{PREFIX}/table=runs/*/*.parquet', hive_partitioning = true) ORDER BY run"
    ).fetchall()
    assert meta == [(run, 2) for run, *_ in want]

    # A restarted shard finds its runs in the bucket (its manifest is there) and serves them;
    # it does not adopt the other shard's runs.
    again = shard(tmp_path, "shard-a")
    try:
        listed = {r["run"]: r for r in requests.get(f"{again.url}/api/v1/runs", timeout=10).json()["runs"]}
        assert set(listed) == {"alpha", "beta"}
        assert listed["alpha"]["last_step"] == 119
        got = sql(again, "SELECT run, count(*) AS n, sum(value) AS total FROM samples GROUP BY run ORDER BY run")
        for row, run in zip(got, ["alpha", "beta"]):
            n, total = expected(run, runs["shard-a"][run])
            assert row["run"] == run and row["n"] == n and row["total"] == pytest.approx(total, rel=1e-12)
        # The export streams the parts from the bucket.
        r = requests.get(f"{again.url}/api/v1/runs/beta/export", params={"format": "csv"}, timeout=60)
        assert r.status_code == 200 and r.text.count("\n") == expected("beta", runs["shard-a"]["beta"])[0] + 1
    finally:
        again.stop()

    # Shard b's disk is lost: a replacement with the same node id and an empty data directory,
    # told to take the node id over, serves its run from the bucket.
    replacement = shard(tmp_path, "shard-b", "--take-over-node", data="shard-b-new")
    try:
        n, total = expected("gamma", runs["shard-b"]["gamma"])
        got = sql(replacement, "SELECT run, count(*) AS n, sum(value) AS total FROM samples GROUP BY run")
        assert len(got) == 1 and got[0]["run"] == "gamma" and got[0]["n"] == n
        assert got[0]["total"] == pytest.approx(total, rel=1e-12)
        # It keeps writing: new steps of the run land beside the old ones.
        assert replacement.post_json(samples("gamma", range(75, 80))).status_code == 200
    finally:
        replacement.stop()
    n_more, _ = expected("gamma", range(0, 80))
    fs.invalidate_cache()  # s3fs caches listings
    total_rows = con.execute(
        f"SELECT count(*) FROM read_parquet('s3://{BUCKET}/{PREFIX}/table=samples/run=gamma/*.parquet')"
    ).fetchone()
    assert total_rows == (n_more,)


def test_an_uncommitted_part_is_removed_at_start_but_never_another_shards(s3: S3, tmp_path: Path) -> None:
    first = shard(tmp_path, "shard-a")
    assert first.post_json(samples("alpha", range(0, 30))).status_code == 200
    first.stop()
    # As if shard-a crashed between uploading a part and committing its manifest; and a part
    # of shard-b, which shard-a's manifest does not list either.
    orphan = f"{PREFIX}/table=samples/run=alpha/part-shard-a-999.parquet"
    foreign = f"{PREFIX}/table=samples/run=zeta/part-shard-b-7.parquet"
    lookalike = f"{PREFIX}/table=samples/run=zeta/part-shard-a-1-3.parquet"  # node "shard-a-1"
    for key in (orphan, foreign, lookalike):
        s3.client.put_object(Bucket=BUCKET, Key=key, Body=b"PAR1")
    again = shard(tmp_path, "shard-a")
    try:
        keys = s3.keys()
        assert orphan[len(PREFIX) + 1 :] not in keys
        assert foreign[len(PREFIX) + 1 :] in keys
        assert lookalike[len(PREFIX) + 1 :] in keys
        n, _ = expected("alpha", range(0, 30))
        assert sql(again, "SELECT count(*) AS n FROM samples WHERE run = 'alpha'") == [{"n": n}]
    finally:
        again.stop()


def test_deleting_a_run_removes_its_objects_and_only_its(s3: S3, tmp_path: Path) -> None:
    # Grace for replaced parts is the query timeout + 5 s; maintenance runs every second.
    c = shard(tmp_path, "shard-a", "--query-timeout", "1s", "--compact-interval", "1s", "--flush-interval", "1s")
    try:
        for run in ("doomed", "kept"):
            assert c.post_json(samples(run, range(0, 50))).status_code == 200
        deadline = time.monotonic() + 60
        while not any(k.startswith("table=samples/run=doomed/") for k in s3.keys()):
            assert time.monotonic() < deadline, "the flush never reached the bucket"
            time.sleep(0.5)
        r = requests.delete(f"{c.url}/api/v1/runs/doomed", timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["files"] >= 2  # samples and run metadata
        while any("run=doomed/" in k for k in s3.keys()):
            assert time.monotonic() < deadline + 60, sorted(s3.keys())
            time.sleep(0.5)
        assert any(k.startswith("table=samples/run=kept/") for k in s3.keys())
        manifest = json.loads(s3.client.get_object(Bucket=BUCKET, Key=f"{PREFIX}/_rankwatch/manifest-shard-a.json")["Body"].read())
        assert {f["run"] for f in manifest["files"]} == {"kept"}
    finally:
        c.stop()


def test_a_bucket_that_does_not_exist_is_refused_at_start(s3: S3, tmp_path: Path) -> None:
    proc = subprocess.run(
        [os.environ["RANKWATCH_BIN"], "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
         "--storage", "s3://no-such-bucket/x", "--node-id", "n1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "cannot write to s3://no-such-bucket" in proc.stderr and "bucket exists" in proc.stderr, proc.stderr
    bad = subprocess.run(
        [os.environ["RANKWATCH_BIN"], "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"),
         "--storage", STORAGE, "--node-id", "a/b"],
        capture_output=True, text=True, timeout=60,
    )
    assert bad.returncode != 0 and "node id" in bad.stderr, bad.stderr


def test_a_second_collector_with_the_same_node_id_is_refused_and_a_take_over_fences_the_first(s3: S3, tmp_path: Path) -> None:
    # Two hosts' collectors left at the default node id (the host name) would share one.
    first = shard(tmp_path, "same", "--flush-interval", "1s")
    try:
        assert first.post_json(samples("alpha", range(0, 20))).status_code == 200
        manifest_key = f"{PREFIX}/_rankwatch/manifest-same.json"
        deadline = time.monotonic() + 60
        while manifest_key[len(PREFIX) + 1 :] not in s3.keys():
            assert time.monotonic() < deadline, "the first flush never reached the bucket"
            time.sleep(0.5)
        before = s3.client.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read()

        refused = subprocess.run(
            [os.environ["RANKWATCH_BIN"], "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "other"),
             "--storage", STORAGE, "--node-id", "same", "--no-alert-engine"],
            capture_output=True, text=True, timeout=120,
        )
        assert refused.returncode != 0
        assert "held by another collector" in refused.stderr and "--node-id" in refused.stderr, refused.stderr
        assert str(tmp_path / "same") in refused.stderr, "names the holder's data directory"
        assert s3.client.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read() == before, "nothing written"

        # Taken over: the new holder writes; the first one's next flush is fenced off.
        second = shard(tmp_path, "same", "--take-over-node", "--flush-interval", "1s", data="other")
        try:
            assert second.post_json(samples("beta", range(0, 20))).status_code == 200
            assert first.post_json(samples("alpha", range(20, 40))).status_code == 200
            time.sleep(4)
            manifest = json.loads(s3.client.get_object(Bucket=BUCKET, Key=manifest_key)["Body"].read())
            assert {f["run"] for f in manifest["files"]} >= {"beta"}, manifest
            assert all(f["run"] != "alpha" or f["max_step"] < 20 for f in manifest["files"] if f["table"] == "samples"), manifest
            metrics = requests.get(f"{first.url}/metrics", timeout=10).text
            assert "rankwatch_flush_errors_total 0" not in metrics, "the fenced collector's flushes fail"
        finally:
            second.stop()
    finally:
        if first.proc.poll() is None:
            first.proc.send_signal(signal.SIGTERM)
            # Its final flush is refused too: it exits non-zero, its batches kept in its log.
            assert first.proc.wait(timeout=60) != 0
    assert "taken over by another collector" in first.log.read_text(), first.log.read_text()[-2000:]
