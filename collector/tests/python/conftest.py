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


class Collector:
    """A running `rankwatch serve`."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        binary = os.environ.get("RANKWATCH_BIN")
        if not binary or not Path(binary).exists():
            raise RuntimeError("RANKWATCH_BIN must name the built rankwatch binary (cargo xtask test sets it)")
        self.data_dir = data_dir
        self.proc = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "RANKWATCH_LOG": "warn"},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("rankwatch listening on http://"), line
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
