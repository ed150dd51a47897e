"""Shared pytest setup: import the in-tree `rankwatch` package and never touch the network."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Tests must never download anything; transformers and huggingface_hub honour this.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SDK_ROOT = Path(__file__).resolve().parent.parent
if str(SDK_ROOT) not in sys.path:
    sys.path.insert(0, str(SDK_ROOT))


# --- the real collector, for end-to-end tests -------------------------------------------------

import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

REPO = SDK_ROOT.parent


def train_step(model, optimizer, vocab: int, batch: int, seq: int):  # type: ignore[no-untyped-def]
    """One optimizer step of a nanoGPT-style model on random tokens, next-token targets;
    returns the detached loss."""
    import torch

    x = torch.randint(0, vocab, (batch, seq))
    _, loss = model(x, torch.roll(x, -1, 1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def sdk_env(**extra: str) -> dict[str, str]:
    """This process's environment for a fresh process that imports this tree's SDK (not an
    installed one), without the `RANKWATCH_` settings this run may carry, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RANKWATCH_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SDK_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def free_port() -> int:
    """A loopback port free at the moment of asking."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argv: list[str], world: int, timeout: float, env: dict[str, str] | None = None) -> list[str]:
    """Runs `argv` as `world` processes with torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT on a free port) and returns each rank's stdout. All must exit
    0 within `timeout` seconds: a hang kills every rank and fails the test. Each rank is forked
    from the test kit's zygote, which has imported torch already (`rankwatch_testkit.zygote`)."""
    from rankwatch_testkit import zygote

    port = str(free_port())
    procs = [
        subprocess.Popen(
            zygote.command(argv),
            env={**os.environ, **(env or {}), "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(argv[:3])}: a rank did not finish within {timeout} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}; stdout: {outputs}"
    return outputs


def torchrun(argv: list[str], nproc: int, timeout: float, env: dict[str, str] | None = None) -> None:
    """`python -m torch.distributed.run --nproc_per_node N argv...`; a hang past `timeout` fails."""
    # --standalone: torchrun binds a free rendezvous port itself, with no window in which another
    # process could take a port picked here first.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *argv]
    done = subprocess.run(cmd, env={**os.environ, "TORCHELASTIC_RUN_ID": "none", **(env or {})}, timeout=timeout, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]


def collector_binary() -> str:
    binary = os.environ.get("RANKWATCH_BIN") or str(REPO / "target" / "debug" / "rankwatch")
    if not Path(binary).exists():
        raise RuntimeError(f"the rankwatch binary is not built at {binary}; run `cargo xtask test` (or set RANKWATCH_BIN)")
    return binary


class Collector:
    """A real `rankwatch serve` on loopback, restartable on the same port and data directory."""

    def __init__(self, data_dir: Path, port: int = 0, extra_args: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = port
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[str] | None = None
        self.start()

    def start(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            proc = subprocess.Popen(
                [collector_binary(), "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir", str(self.data_dir), "--flush-interval", "1s", *self.extra_args],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "RANKWATCH_LOG": "warn"},
            )
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.startswith("rankwatch listening on http://"):
                break
            proc.wait()
            # The port of a killed collector can take a moment to be free again.
            assert time.monotonic() < deadline, f"collector did not start: {line!r}"
            time.sleep(0.2)
        self.proc = proc
        self.url = line.strip().rsplit(" ", 1)[1]
        self.port = int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def sql(self, query: str) -> list[dict[str, Any]]:
        import requests

        r = requests.post(f"{self.url}/api/v1/sql", json={"sql": query}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["rows"]

    def alerts(self, run: str) -> list[dict[str, Any]]:
        import requests

        r = requests.get(f"{self.url}/api/v1/alerts", params={"run": run}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["alerts"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[Collector]:
    c = Collector(tmp_path / "data")
    yield c
    if c.proc is not None and c.proc.poll() is None:
        c.proc.kill()
        c.proc.wait()


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this process alone (DDP and the sharded APIs need one)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
