"""The release artifacts install and work as a user on a GPU node would use them.

`cargo xtask dist` puts a wheel, an sdist and the collector binary in `target/dist/`
(`cargo xtask test` passes them as RANKWATCH_DIST, built from the test profile; run directly,
this test builds them with `cargo xtask dist --debug`). Here a fresh virtual environment, whose
PATH has no cargo or rustc, installs the wheel from the file alone (`pip install --no-index`:
no compiler, no network), and:

- `rankwatch --version` (the wheel's console script) and the binary agree with the workspace;
- without torch, `import rankwatch` works and `rankwatch.init` names the missing package, and
  `rankwatch doctor` says which check failed;
- with torch, the repository's 2-rank gloo example (copied out of the checkout, so nothing is
  imported from the source tree) reports to the collector binary from `target/dist/`, every
  rank's rows arrive, and `rankwatch runs list` (handed from the console script to that
  binary) shows the run's agent version.

torch comes from the test venv through a `.pth` line rather than a second install: PyPI's
torch wheels are gigabytes, and a second copy once filled CI's disk. The line is added only
after the torch-free checks, and the test asserts `rankwatch` is imported from the fresh venv.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import tomllib
from conftest import REPO, Collector

TIMEOUT = 300


def dist_dir() -> Path:
    given = os.environ.get("RANKWATCH_DIST")
    if given:
        return Path(given)
    built = REPO / "target" / "dist"
    subprocess.run(["cargo", "run", "-q", "-p", "xtask", "--", "dist", "--debug"], cwd=REPO, check=True, timeout=1800)
    return built


@pytest.fixture(scope="module")
def dist() -> Path:
    return dist_dir()


def clean_env(venv: Path, home: Path) -> dict[str, str]:
    """A node's environment: the venv, the system's directories, and no Rust anywhere."""
    keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TMPDIR", "TZ")}
    return {**keep, "PATH": f"{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "PYTHONNOUSERSITE": "1", "RANKWATCH_SPOOL_DIR": str(home / "spool")}


def test_the_wheel_installs_without_rust_and_a_2_rank_job_reports_to_the_dist_collector(tmp_path: Path, dist: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    version = tomllib.loads((REPO / "Cargo.toml").read_text())["workspace"]["package"]["version"]
    # A release holds one wheel per architecture; this machine installs its own.
    (wheel,) = dist.glob(f"rankwatch-{version}-cp310-abi3-*{platform.machine()}.whl")
    assert (dist / f"rankwatch-{version}.tar.gz").is_file(), "the sdist"
    assert subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=dist).returncode == 0
    collector_bin = dist / "bin" / "rankwatch"

    home = tmp_path / "home"
    home.mkdir()
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=TIMEOUT)
    env = clean_env(venv, home)
    for tool in ("cargo", "rustc", "maturin"):
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is on the clean PATH"
    python = str(venv / "bin" / "python")

    started = time.monotonic()
    install = subprocess.run([python, "-m", "pip", "install", "--no-index", "--disable-pip-version-check", "--quiet", str(wheel)], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    seconds = time.monotonic() - started
    assert install.returncode == 0, install.stderr
    print(f"\npip install {wheel.name}: {seconds:.1f} s")

    def node(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
        if check:
            assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}{done.stderr[-4000:]}"
        return done

    rankwatch_cmd = str(venv / "bin" / "rankwatch")
    assert node(rankwatch_cmd, "--version").stdout.strip() == f"rankwatch {version}"
    assert node(str(collector_bin), "--version").stdout.strip() == f"rankwatch {version}"

    # No torch in this venv yet: the package imports, and what needs torch says so.
    no_torch = node(python, "-c", "import rankwatch, sys; print(rankwatch.__version__, 'torch' in sys.modules)\ntry:\n    rankwatch.init\nexcept ModuleNotFoundError as e:\n    print(e)")
    first, message = no_torch.stdout.splitlines()
    assert first == f"{version} False"
    assert "rankwatch.init needs PyTorch" in message and "pip install torch" in message
    doctor = node(rankwatch_cmd, "doctor", "--json", check=False)
    assert doctor.returncode == 1
    checks = {c["name"]: c for c in json.loads(doctor.stdout)}
    assert checks["torch"]["status"] == "fail" and "not installed" in checks["torch"]["detail"]
    assert checks["rankwatch"]["detail"].startswith(f"{version} ") and str(venv) in checks["rankwatch"]["detail"]

    # torch (and the example's model, rankwatch_testkit) from the test venv; see the docstring.
    site = Path(node(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    (site / "zz_test_torch.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{REPO / 'sdk-python' / 'testkit'}\n")
    where = node(python, "-c", "import rankwatch, torch; print(rankwatch.__file__)").stdout.strip()
    assert where.startswith(str(site)), f"rankwatch imported from {where}, not the installed wheel"

    monkeypatch.setenv("RANKWATCH_BIN", str(collector_bin))
    collector = Collector(tmp_path / "data")
    try:
        doctor = node(rankwatch_cmd, "doctor", "--collector", collector.url, "--json", check=False)
        checks = {c["name"]: c for c in json.loads(doctor.stdout)}
        assert checks["torch"]["status"] == "ok" and checks["collector"]["status"] == "ok", doctor.stdout

        example = tmp_path / "examples" / "train_ddp.py"
        example.parent.mkdir()
        shutil.copy(REPO / "sdk-python" / "examples" / "train_ddp.py", example)
        results = tmp_path / "results"
        results.mkdir()
        steps = 6
        small = ["--layers", "2", "--width", "32", "--seq", "16", "--corpus", "64"]
        node(python, str(example), "--nproc", "2", "--steps", str(steps), "--run", "from-the-wheel", "--collector", collector.url, "--result-dir", str(results), *small)
        for rank in range(2):
            stats = json.loads((results / f"rank-{rank}.json").read_text())["stats"]
            assert stats["dropped_rows"] == 0 and stats["backlog_batches"] == 0, stats
        rows = collector.sql("SELECT rank, count(*) AS n FROM samples WHERE run = 'from-the-wheel' AND metric = 'loss' GROUP BY rank ORDER BY rank")
        assert rows == [{"rank": 0, "n": steps}, {"rank": 1, "n": steps}], rows

        # `runs list` is the binary's: the console script finds it on PATH and hands it over.
        env["PATH"] = f"{env['PATH']}:{collector_bin.parent}"
        listed = node(rankwatch_cmd, "runs", "list", "--url", collector.url).stdout.splitlines()
        (row,) = [line for line in listed if line.startswith("from-the-wheel ")]
        assert row.split()[1] == "2" and row.split()[-1] == version, listed
    finally:
        collector.stop()
