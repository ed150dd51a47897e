"""`cargo xtask demo --steps 320`, the README's main job, run as a user runs it: the collector
answers, the run appears, the scripted alerts fire (rank 1's silent inconsistency, layer 1's
drift toward collapse), and Ctrl-C (SIGINT to the whole foreground process group, as a
terminal sends it) stops everything cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
SILENCE_LIMIT_S = 1200
# The README's main-job command; the test adds only flags that shorten and isolate the story.
README_DEMO = ["cargo", "xtask", "demo"]


def test_demo_tells_its_story_and_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    cmd = [*README_DEMO, "--steps", "320", "--port", "0", "--data-dir", str(tmp_path / "data")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    assert proc.stdout is not None
    lines: list[str] = []
    url = run = None
    answered = False
    # A hang guard, not a speed check: the first run may compile for a long time, but cargo,
    # pip and the story all print as they go. Silence this long means something is stuck.
    last_output = [time.monotonic()]
    stuck = threading.Event()

    def watchdog() -> None:
        while proc.poll() is None:
            if time.monotonic() - last_output[0] > SILENCE_LIMIT_S:
                stuck.set()
                os.killpg(proc.pid, signal.SIGKILL)
                return
            time.sleep(5)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        for line in proc.stdout:
            last_output[0] = time.monotonic()
            lines.append(line.rstrip())
            if m := re.match(r"Dashboard: (http://127\.0\.0\.1:\d+)/runs/(\S+)", line):
                url, run = m.group(1), m.group(2)
                # The collector answers, and serves the dashboard.
                page = requests.get(f"{url}/runs/{run}", timeout=10)
                answered = page.status_code == 200 and "<html" in page.text.lower()
            if line.startswith("Story finished"):
                break
        assert not stuck.is_set(), f"no output for {SILENCE_LIMIT_S} s:\n" + "\n".join(lines[-40:])
        text = "\n".join(lines)
        assert url and run and answered, text[-4000:]
        listed = requests.get(f"{url}/api/v1/runs", timeout=10).json()["runs"]
        assert any(r["run"] == run and r["world_size"] == 4 and r["last_step"] == 319 for r in listed), listed
        # The scripted trouble was caught, by the rules meant for it, where it was put.
        alerts = requests.get(f"{url}/api/v1/alerts", params={"run": run}, timeout=10).json()["alerts"]
        fired = [a for a in alerts if a.get("fired_at_ms") is not None]
        assert any(a["rule"] == "silent_inconsistency" and 1 in a["outlier_ranks"] and a["first_step"] >= 240 for a in fired), text[-4000:]
        assert any(a["rule"] == "rank_collapse" and a["layer"] == 1 and a["first_step"] >= 240 for a in fired), text[-4000:]
        # Told as incidents, not one line per alert: each opening says what to do.
        opened = [line for line in text.splitlines() if line.startswith("  INCIDENT opened")]
        assert opened and len(opened) < len(fired), text[-4000:]
        assert "what to do:" in text and "silent_inconsistency" in text and "rank_collapse" in text, text[-4000:]
        # Both faults start at one step: one incident holds both rules, and the finished run
        # leaves nothing open.
        incidents = requests.get(f"{url}/api/v1/incidents", params={"run": run}, timeout=10).json()["incidents"]
        caused = [i for i in incidents if {"silent_inconsistency", "rank_collapse"} <= set(i["rules"])]
        assert caused and len(incidents) < len(fired), incidents
        assert all(i["state"] == "resolved" for i in incidents), incidents
        assert "INCIDENT" in text, text[-4000:]
        # Ctrl-C.
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        text += "\n" + rest
        assert proc.returncode == 0, text[-4000:]
        assert "demo: stopped cleanly" in text
        # Nothing is left serving.
        try:
            requests.get(f"{url}/healthz", timeout=2)
            still_up = True
        except requests.ConnectionError:
            still_up = False
        assert not still_up
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_demo_attach_watches_a_job_started_without_rankwatch(tmp_path: Path) -> None:
    """`cargo xtask demo --attach`: the training job starts plain; the demo attaches to it by
    pid (ptrace on x86-64, gdb elsewhere) while it runs, says what it found on each rank, and the run's metrics arrive."""
    cmd = [*README_DEMO, "--attach", "--ranks", "2", "--steps", "60", "--step-sleep", "0.2", "--port", "0", "--exit", "--data-dir", str(tmp_path / "data")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=SILENCE_LIMIT_S)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    found = [line for line in text.splitlines() if re.search(r"pid \d+: watching DistributedDataParallel\(GPT2LMHeadModel\).*rank [01]/2", line)]
    assert len(found) == 2, text[-4000:]
    # The demo prints the run's last step as the collector reports it: metrics arrived.
    assert re.search(r"^  step \d+$", text, re.M), text[-4000:]
    assert "Story finished" in text and "demo: stopped cleanly" in text, text[-4000:]


def test_the_readme_quick_start_is_what_ci_and_this_suite_run() -> None:
    """The quick start's two commands, copied literally: CI's `.ci/run` is the second one, and
    the test above runs the first one (with flags that only shorten the story)."""
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1]
    block = re.search(r"```sh\n(.*?)```", quick_start, re.S)
    assert block, "the README's quick start has no sh block"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["cargo xtask demo", "cargo xtask test"], commands
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "exec cargo xtask test", ci
    assert commands[0].split() == README_DEMO
