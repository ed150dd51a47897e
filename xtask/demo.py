"""The one-command demo (`cargo xtask demo`): a collector with its dashboard, a real multi-rank
DDP training job on CPU streaming to it, and scripted trouble, told as it happens.

`cargo xtask demo` installs what is needed (the venv with PyTorch, the SDK's native module, the
dashboard, the collector binary) and then runs this script. It:

1. starts `rankwatch serve` on its embedded default (127.0.0.1:7070, data in
   `target/demo/data`), and waits until it is ready;
2. launches `sdk-python/examples/train_ddp.py` with `--ranks` gloo processes, with two faults
   at 40 % of the run: rank 1's local gradient silently scaled ×8 before the all-reduce (a
   desynchronised worker: silent inconsistency) and layer 1 pushed toward attention-dominated
   collapse (the MLP/attention spectral ratio falls);
3. prints the dashboard's address and each incident as it opens (one line for all of its
   alerts, with what to do), grows a new kind of symptom, and resolves;
4. when training ends, prints what was caught and keeps the dashboard up until Ctrl-C
   (`--exit` stops there instead).

Ctrl-C at any point stops the training job, then the collector (which flushes to Parquet), and
exits 0. The collector and the job run in their own process groups, so the terminal's Ctrl-C
reaches only this script, which stops them in that order. Their output goes to
`target/demo/collector.log` and `target/demo/train.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "sdk-python" / "examples" / "train_ddp.py"
PLAIN = ROOT / "sdk-python" / "examples" / "train_plain.py"  # knows nothing of rankwatch (--attach)
# The model and cadences the detection tests prove the faults on (sdk-python/tests/test_detection.py).
MODEL = ["--layers", "2", "--width", "32", "--seq", "32", "--batch", "4", "--vocab", "64", "--corpus", "1024", "--lr", "3e-3"]
CADENCE = ["--cadence", "spectral=5", "--cadence", "activations=5"]


class Stop(Exception):
    """Ctrl-C or SIGTERM reached the demo."""


def _stop(signum: int, _frame: object) -> None:
    raise Stop(signal.Signals(signum).name)


def say(text: str = "") -> None:
    print(text, flush=True)


def get_json(url: str, timeout: float = 5.0) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as answer:
        return json.load(answer)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_collector(binary: Path, port: int, data: Path, log: Path) -> subprocess.Popen[bytes]:
    data.mkdir(parents=True, exist_ok=True)
    out = log.open("ab")
    return subprocess.Popen(
        [str(binary), "serve", "--data-dir", str(data), "--listen", f"127.0.0.1:{port}", "--flush-interval", "2s"],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_ready(url: str, collector: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if collector.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise SystemExit(f"demo: the collector exited with status {collector.returncode}:\n{tail}")
        try:
            urllib.request.urlopen(f"{url}/readyz", timeout=1).close()
            return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)
    raise SystemExit(f"demo: the collector did not become ready within 60 s (see {log})")


def faults(steps: int, ranks: int) -> list[str]:
    # After silent_inconsistency's 200 skipped steps and 30-step warm-up (docs/detection.md).
    at = max(240, int(steps * 0.6))
    out = [f"collapse@{at}:layer=1"]
    if ranks >= 2:
        out.insert(0, f"grad_scale@{at}:rank=1:factor=8")
    return out


class IncidentFollower:
    """Prints each incident of the run as it opens (one line for all of its alerts, with what
    to do), when it grows a new kind of symptom or absorbs another, and when it resolves — what
    the collector's webhooks and Slack receivers are told."""

    def __init__(self, url: str, run: str) -> None:
        self.url = f"{url}/api/v1/incidents?run={urllib.request.quote(run, safe='')}"
        self.told: dict[str, dict] = {}
        self.opened = 0

    def poll(self) -> None:
        try:
            answer = get_json(self.url, timeout=2)
        except (urllib.error.URLError, OSError, ValueError):
            return  # the collector is busy or restarting; the next poll catches up
        incidents = sorted(answer.get("incidents", []), key=lambda i: (i["first_step"], i["id"]))  # type: ignore[union-attr]
        for i in incidents:
            members = {a["id"] for a in i["alerts"]}
            merged = [t for t in self.told if t != i["id"] and members & {a["id"] for a in self.told[t]["alerts"]}]
            prior = self.told.get(i["id"]) or (self.told[merged[0]] if merged else None)
            if i["state"] == "firing" and prior is None:
                self.opened += 1
                say(f"  INCIDENT opened  {i['severity']} from step {i['first_step']}: {i['summary']}")
                say(f"      what to do: {i['action']}")
            elif i["state"] == "firing" and prior is not None:
                new_rules = [r for r in i["rules"] if r not in prior["rules"]]
                if new_rules or merged:
                    more = f"now also {', '.join(new_rules)}" if new_rules else f"merged with {', '.join(merged)}"
                    say(f"  INCIDENT updated from step {i['first_step']}: {more} — {i['summary']}")
            elif i["state"] == "resolved" and prior is not None:
                say(f"  INCIDENT resolved from step {i['first_step']} (through step {i['last_step']}): {', '.join(i['rules'])}")
            for t in merged:
                del self.told[t]
            if i["state"] == "firing":
                self.told[i["id"]] = i
            else:
                self.told.pop(i["id"], None)


def fired_alerts(url: str, run: str) -> list[dict]:
    """The run's alerts that fired (pending ones that cleared are not counted)."""
    try:
        answer = get_json(f"{url}/api/v1/alerts?run={urllib.request.quote(run, safe='')}")
    except (urllib.error.URLError, OSError, ValueError):
        return []
    return [a for a in answer.get("alerts", []) if a.get("fired_at_ms") is not None]  # type: ignore[union-attr]


def show_incidents(url: str, run: str) -> None:
    """The run's incidents at the end, as the Alerts page lists them: one line each, cause first."""
    try:
        answer = get_json(f"{url}/api/v1/incidents?run={urllib.request.quote(run, safe='')}")
    except (urllib.error.URLError, OSError, ValueError):
        return
    incidents = answer.get("incidents", [])  # type: ignore[union-attr]
    if incidents:
        say(f"The run's {len(incidents)} incident(s) (the Alerts page shows the same):")
    for i in incidents:
        say(f"  INCIDENT  {i['severity']} {i['state']} from step {i['first_step']}: {i['summary']}")


def last_step(url: str, run: str) -> int | None:
    """The run's last step any rank reported (the runs listing)."""
    try:
        runs = get_json(f"{url}/api/v1/runs")
    except (urllib.error.URLError, OSError, ValueError):
        return None
    for r in runs.get("runs", []):  # type: ignore[union-attr]
        if r.get("run") == run:
            return r.get("last_step")
    return None


def last_aligned_step(url: str, run: str) -> int | None:
    """The last step the step aligner closed (its cross-rank statistics exist): alerts up to
    there have been evaluated."""
    query = f"SELECT max(step) AS s FROM samples WHERE run = '{run}' AND rank IS NULL AND metric = 'loss_std'"
    request = urllib.request.Request(f"{url}/api/v1/sql", data=json.dumps({"sql": query}).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            rows = json.load(answer)["rows"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return None
    return rows[0]["s"] if rows else None


def attach_by_pid(training: subprocess.Popen[bytes], url: str, run: str, log: Path) -> None:
    """Waits for the plain job's first steps, then attaches to torchrun's pid as a user would."""
    deadline = time.monotonic() + 300
    while b"step 3 " not in (log.read_bytes() if log.exists() else b""):
        if training.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"demo: the plain training job did not get going; see {log}")
        time.sleep(0.5)
    command = [sys.executable, "-m", "rankwatch", "attach", "--pid", str(training.pid), "--run", run, "--collector", url,
               "--every", ",".join(CADENCE[1::2])]
    say(f"Training started without rankwatch (torchrun pid {training.pid}); attaching: rankwatch attach --pid {training.pid} --run {run}")
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    for line in (done.stdout + done.stderr).splitlines():
        say(f"  {line}")
    if done.returncode != 0:
        raise SystemExit(f"demo: attaching failed (status {done.returncode})")


def stop_process(proc: subprocess.Popen[bytes], name: str, first: signal.Signals, grace: float) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, first)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        say(f"demo: {name} did not stop within {grace:.0f} s; killing it")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cargo xtask demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", type=Path, default=ROOT / "target" / "debug" / "rankwatch", help="the collector binary")
    p.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    p.add_argument("--ranks", type=int, default=4, help="data-parallel processes (default 4)")
    p.add_argument("--no-faults", action="store_true", help="a healthy run: no scripted trouble")
    p.add_argument("--port", type=int, default=7070, help="the collector's port (default 7070; 0 picks a free one)")
    p.add_argument("--data-dir", type=Path, default=ROOT / "target" / "demo" / "data", help="the collector's data directory")
    p.add_argument("--step-sleep", type=float, default=0.2, help="seconds between steps, so the story can be watched live")
    p.add_argument("--exit", action="store_true", help="exit when the story ends instead of keeping the dashboard up")
    p.add_argument("--attach", action="store_true", help="start a training job that never imports rankwatch, then attach to it by pid (ptrace on x86-64, gdb elsewhere)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.ranks < 1:
        p.error("--steps and --ranks must be at least 1")
    if not args.bin.exists():
        p.error(f"no collector binary at {args.bin} (cargo xtask demo builds it)")
    port = args.port or free_port()
    if not port_free(port):
        p.error(f"port {port} is taken (another collector?); pass --port 0 for a free one")

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    logs = args.data_dir.parent
    logs.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{port}"
    run = time.strftime("demo-%Y%m%d-%H%M%S")
    # The scripted faults live in rankwatch's own example; a plain job has none.
    scripted = [] if args.no_faults or args.attach else faults(args.steps, args.ranks)
    collector = training = None
    code = 0
    try:
        collector = start_collector(args.bin, port, args.data_dir, logs / "collector.log")
        wait_ready(url, collector, logs / "collector.log")
        say(f"rankwatch collector ready at {url} (data in {args.data_dir})")
        say(f"Dashboard: {url}/runs/{run}")
        say(f"Training {run}: {args.ranks} ranks × {args.steps} steps, a small GPT on CPU (gloo DDP)")
        for f in scripted:
            say(f"  scripted trouble: {f}")
        cmd = [sys.executable, str(EXAMPLE), "--nproc", str(args.ranks), "--steps", str(args.steps), "--run", run, "--collector", url,
               "--spool-dir", str(logs / "spool"), "--step-sleep", str(args.step_sleep), *MODEL, *CADENCE]
        if args.attach:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks), "--master_port", str(free_port()),
                   str(PLAIN), "--steps", str(args.steps), "--step-delay", str(args.step_sleep)]
        for f in scripted:
            cmd += ["--fault", f]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TORCHELASTIC_RUN_ID": "none"}
        with (logs / "train.log").open("wb") as train_log:
            training = subprocess.Popen(cmd, stdout=train_log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if args.attach:
            attach_by_pid(training, url, run, logs / "train.log")
        follower = IncidentFollower(url, run)
        shown = -1
        started = time.monotonic()
        while training.poll() is None:
            follower.poll()
            step = last_step(url, run)
            if step is not None and step // 50 > shown // 50:
                shown = step
                say(f"  step {step}")
            time.sleep(0.5)
            if collector.poll() is not None:
                raise SystemExit(f"demo: the collector exited with status {collector.returncode}; see {logs / 'collector.log'}")
        if training.returncode != 0:
            tail = (logs / "train.log").read_text(errors="replace")[-3000:]
            say(f"demo: training exited with status {training.returncode}:\n{tail}")
            code = 1
        # The step aligner closes the last steps after its timeout; then every alert is known.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (last_aligned_step(url, run) or -1) < args.steps - 1:
            follower.poll()
            time.sleep(0.5)
        follower.poll()
        fired = fired_alerts(url, run)
        rules = sorted({a["rule"] for a in fired})
        say(f"Training finished in {time.monotonic() - started:.0f} s. Alerts fired: {len(fired)} ({', '.join(rules) or 'none'}), told as {follower.opened} incident(s).")
        show_incidents(url, run)
        say(f"Story finished. The dashboard stays up at {url}/runs/{run}" + ("" if args.exit else " — Ctrl-C to stop."))
        if not args.exit:
            while collector.poll() is None:
                follower.poll()
                time.sleep(1)
            say(f"demo: the collector exited with status {collector.returncode}")
            code = 1
    except Stop as why:
        say(f"\ndemo: {why}; stopping")
    finally:
        # A second Ctrl-C must not interrupt the orderly stop below.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if training is not None:
            stop_process(training, "training", signal.SIGINT, 15)
        if collector is not None:
            stop_process(collector, "collector", signal.SIGTERM, 30)
            if collector.returncode not in (0, None) and code == 0 and collector.returncode != -signal.SIGKILL:
                say(f"demo: the collector stopped with status {collector.returncode}")
    say("demo: stopped cleanly" if code == 0 else "demo: stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
