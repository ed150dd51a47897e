"""A real Prometheus (Debian's package) scrapes the collector's /metrics, and its query API
returns the collector's own counters and the bounded per-run gauges."""

from __future__ import annotations

import os
import subprocess
import time

import requests

from conftest import free_port


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

    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: rankwatch\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{collector.port}']\n"
    )
    prometheus = subprocess.Popen(
        [os.environ.get("PROMETHEUS_BIN", "/usr/bin/prometheus"), f"--config.file={config}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        def query(expr: str) -> list:
            r = requests.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=5)
            r.raise_for_status()
            return r.json()["data"]["result"]

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
                results = {k: query(v) for k, v in wanted.items()}
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
