"""`rankwatch attach --pid PID` / `rankwatch detach --pid PID`: the agent into a running job.

Nothing is prepared in the job. From PID (a rank, or a launcher such as torchrun's agent or
`accelerate launch`) the training ranks on this node are found in /proc: the processes at or
below PID that carry a RANK/LOCAL_RANK variable and whose parent does not (data-loader
workers inherit their rank's variables and are left alone), or PID itself when nothing below
it is a rank. Each gets a small payload file run in its main thread at a safe point:

- Python >= 3.14 (when this interpreter has it too): `sys.remote_exec(pid, payload)`;
- older Pythons on x86-64, with ptrace alone (`ptrace.py`): the main thread is stopped, one
  page is mapped in it with `mmap` (a plain system call, safe wherever the thread was stopped,
  unlike `malloc`, whose lock it may hold), the code is written there, `PyRun_SimpleString(page)`
  is queued with `Py_AddPendingCall`, and every register is put back, the whole extended state
  included (gdb 13 cannot write that back on a CPU with AMX: see `ptrace.py`);
- older Pythons elsewhere (aarch64), as memray and pyrasite do, through gdb, with the same three
  steps (gdb's `restore` writes the code).

The interpreter runs pending calls in its main thread between two bytecodes, holding the GIL.
The queued code catches everything: a pending call that failed would raise into the training
loop. (memray instead waits at a `malloc` breakpoint; a rank blocked in C never reaches one, and
a breakpoint left behind by a debugger that had to be killed would crash the job.)

The payload starts the same agent `rankwatch run` installs (`rankwatch.auto.agent`), and every
rank reports what it found in a status directory that this command reads back. Its request
waits for a `go` file that this command writes there once the last rank is injected (gdb may
take seconds per process on a busy node, ptrace a tenth of one, while the ranks injected first
go on training); from
then on every rank reads it at its next step end, within a step of the others, and the ranks
switch together at a step a few steps on (`agreement.py`). A rank stuck in a collective or in native code
runs no Python, so its payload waits: after `--timeout` this says so instead of hanging.
Permissions: attaching needs ptrace rights on the target (same user, and either
`kernel.yama.ptrace_scope` = 0 or CAP_SYS_PTRACE); Python >= 3.14 honours
PYTHON_DISABLE_REMOTE_DEBUG and `-X disable-remote-debug` in the target.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .launch import SDK, parse_every, resolve_mapping

GDB_TIMEOUT_S = 60.0


class AttachError(RuntimeError):
    """Attaching to a process failed; the message says why and what to do."""


# -- finding the ranks ----------------------------------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _is_python(pid: int) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return False
    return "python" in os.path.basename(exe)


def _is_rank(env: dict[str, str]) -> bool:
    return "RANK" in env or "LOCAL_RANK" in env


def training_ranks(pid: int) -> list[int]:
    """The training processes at or below `pid` on this node."""
    if not Path(f"/proc/{pid}").exists():
        raise AttachError(f"there is no process {pid}")
    tree = _children()
    found: list[int] = []
    stack = [(pid, False)]
    while stack:
        p, parent_is_rank = stack.pop()
        env = _environ(p)
        rank = _is_rank(env) and _is_python(p)
        if rank and not parent_is_rank:
            found.append(p)
        stack.extend((c, rank or parent_is_rank) for c in tree.get(p, []))
    if not found:
        if not _is_python(pid):
            raise AttachError(f"process {pid} is not a Python process and has no training rank (RANK/LOCAL_RANK) below it")
        found = [pid]
    return sorted(found)


# -- injecting ------------------------------------------------------------------------------


def _python_version(pid: int) -> tuple[int, int] | None:
    """The target's Python version, from the libpython or executable it maps."""
    import re

    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    match = re.search(r"libpython(\d)\.(\d+)", maps) or re.search(r"/python(\d)\.(\d+)\b", maps)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _payload(directory: Path, config: dict[str, Any]) -> Path:
    """The file each target runs: loads rankwatch (from this SDK if the target's environment
    lacks it) and hands `config` to the agent; any failure is written to the status dir."""
    path = directory / "payload.py"
    path.write_text(
        f"""# rankwatch attach payload (run in the target's main thread)
import json, os, sys
_config = json.loads({json.dumps(json.dumps(config))})
try:
    try:
        import rankwatch.auto.agent
    except ImportError:
        sys.path.append({str(SDK)!r})
        import rankwatch.auto.agent
    rankwatch.auto.agent.remote(_config)
except BaseException as _e:
    _status = os.path.join(_config["status_dir"], f"{{os.getpid()}}.json")
    with open(_status + ".part", "w") as _f:
        json.dump({{"pid": os.getpid(), "event": "failed", "error": f"{{type(_e).__name__}}: {{_e}}"}}, _f)
    os.replace(_status + ".part", _status)
"""
    )
    os.chmod(directory, 0o755)
    path.chmod(0o644)
    return path


def _scheduled_code(payload: Path) -> bytes:
    """What `PyRun_SimpleString` runs in the target: the payload, swallowing everything (see the
    module doc), NUL-terminated."""
    code = f"try:\n exec(compile(open({str(payload)!r}).read(), {str(payload)!r}, 'exec'), {{'__name__': '__rankwatch__'}})\nexcept BaseException:\n pass\n"
    return code.encode() + b"\0"


def _gdb_script(payload: Path, code_file: Path) -> list[str]:
    """gdb commands: map a page, copy the code into it, schedule it. Nothing here allocates
    with malloc in the target or waits for the target to do anything: `mmap` is a plain system
    call, `restore` writes memory through ptrace, and `Py_AddPendingCall` only queues."""
    code = _scheduled_code(payload)
    code_file.write_bytes(code)
    size = (len(code) + 4095) // 4096 * 4096
    return [
        "set confirm off",
        "set pagination off",
        "set unwindonsignal on",
        "sharedlibrary libc",
        "sharedlibrary libpython",
        "echo RANKWATCH: attached\\n",
        "print (void*)Py_AddPendingCall",
        "print (void*)PyRun_SimpleString",
        "echo RANKWATCH: python found\\n",
        # Only the stopped thread runs the calls below (as memray's attach does): with every
        # thread resumed for them, a busy job's other threads (gloo, autograd, a rank's
        # training loop) could take a signal mid-call and gdb abandons the call (seen once on
        # a loaded machine: "signaled while in a function called from GDB").
        "set scheduler-locking on",
        # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS; kept for the life of the process.
        f"set $rankwatch_code = (char*)mmap(0, {size}, 3, 0x22, -1, 0)",
        f"restore {code_file} binary $rankwatch_code",
        "echo RANKWATCH: scheduling\\n",
        "print (int)Py_AddPendingCall((int(*)(void*))PyRun_SimpleString, (void*)$rankwatch_code)",
        "detach",
    ]


def _inject_gdb(pid: int, payload: Path) -> None:
    gdb = shutil.which("gdb")
    if gdb is None:
        raise AttachError("gdb is not installed (apt install gdb); it is how rankwatch attaches to Python < 3.14")
    with tempfile.NamedTemporaryFile("w", suffix=".gdb", delete=False) as f:
        f.write("\n".join(_gdb_script(payload, payload.with_name(f"code-{pid}.bin"))) + "\n")
        script = f.name
    try:
        result = subprocess.run(
            [gdb, "-batch", "-nx", "-nw", "-p", str(pid), "-iex", "set auto-solib-add off", "-x", script],
            capture_output=True,
            text=True,
            timeout=GDB_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise AttachError(f"gdb did not finish attaching to {pid} within {GDB_TIMEOUT_S:.0f} s") from e
    finally:
        os.unlink(script)
    output = result.stdout + result.stderr
    if "RANKWATCH: attached" not in output:
        if "ptrace" in output or "Operation not permitted" in output:
            raise AttachError(
                f"not permitted to trace process {pid}: attaching needs the same user and ptrace rights "
                "(kernel.yama.ptrace_scope = 0, or CAP_SYS_PTRACE; in a container: --cap-add SYS_PTRACE)"
            )
        raise AttachError(f"gdb could not attach to {pid}: {output.strip()[-400:]}")
    if "RANKWATCH: python found" not in output:
        raise AttachError(f"process {pid} has no CPython runtime gdb can call (Py_AddPendingCall not found)")
    import re

    if not re.search(r"RANKWATCH: scheduling\n\$\d+ = 0\n", output):
        raise AttachError(f"scheduling the agent in {pid} failed: {output.strip()[-400:]}")


def _inject_ptrace(pid: int, payload: Path) -> None:
    from . import ptrace

    try:
        ptrace.queue_code(pid, _scheduled_code(payload))
    except ptrace.NotPermitted as e:
        raise AttachError(
            f"not permitted to trace process {pid} ({e}): attaching needs the same user and ptrace rights "
            "(kernel.yama.ptrace_scope = 0, or CAP_SYS_PTRACE; in a container: --cap-add SYS_PTRACE), and no other debugger attached"
        ) from e
    except (ptrace.InjectError, OSError) as e:  # OSError: the process went away mid-way
        raise AttachError(f"scheduling the agent in {pid} failed: {e}") from e


def _inject(pid: int, payload: Path) -> str:
    version = _python_version(pid)
    if version is not None and version >= (3, 14):
        remote_exec = getattr(sys, "remote_exec", None)
        if remote_exec is None:
            raise AttachError(f"process {pid} runs Python {version[0]}.{version[1]}; attach with a Python >= 3.14 (sys.remote_exec) or gdb")
        try:
            remote_exec(pid, str(payload))
        except (OSError, RuntimeError, ValueError) as e:
            raise AttachError(f"sys.remote_exec into {pid} failed: {e}") from e
        return "sys.remote_exec"
    if sys.platform == "linux" and platform.machine() == "x86_64":
        _inject_ptrace(pid, payload)
        return "ptrace"
    _inject_gdb(pid, payload)
    return "gdb"


def attach(pid: int, config: dict[str, Any], timeout: float, progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """Injects `config` (action, settings) into every rank at or below `pid`; returns what each
    reported (or a dict with `error`), waiting up to `timeout` seconds for the wanted event.
    `progress` hears a line per rank as its injection ends (gdb can take seconds each)."""
    ranks = training_ranks(pid)
    status = Path(tempfile.mkdtemp(prefix="rankwatch-attach-"))
    config = {**config, "status_dir": str(status)}
    payload = _payload(status, config)
    wanted = {"attach": "watching", "detach": "detached"}[config["action"]]
    results: dict[int, dict[str, Any]] = {}
    methods: dict[int, str] = {}
    for rank_pid in ranks:
        try:
            methods[rank_pid] = _inject(rank_pid, payload)
            progress(f"pid {rank_pid}: injected (via {methods[rank_pid]})")
        except AttachError as e:
            results[rank_pid] = {"pid": rank_pid, "event": "failed", "error": str(e)}
    # Every rank is injected (or failed): the requests may go (each rank has read it by its next
    # step end, so the ranks hear of it within a step of one another).
    (status / "go").write_text("")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p not in results for p in ranks):
        for p in ranks:
            if p in results:
                continue
            try:
                info = json.loads((status / f"{p}.json").read_text())
            except (OSError, ValueError):
                continue
            if info.get("event") in (wanted, "failed", "not-watching"):
                results[p] = {**info, "method": methods.get(p)}
        time.sleep(0.1)
    for p in ranks:
        if p not in results:
            try:
                last = json.loads((status / f"{p}.json").read_text()).get("event")
            except (OSError, ValueError):
                last = None
            why = (
                "the payload ran but no optimizer step ended since (is the job paused, or between epochs?)"
                if last
                else "its main thread has run no Python since (stuck in a collective, in native code, or sleeping in C?)"
            )
            results[p] = {"pid": p, "event": "timeout", "method": methods.get(p), "error": f"no answer within {timeout:.0f} s: {why}"}
    shutil.rmtree(status, ignore_errors=True)
    return [results[p] for p in ranks]


def main(args: Any, action: str) -> int:
    settings: dict[str, Any] = {"run": args.run, "collector": args.collector, "mode": args.mode}
    if getattr(args, "every", None):
        try:
            settings["every"] = parse_every(args.every)
        except ValueError as e:
            print(f"rankwatch {action}: {e}", file=sys.stderr)
            return 2
    if action == "attach":
        try:
            settings["mapping"] = resolve_mapping(args.mapping, args.run, args.collector)
        except ValueError as e:
            print(f"rankwatch {action}: {e}", file=sys.stderr)
            return 2
        if not settings["run"]:
            settings["run"] = f"attach-{args.pid}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        results = attach(args.pid, {"action": action, "settings": settings}, args.timeout, lambda line: print(line, file=sys.stderr, flush=True))
    except AttachError as e:
        print(f"rankwatch {action}: {e}", file=sys.stderr)
        return 1
    failed = 0
    for r in results:
        if r.get("event") in ("watching", "detached"):
            model = f" {r['model']}," if r.get("model") else ""
            rank = f"rank {r['rank']}/{r['world_size']}" if r.get("rank") is not None else "rank ?"
            when = f"from step {r['step'] + 1}" if r["event"] == "watching" else f"after step {r.get('step')}"
            print(f"pid {r['pid']}: {r['event']}{model} {rank}, run {r.get('run')!r}, {when} (via {r.get('method')})")
        else:
            failed += 1
            print(f"pid {r['pid']}: {r.get('event')}: {r.get('error')}", file=sys.stderr)
    return 1 if failed else 0
