"""Fixtures: the real `rankwatch` binary on a free loopback port, in a fresh data directory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(run: str, steps: range, ranks: int = 2) -> dict:
    """An ingest body: each rank's loss, and rank 0's spectral ratio of layer 1, per step."""
    return {
        "run": run,
        "info": {"world_size": ranks},
        "samples": [{"rank": r, "step": s, "metric": "loss", "value": 1.0 + s + r / 10} for s in steps for r in range(ranks)]
        + [{"rank": 0, "step": s, "metric": "spectral.ratio", "layer": 1, "value": 2.0 + s / 100} for s in steps],
    }


class Collector:
    """A running `rankwatch serve`."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        binary = os.environ.get("RANKWATCH_BIN")
        if not binary or not Path(binary).exists():
            raise RuntimeError("RANKWATCH_BIN must name the built rankwatch binary (cargo xtask test sets it)")
        self.data_dir = data_dir
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        # Beside the data directory, so a failing assertion can show why the collector stopped.
        self.log = data_dir.parent / f"{data_dir.name}.log"
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), *extra],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, "RANKWATCH_LOG": "warn"},
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("rankwatch listening on http://"), self.log.read_text()[-4000:]
        self.url = line.strip().rsplit(" ", 1)[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def post_json(self, body: dict, key: str | None = None) -> requests.Response:
        headers = {"content-type": "application/json"}
        if key:
            headers["idempotency-key"] = key
        return requests.post(f"{self.url}/api/v1/ingest", json=body, headers=headers, timeout=30)

    def stop(self) -> None:
        """SIGTERM: a graceful shutdown that flushes everything to Parquet."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(timeout=60) == 0


@pytest.fixture
def store_only(tmp_path: Path) -> Iterator[Collector]:
    """A collector without the alert engine: it stores exactly what it is sent, nothing derived."""
    c = Collector(tmp_path / "data", "--no-alert-engine")
    yield c
    if c.proc.poll() is None:
        c.proc.kill()
        c.proc.wait()


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    c = Collector(tmp_path / "data")
    yield c
    if c.proc.poll() is None:
        c.proc.kill()
        c.proc.wait()
