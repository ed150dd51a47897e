"""A real Prometheus (Debian's package) scrapes the collector's /metrics, and its query API
returns the collector's own counters and the bounded per-run gauges; with several collector
shards, a global Prometheus federating the shards' Prometheus servers with
`deploy/prometheus/federation.yml` sees every run's aggregates in one place."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import requests
import yaml

from conftest import Collector, free_port

ROOT = Path(__file__).resolve().parents[3]


def start_prometheus(config: str, workdir: Path) -> tuple[subprocess.Popen, int]:
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    (workdir / "prometheus.yml").write_text(config)
    proc = subprocess.Popen(
        [os.environ.get("PROMETHEUS_BIN", "/usr/bin/prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, port


def query(port: int, expr: str) -> list:
    r = requests.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=5)
    r.raise_for_status()
    return r.json()["data"]["result"]


def test_prometheus_scrapes_metrics_and_answers_queries(collector, tmp_path):
    samples = []
    for step in range(10):
        for rank in range(2):
            samples.append({"rank": rank, "step": step, "metric": "loss", "value": 2.0 + rank})
        samples.append({"step": step, "metric": "perplexity", "value": 7.5})
        for layer in range(3):
            samples.append({"rank": 0, "step": step, "metric": "spectral.ratio", "layer": layer, "value": 0.5 + layer})
    r = collector.post_json({"run": "prom-run", "info": {"world_size": 2}, "samples": samples})
    assert r.status_code == 200, r.text

    prometheus, port = start_prometheus(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: rankwatch\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{collector.port}']\n",
        tmp_path / "prometheus",
    )
    try:
        deadline = time.time() + 60
        results: dict[str, list] = {}
        wanted = {
            "rows": 'rankwatch_ingest_rows_total',
            "up": 'up{job="rankwatch"}',
            "step": 'rankwatch_run_step{run="prom-run"}',
            "loss": 'rankwatch_run_loss{run="prom-run"}',
            "ratio": 'rankwatch_run_spectral_ratio_max{run="prom-run"}',
            "fsync": 'rankwatch_wal_fsync_seconds_count',
        }
        while time.time() < deadline:
            try:
                results = {k: query(port, v) for k, v in wanted.items()}
            except requests.RequestException:
                results = {}
            if results and all(results.values()):
                break
            time.sleep(1)
        assert results and all(results.values()), results
        value = lambda k: float(results[k][0]["value"][1])  # noqa: E731
        assert value("up") == 1
        assert value("rows") == len(samples) + 1  # the samples and the run's info row
        assert value("step") == 9
        assert value("loss") == 2.5  # mean of the ranks' latest loss
        assert value("ratio") == 2.5
        assert value("fsync") >= 1
        # No per-layer or per-rank label reached Prometheus.
        series = requests.get(f"http://127.0.0.1:{port}/api/v1/series", params={"match[]": '{job="rankwatch"}'}, timeout=5).json()["data"]
        assert not any("layer" in s or "rank" in s for s in series)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)


def test_a_global_prometheus_federates_every_shards_run_aggregates(tmp_path: Path) -> None:
    shards = {name: Collector(tmp_path / name) for name in ("a", "b")}
    procs: list[subprocess.Popen] = []
    try:
        for name, c in shards.items():
            body = {"run": f"fed-{name}", "info": {"world_size": 2}, "samples": [
                {"rank": rank, "step": step, "metric": "loss", "value": (3.0 if name == "a" else 5.0) + rank}
                for step in range(5) for rank in range(2)
            ]}
            assert c.post_json(body).status_code == 200
        shard_ports = {}
        for name, c in shards.items():
            proc, port = start_prometheus(
                "global:\n  scrape_interval: 1s\n"
                f"  external_labels:\n    shard: {name}\n"
                "scrape_configs:\n  - job_name: rankwatch\n"
                f"    static_configs:\n      - targets: ['127.0.0.1:{c.port}']\n",
                tmp_path / f"prometheus-{name}",
            )
            procs.append(proc)
            shard_ports[name] = port
        # The shipped federation config, pointed at this test's shard servers.
        config = yaml.safe_load((ROOT / "deploy/prometheus/federation.yml").read_text())
        config["global"]["scrape_interval"] = "1s"
        config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{p}" for p in shard_ports.values()]
        proc, global_port = start_prometheus(yaml.safe_dump(config), tmp_path / "prometheus-global")
        procs.append(proc)

        deadline = time.time() + 90
        loss: list = []
        while time.time() < deadline:
            try:
                loss = query(global_port, "rankwatch_run_loss")
                up = query(global_port, 'up{job="rankwatch"}')
            except requests.RequestException:
                loss, up = [], []
            if len(loss) == 2 and len(up) == 2:
                break
            time.sleep(1)
        got = {(s["metric"]["run"], s["metric"]["shard"]): float(s["value"][1]) for s in loss}
        assert got == {("fed-a", "a"): 3.5, ("fed-b", "b"): 5.5}, loss
        assert sorted(s["metric"]["shard"] for s in up) == ["a", "b"]
        # The global view aggregates across shards.
        total = query(global_port, "sum(rankwatch_run_step)")
        assert float(total[0]["value"][1]) == 8
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        for c in shards.values():
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
