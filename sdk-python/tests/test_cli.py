"""The `rankwatch` command on a training node: one version everywhere, each of the two programs
hands the other's commands over, `sync` and `doctor` tell the truth about what they checked.

Everything here runs the real programs: the Python package's `rankwatch` (`python -m
rankwatch`, what the wheel's console script calls) and the collector binary the tests built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version as installed_version
from pathlib import Path

import requests
import tomllib
from conftest import REPO, Collector, collector_binary, free_port

import rankwatch

TIMEOUT = 120


def sdk(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rankwatch", *args], capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **(env or {})})


def binary(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([collector_binary(), *args], capture_output=True, text=True, timeout=TIMEOUT, env={**os.environ, **(env or {})}, cwd=cwd)


def workspace_version() -> str:
    return str(tomllib.loads((REPO / "Cargo.toml").read_text())["workspace"]["package"]["version"])


def test_one_version_for_the_workspace_the_wheel_and_both_commands() -> None:
    expected = workspace_version()
    assert rankwatch.__version__ == expected
    assert installed_version("rankwatch") == expected  # the wheel's metadata, from Cargo.toml
    assert sdk("--version").stdout.strip() == f"rankwatch {expected}"
    assert binary("--version").stdout.strip() == f"rankwatch {expected}"


def test_the_collector_reports_its_version_and_each_runs_agent_version(collector: Collector) -> None:
    health = requests.get(f"{collector.url}/healthz", timeout=10).json()
    assert health["version"] == rankwatch.__version__
    assert health["wire_protocol"] == rankwatch._native.WIRE_PROTOCOL
    run = rankwatch.init("versioned", collector.url, rank=0, world_size=1, mode="online")
    run.log(0, loss=1.0)
    run.finish()
    runs = requests.get(f"{collector.url}/api/v1/runs", timeout=10).json()["runs"]
    (summary,) = [r for r in runs if r["run"] == "versioned"]
    assert summary["agent_version"] == rankwatch.__version__
    listed = binary("runs", "list", "--url", collector.url)
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()[:2]
    assert header.split()[-1] == "AGENT" and row.split()[0] == "versioned" and row.split()[-1] == rankwatch.__version__


def test_each_program_hands_the_others_commands_over(tmp_path: Path, collector: Collector) -> None:
    # The SDK's rankwatch runs the binary's `runs list`, found through RANKWATCH_BIN...
    via_sdk = sdk("runs", "list", "--url", collector.url, env={"RANKWATCH_BIN": collector_binary()})
    assert via_sdk.returncode == 0 and "0 run(s)" in via_sdk.stdout, via_sdk.stderr
    # ...or as the first native `rankwatch` on PATH, skipping scripts named rankwatch.
    bin_dir = str(Path(collector_binary()).parent)
    on_path = sdk("runs", "list", "--url", collector.url, env={"RANKWATCH_BIN": "", "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    assert on_path.returncode == 0 and "0 run(s)" in on_path.stdout, on_path.stderr
    # Without one, it says what is missing and where to get it.
    missing = sdk("serve", env={"RANKWATCH_BIN": "", "PATH": "/nonexistent"})
    assert missing.returncode == 2
    assert "`serve` is a command of the collector binary" in missing.stderr and "RANKWATCH_BIN" in missing.stderr
    # `attach RUN` (no --pid) is the binary's; `attach --pid` is the SDK's.
    switched = sdk("attach", "later-run", "--url", collector.url, env={"RANKWATCH_BIN": collector_binary()})
    assert switched.returncode == 0 and switched.stdout.startswith("later-run: probes on"), switched.stderr
    # The binary runs the SDK's `doctor` in the Python RANKWATCH_PYTHON names...
    doctor = binary("doctor", "--collector", collector.url, "--json", env={"RANKWATCH_PYTHON": sys.executable})
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert checks["collector"]["status"] == "ok" and collector.url in checks["collector"]["detail"]
    # ...and names the Python when it has no rankwatch (run elsewhere than sdk-python/, whose
    # rankwatch/ a bare `python -c` would import from the working directory).
    bare = binary("doctor", env={"RANKWATCH_PYTHON": "/usr/bin/python3", "PYTHONPATH": "", "PYTHONNOUSERSITE": "1"}, cwd=tmp_path)
    assert bare.returncode != 0 and "/usr/bin/python3 has no rankwatch package" in bare.stderr, bare.stderr


def test_doctor_names_what_is_wrong(tmp_path: Path, collector: Collector) -> None:
    good = sdk("doctor", "--collector", collector.url, "--spool-dir", str(tmp_path / "spool"), "--json")
    assert good.returncode == 0, good.stdout
    checks = {c["name"]: c for c in json.loads(good.stdout)}
    import torch

    assert checks["torch"]["status"] == "ok" and torch.__version__ in checks["torch"]["detail"]
    assert "gloo" in checks["torch.distributed"]["detail"]
    assert checks["spool"]["status"] == "ok" and (tmp_path / "spool").is_dir()
    assert f"rankwatch {rankwatch.__version__}" in checks["collector"]["detail"]
    assert checks["attach"]["status"] in ("ok", "warn")

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    dead = f"http://127.0.0.1:{free_port()}"
    bad = sdk("doctor", "--collector", dead, "--spool-dir", str(blocked / "spool"))
    assert bad.returncode == 1
    lines = {line.split()[1]: line for line in bad.stdout.splitlines() if line[:4] in ("ok  ", "warn", "fail")}
    assert lines["collector"].startswith("fail") and dead in lines["collector"]
    assert lines["spool"].startswith("fail") and str(blocked / "spool") in lines["spool"]
    assert "2 failed: collector, spool" in bad.stdout


def test_sync_sends_an_offline_run_and_says_what_it_did(tmp_path: Path, collector: Collector) -> None:
    spool = tmp_path / "spool"
    run = rankwatch.init("offline-cli", mode="offline", spool_dir=spool, rank=0, world_size=1)
    for step in range(5):
        run.log(step, loss=float(step))
    run.finish()
    sent = sdk("sync", str(spool / "offline-cli"), "--collector", collector.url)
    assert sent.returncode == 0, sent.stderr
    assert "0 batches remain" in sent.stdout
    assert collector.sql("SELECT count(*) AS n FROM samples WHERE run = 'offline-cli' AND metric = 'loss'")[0]["n"] == 5
    again = binary("sync", str(spool / "offline-cli"), "--collector", collector.url, env={"RANKWATCH_PYTHON": sys.executable})
    assert again.returncode == 0 and "sent 0 rows" in again.stdout, again.stdout + again.stderr
    missing = sdk("sync", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


def test_import_without_torch_names_the_missing_dependency() -> None:
    # A meta-path finder that hides torch, in a fresh interpreter: the package imports, the
    # torch-free parts work, and the first name that needs torch says which package to install.
    code = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
import rankwatch
assert "torch" not in sys.modules
print(rankwatch.__version__, callable(rankwatch.sync))
try:
    rankwatch.init
except ModuleNotFoundError as e:
    print("missing", e.name, "|", e)
from rankwatch.doctor import check_torch
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == f"{rankwatch.__version__} True"
    assert second.startswith("missing torch |") and "rankwatch.init needs PyTorch" in second and "pip install torch" in second
