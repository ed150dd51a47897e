"""The test kit's zygote (`rankwatch_testkit.zygote`) starts the suites' jobs from a process that
has imported torch already. A job started so must see what a fresh `python script.py` gives
it, end as it would, and train the same parameters; where the zygote cannot give the same
start, the job must start fresh."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rankwatch_testkit import zygote

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"

# What a job can observe of its start. `torch` already imported is how the zygote's shows.
PROBE = r"""
import atexit, json, os, sys, threading, time
preloaded = "torch" in sys.modules

def late():
    time.sleep(0.3)
    print("thread joined", flush=True)

threading.Thread(target=late).start()
# What the interpreter records of an uncaught exception before the exit handlers run.
atexit.register(lambda: print("atexit ran", repr(getattr(sys, "last_value", None)), flush=True))
print(json.dumps({
    "argv": sys.argv[1:], "cwd": os.getcwd(), "name": __name__, "path0": sys.path[0],
    "marker": os.environ.get("ZYGOTE_TEST_MARKER"), "stdin": sys.stdin.readline().strip(),
    "preloaded": preloaded,
}), flush=True)
print("to stderr", file=sys.stderr)
code = int(sys.argv[1])
if code == 99:
    raise RuntimeError("the job failed")
sys.exit(code)
"""


def start(argv: list[str], tmp: Path, *, through_zygote: bool, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = zygote.command(argv) if through_zygote else argv
    return subprocess.run(cmd, cwd=tmp, env={**os.environ, "ZYGOTE_TEST_MARKER": "m", **(env or {})}, input="from stdin\n", capture_output=True, text=True, timeout=120)


def observed(done: subprocess.CompletedProcess[str]) -> tuple[int, dict[str, Any], list[str], str]:
    first, *rest = done.stdout.splitlines()
    return done.returncode, json.loads(first), rest, done.stderr


@pytest.mark.parametrize("code", [0, 3, 99])
def test_a_job_through_the_zygote_sees_and_ends_as_a_fresh_one(tmp_path: Path, code: int) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    fresh = observed(start([sys.executable, str(script), str(code)], tmp_path, through_zygote=False))
    forked = observed(start([sys.executable, str(script), str(code)], tmp_path, through_zygote=True))
    assert fresh[1].pop("preloaded") is False
    assert forked[1].pop("preloaded") is True, f"the job did not run in the zygote: {zygote.log_text()}"
    assert forked[0] == fresh[0] == (1 if code == 99 else code)
    assert forked[1] == fresh[1]
    assert forked[1]["argv"] == [str(code)] and forked[1]["stdin"] == "from stdin" and forked[1]["marker"] == "m"
    # Non-daemon threads are joined before atexit handlers run, in both.
    last = "RuntimeError('the job failed')" if code == 99 else "None"
    assert forked[2] == fresh[2] == ["thread joined", f"atexit ran {last}"]
    if code == 99:
        # The traceback names the job's frames, not the zygote's.
        assert "RuntimeError: the job failed" in forked[3] and "zygote.py" not in forked[3] and "runpy" not in forked[3], forked[3]
    else:
        assert forked[3] == fresh[3] == "to stderr\n"


def test_code_and_modules_run_as_main_too(tmp_path: Path) -> None:
    code = "import sys, os; print(__name__, sys.argv, repr(sys.path[0]), 'torch' in sys.modules)"
    done = start([sys.executable, "-c", code, "a"], tmp_path, through_zygote=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["__main__", "['-c',", "'a']", "''", "True"]
    (tmp_path / "probe_module.py").write_text("import sys\nprint(__name__, sys.argv[1:], 'torch' in sys.modules)\n")
    done = start([sys.executable, "-m", "probe_module", "b"], tmp_path, through_zygote=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["__main__", "['b']", "True"]


def test_what_the_zygote_cannot_start_the_same_starts_fresh(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    # What importing torch sets in a process's environment (the inductor's cache folder), passed
    # on by a test process that imported it, is no difference: the zygote's import set the same.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == cache_dir()
    same = observed(start([sys.executable, str(script), "0"], tmp_path, through_zygote=True))
    assert same[0] == 0 and same[1]["preloaded"] is True, zygote.log_text()
    # A variable torch reads later is the job's to read (torch.compile in the test process sets
    # this one).
    later = observed(start([sys.executable, str(script), "0"], tmp_path, through_zygote=True, env={"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}))
    assert later[0] == 0 and later[1]["preloaded"] is True, zygote.log_text()
    # OpenMP reads its thread count when torch loads it, torch's logging its settings when
    # imported: the zygote's are fixed.
    other = "3" if os.environ.get("OMP_NUM_THREADS") != "3" else "2"
    for env in ({"OMP_NUM_THREADS": other}, {"TORCH_LOGS": "+dynamo"}):
        shaped = observed(start([sys.executable, str(script), "0"], tmp_path, through_zygote=True, env=env))
        assert shaped[0] == 0 and shaped[1]["preloaded"] is False, env
    assert "TORCH_LOGS" in zygote.log_text() and "OMP_NUM_THREADS" in zygote.log_text()
    # An interpreter option.
    optioned = observed(start([sys.executable, "-X", "utf8", str(script), "0"], tmp_path, through_zygote=True))
    assert optioned[0] == 0 and optioned[1]["preloaded"] is False
    # Switched off.
    os.environ[zygote.ENV_SWITCH] = "off"
    try:
        assert zygote.command([sys.executable, str(script)]) == [sys.executable, str(script)]
    finally:
        del os.environ[zygote.ENV_SWITCH]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has ended: only its parent's wait is missing.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _started_job(tmp_path: Path, body: str) -> tuple[subprocess.Popen[bytes], int]:
    pid_file = tmp_path / "pid"
    pid_file.unlink(missing_ok=True)
    script = tmp_path / "job.py"
    script.write_text(f"import os, pathlib, signal, sys, time\n{body}\npathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\ntime.sleep(60)\n")
    proc = subprocess.Popen(zygote.command([sys.executable, str(script)]))
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)
    return proc, int(pid_file.read_text())


def test_killing_the_trampoline_kills_the_job_and_a_termination_is_passed_on(tmp_path: Path) -> None:
    proc, pid = _started_job(tmp_path, "")
    assert pid != proc.pid, "the job ran in the trampoline, not the zygote"
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the job outlived its killed trampoline"
        time.sleep(0.05)
    # SIGTERM reaches the job, and the job's end is the trampoline's.
    handled = tmp_path / "handled"
    proc, pid = _started_job(tmp_path, f"signal.signal(signal.SIGTERM, lambda *_: (open({str(handled)!r}, 'w').close(), sys.exit(5)))")
    proc.terminate()
    assert proc.wait(timeout=10) == 5
    assert handled.exists()
    proc, pid = _started_job(tmp_path, "")
    proc.terminate()
    assert proc.wait(timeout=10) == -signal.SIGTERM
    # A job killed by its own pid (the OOM killer, a test's cleanup) ends its trampoline so too.
    proc, pid = _started_job(tmp_path, "")
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=10) == -signal.SIGKILL


def test_a_training_job_through_the_zygote_ends_with_the_same_parameters(tmp_path: Path) -> None:
    """The example job, 2 gloo ranks with every default probe on (spooled offline), started
    fresh and through the zygote: the same final loss on every rank, to the last bit."""
    results = {}
    for way in ("fresh", "zygote"):
        out = tmp_path / way
        out.mkdir()
        argv = [sys.executable, str(EXAMPLE), "--nproc", "2", "--steps", "12", "--mode", "offline", "--spool-dir", str(tmp_path / f"spool-{way}"), "--result-dir", str(out)]
        argv += ["--layers", "2", "--width", "32", "--seq", "16", "--batch", "4", "--vocab", "64", "--corpus", "256"]
        done = subprocess.run(zygote.command(argv) if way == "zygote" else argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        results[way] = [json.loads((out / f"rank-{r}.json").read_text())["final_loss"] for r in range(2)]
    assert results["zygote"] == results["fresh"], results


def test_a_job_started_beside_another_keeps_every_descriptor_it_opens(tmp_path: Path) -> None:
    """The zygote's sockets for the jobs it watches are closed in each child through their own
    objects. Closed by number only, a socket object left in the child closed its number again
    when the garbage collector reached it, by then the job's own socket: a gloo rank's store
    connection failed ("Socket operation on non-socket") and its peers hung."""
    sleeper, _ = _started_job(tmp_path, "")
    try:
        check = "import gc, os, socket\nmine = [socket.socket() for _ in range(16)]\ngc.collect()\nprint(all(s.getsockname() is not None for s in mine), flush=True)\n"
        done = start([sys.executable, "-c", check], tmp_path, through_zygote=True)
        assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    finally:
        sleeper.kill()
        sleeper.wait()
