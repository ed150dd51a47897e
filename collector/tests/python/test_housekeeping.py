"""Deletion, retention and export, through the real binary's CLI (`rankwatch runs ...`,
`rankwatch export`) against a real collector: exactly the right runs go, nothing comes back
after a crash, and exports read back with pyarrow match what was sent."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import requests

from conftest import Collector, samples

BIN = os.environ.get("RANKWATCH_BIN", "")


def cli(url: str, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RANKWATCH_URL": url}
    env.pop("RANKWATCH_TOKEN", None)
    if token:
        env["RANKWATCH_TOKEN"] = token
    return subprocess.run([BIN, *args], env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def count(c: Collector, run: str) -> int:
    r = requests.post(f"{c.url}/api/v1/sql", json={"sql": f"SELECT count(*) AS n FROM samples WHERE run = '{run}'"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["rows"][0]["n"]


def runs(c: Collector) -> set[str]:
    return {r["run"] for r in requests.get(f"{c.url}/api/v1/runs", timeout=10).json()["runs"]}


def test_delete_removes_exactly_one_run_files_included_and_it_stays_gone_after_a_crash(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = Collector(data)
    assert first.post_json(samples("doomed", range(0, 50))).status_code == 200
    assert first.post_json(samples("kept", range(0, 50))).status_code == 200
    first.stop()  # a clean stop flushes: both runs are in Parquet
    assert (data / "table=samples" / "run=doomed").exists()
    # No flush while this one runs: the next rows of the doomed run live only in memory and in
    # the write-ahead log when it is deleted. A short query timeout makes the deleted files'
    # grace period short (timeout + 5 s); the files are removed by the next compaction pass after
    # it, so that pass runs often too.
    c = Collector(data, "--flush-interval", "1h", "--query-timeout", "1s", "--compact-interval", "2s")
    try:
        kept_before = count(c, "kept")
        listed = cli(c.url, "runs", "list")
        assert listed.returncode == 0, listed.stderr
        assert "doomed" in listed.stdout and "kept" in listed.stdout and "2 run(s)" in listed.stdout
        # Without --yes and without a terminal, nothing is deleted.
        refused = cli(c.url, "runs", "delete", "doomed")
        assert refused.returncode != 0 and "--yes" in refused.stderr
        assert "doomed" in runs(c)

        before = count(c, "doomed")  # the samples sent plus the alert engine's statistics
        assert c.post_json(samples("doomed", range(50, 60))).status_code == 200
        deleted = cli(c.url, "runs", "delete", "doomed", "--yes")
        assert deleted.returncode == 0, deleted.stderr
        # Every row, from Parquet and from memory: at least the 30 just sent more (the
        # statistics of their steps may or may not have been derived yet).
        removed = int(deleted.stdout.split("deleted doomed: ")[1].split(" rows")[0])
        assert before + 30 <= removed <= before + 30 + 10 * 8, (before, deleted.stdout)
        assert runs(c) == {"kept"}
        assert count(c, "doomed") == 0
        assert count(c, "kept") == kept_before
        missing = cli(c.url, "runs", "delete", "doomed", "--yes")
        assert missing.returncode != 0 and 'unknown run "doomed"' in missing.stderr, missing.stderr
        # The files go once the grace period for queries already running is over.
        deadline = time.monotonic() + 60
        while (data / "table=samples" / "run=doomed").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not (data / "table=samples" / "run=doomed").exists()
        assert any((data / "table=samples" / "run=kept").iterdir())
    finally:
        # A crash, not a clean stop: the log (holding the doomed run's last rows) is replayed
        # at the next start.
        c.proc.kill()
        c.proc.wait()
    again = Collector(data)
    try:
        assert runs(again) == {"kept"}
        assert count(again, "doomed") == 0
        assert count(again, "kept") == kept_before
    finally:
        again.stop()


def test_retention_by_age_deletes_exactly_the_silent_runs(tmp_path: Path) -> None:
    c = Collector(tmp_path / "data", "--active-window", "1s")
    try:
        for run in ("old-a", "old-b"):
            assert c.post_json(samples(run, range(10))).status_code == 200
        time.sleep(3)
        assert c.post_json(samples("fresh", range(10))).status_code == 200
        dry = cli(c.url, "runs", "prune", "--older-than", "2s", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert "would delete old-a" in dry.stdout and "would delete old-b" in dry.stdout and "fresh" not in dry.stdout
        assert runs(c) == {"old-a", "old-b", "fresh"}
        done = cli(c.url, "runs", "prune", "--older-than", "2s")
        assert done.returncode == 0, done.stderr
        assert "deleted 2 run(s)" in done.stdout, done.stdout
        assert runs(c) == {"fresh"}
        # No policy given and none configured: refused, with the reason.
        none = requests.post(f"{c.url}/api/v1/retention", timeout=10)
        assert none.status_code == 400 and "no retention policy" in none.json()["error"]
        bad = requests.post(f"{c.url}/api/v1/retention", json={"max_age": "soon"}, timeout=10)
        assert bad.status_code == 400 and "max_age" in bad.json()["error"]
    finally:
        c.stop()


def test_retention_by_size_spares_active_runs_and_runs_in_the_background(tmp_path: Path) -> None:
    c = Collector(tmp_path / "data", "--flush-interval", "500ms", "--active-window", "2s")
    try:
        for run in ("s1", "s2"):
            assert c.post_json(samples(run, range(200))).status_code == 200
            time.sleep(0.3)
        time.sleep(3)
        assert c.post_json(samples("live", range(200))).status_code == 200
        time.sleep(1.5)  # flushed: every run has Parquet bytes
        sizes = {r["run"]: r["bytes"] for r in requests.get(f"{c.url}/api/v1/runs", timeout=10).json()["runs"]}
        assert all(v > 0 for v in sizes.values()), sizes
        # A cap that only the oldest run must go for.
        cap = sizes["s2"] + sizes["live"]
        report = requests.post(f"{c.url}/api/v1/retention", json={"max_bytes": cap}, timeout=10).json()
        assert [d["run"] for d in report["deleted"]] == ["s1"] and report["deleted"][0]["reason"] == "size", report
        # A cap of 0: s2 goes, the live run stays and the answer says why.
        report = requests.post(f"{c.url}/api/v1/retention", json={"max_bytes": "0B"}, timeout=10).json()
        assert [d["run"] for d in report["deleted"]] == ["s2"], report
        assert "over the cap" in report["over_cap"]
        assert runs(c) == {"live"}
    finally:
        c.stop()
    # The background task: a collector started with an age policy deletes by itself.
    bg = Collector(tmp_path / "data", "--retention-age", "1s", "--retention-interval", "1s", "--active-window", "1s")
    try:
        deadline = time.monotonic() + 20
        while runs(bg) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert runs(bg) == set()
        metrics = requests.get(f"{bg.url}/metrics", timeout=10).text
        assert "rankwatch_runs_deleted_total 1" in metrics
    finally:
        bg.stop()


def test_export_reads_back_with_pyarrow_and_refusals_leave_no_file(tmp_path: Path) -> None:
    # Store only: the export must hold exactly the rows sent (no derived statistics).
    c = Collector(tmp_path / "data", "--flush-interval", "500ms", "--read-token", "r3ad", "--no-alert-engine")
    try:
        sent = samples("ex", range(0, 40), ranks=3)
        assert c.post_json(sent).status_code == 200
        time.sleep(1.5)  # some rows in Parquet ...
        more = samples("ex", range(40, 50), ranks=3)
        assert c.post_json(more).status_code == 200  # ... and some still in memory
        expected = sorted((s["metric"], s.get("layer"), s.get("rank"), s["step"], s["value"]) for s in sent["samples"] + more["samples"])

        out = tmp_path / "ex.parquet"
        done = cli(c.url, "export", "ex", "--format", "parquet", "-o", str(out), token="r3ad")
        assert done.returncode == 0, done.stderr
        table = pq.read_table(out)
        assert set(table.column_names) >= {"run", "rank", "step", "time", "metric", "layer", "site", "value"}
        rows = table.to_pylist()
        assert {r["run"] for r in rows} == {"ex"}
        assert sorted((r["metric"], r["layer"], r["rank"], r["step"], r["value"]) for r in rows) == expected

        csv = tmp_path / "ex.csv"
        done = cli(c.url, "export", "ex", "--format", "csv", "-o", str(csv), token="r3ad")
        assert done.returncode == 0, done.stderr
        back = pacsv.read_csv(csv).to_pylist()
        assert len(back) == len(expected)
        assert sorted(r["value"] for r in back) == sorted(e[4] for e in expected)

        # No token: refused with the collector's message, and no file (not even a partial one).
        denied = tmp_path / "denied.parquet"
        refused = cli(c.url, "export", "ex", "-o", str(denied))
        assert refused.returncode != 0 and "missing bearer token" in refused.stderr, refused.stderr
        assert not denied.exists() and not list(tmp_path.glob("denied*"))
        unknown = cli(c.url, "export", "nope", "-o", str(tmp_path / "nope.parquet"), token="r3ad")
        assert unknown.returncode != 0 and 'unknown run "nope"' in unknown.stderr
        bad = requests.get(f"{c.url}/api/v1/runs/ex/export", params={"format": "xlsx"}, headers={"authorization": "Bearer r3ad"}, timeout=10)
        assert bad.status_code == 400 and "parquet or csv" in bad.json()["error"]
    finally:
        c.stop()


def test_deletion_needs_the_admin_token_and_never_takes_the_ingest_token(tmp_path: Path) -> None:
    c = Collector(tmp_path / "data", "--ingest-token", "in", "--read-token", "rd", "--admin-token", "adm")
    try:
        r = requests.post(f"{c.url}/api/v1/ingest", json=samples("t", range(3)), headers={"authorization": "Bearer in"}, timeout=10)
        assert r.status_code == 200
        for token in (None, "rd", "in"):
            refused = cli(c.url, "runs", "delete", "t", "--yes", token=token)
            assert refused.returncode != 0 and "401" in refused.stderr, refused.stderr
        done = cli(c.url, "runs", "delete", "t", "--yes", token="adm")
        assert done.returncode == 0, done.stderr
    finally:
        c.stop()
    # Tokens but no admin token: nobody may delete, the ingest token every job holds included.
    c = Collector(tmp_path / "data2", "--ingest-token", "in")
    try:
        assert requests.post(f"{c.url}/api/v1/ingest", json=samples("t", range(3)), headers={"authorization": "Bearer in"}, timeout=10).status_code == 200
        for headers in ({}, {"authorization": "Bearer in"}):
            refused = requests.delete(f"{c.url}/api/v1/runs/t", headers=headers, timeout=10)
            assert refused.status_code == 403 and "--admin-token" in refused.json()["error"], refused.text
        assert runs(c) == {"t"}
    finally:
        c.stop()
