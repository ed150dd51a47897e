"""`rankwatch doctor`: checks the environment a training job will run in, before it runs.

Each check is one line: `ok`, `warn` (rankwatch works, something is missing or slower), or
`fail` (a part of rankwatch cannot work here). The command exits 1 when any check fails, so a
job script or a cluster prologue can run it first. Checks never import more than they test and
never need the network beyond the collector's `/healthz`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from . import _native
from .offline import collector_url, spool_root

Status = Literal["ok", "warn", "fail"]
CAP_SYS_PTRACE = 19
LOW_DISK_BYTES = 1 << 30


@dataclass
class Check:
    name: str
    status: Status
    detail: str


def check_rankwatch() -> Check:
    where = Path(__file__).resolve().parent
    return Check("rankwatch", "ok", f"{_native.VERSION} (wire protocol {_native.WIRE_PROTOCOL}) at {where}; Python {sys.version.split()[0]} {sys.executable}")


def check_torch() -> list[Check]:
    if importlib.util.find_spec("torch") is None:
        return [Check("torch", "fail", f"not installed for {sys.executable}: rankwatch.init needs it (pip install torch)")]
    import torch

    checks = []
    cuda = torch.version.cuda
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        checks.append(Check("torch", "ok", f"{torch.__version__}, CUDA {cuda}, {torch.cuda.device_count()} GPU(s): {', '.join(names)}"))
        if importlib.util.find_spec("triton") is None:
            checks.append(Check("triton", "warn", "not installed: gradient sketches of CUDA tensors take the slower reference path"))
        else:
            checks.append(Check("triton", "ok", "the fused gradient-sketch kernel is available"))
    elif cuda:
        checks.append(Check("torch", "ok", f"{torch.__version__} built for CUDA {cuda}, but no GPU is visible here: probes run on CPU"))
    else:
        checks.append(Check("torch", "ok", f"{torch.__version__} (CPU build)"))
    import torch.distributed as dist

    if not dist.is_available():
        checks.append(Check("torch.distributed", "warn", "not built into this torch: only single-process runs can be watched"))
    else:
        backends = [b for b, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
        checks.append(Check("torch.distributed", "ok", f"backends: {', '.join(backends) or 'none'}"))
    return checks


def _has_cap_sys_ptrace() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError):
        pass
    return False


def check_attach() -> Check:
    """`rankwatch attach --pid`: a way in (sys.remote_exec, our own ptrace on x86-64, else gdb)
    and ptrace rights."""
    if sys.version_info >= (3, 14) and hasattr(sys, "remote_exec"):
        way = "sys.remote_exec"
    elif sys.platform == "linux" and platform.machine() == "x86_64":
        way = "rankwatch's own ptrace"
    elif shutil.which("gdb"):
        way = "gdb"
    else:
        python = f"Python {sys.version_info[0]}.{sys.version_info[1]}"
        return Check("attach", "warn", f"gdb is not installed and {python} has no sys.remote_exec: `rankwatch attach --pid` cannot inject (apt install gdb); `rankwatch run` works")
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        scope = None  # no Yama: classic ptrace rules (same user)
    cap = _has_cap_sys_ptrace()
    rule = "no Yama restriction" if scope is None else f"kernel.yama.ptrace_scope = {scope}"
    if scope == 3:
        return Check("attach", "warn", f"{rule}: ptrace is disabled on this kernel, `attach --pid` cannot work until reboot; use `rankwatch run`")
    if scope in (None, 0) or cap:
        extra = ", CAP_SYS_PTRACE" if cap else ""
        return Check("attach", "ok", f"through {way}; {rule}{extra}: processes of this user can be attached")
    if scope == 1:
        remedy = "run `attach` as root, grant CAP_SYS_PTRACE (containers: --cap-add SYS_PTRACE), or sysctl kernel.yama.ptrace_scope=0"
        return Check("attach", "warn", f"through {way}, but {rule} lets a process trace only its own descendants: {remedy}")
    return Check("attach", "warn", f"through {way}, but {rule} needs CAP_SYS_PTRACE, which this process lacks (containers: --cap-add SYS_PTRACE)")


def check_collector(url: str, timeout: float = 3.0) -> Check:
    health = url.rstrip("/") + "/healthz"
    try:
        with urllib.request.urlopen(health, timeout=timeout) as answer:
            body = json.loads(answer.read(64 * 1024) or b"{}")
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read(64 * 1024)).get("reason", "")
        except (ValueError, OSError):
            reason = ""
        return Check("collector", "fail", f"{health} answered {e.code} {reason}".strip())
    except (OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return Check("collector", "fail", f"cannot reach {health}: {reason}; runs would spool to disk until it is up (`rankwatch sync` sends them)")
    theirs = body.get("wire_protocol")
    version = body.get("version") or "of unknown version"
    if theirs is not None and theirs != _native.WIRE_PROTOCOL:
        ours = f"this agent (rankwatch {_native.VERSION}) speaks {_native.WIRE_PROTOCOL}"
        return Check("collector", "fail", f"{url} is rankwatch {version} speaking wire protocol {theirs}; {ours}: it would refuse every batch")
    same = "" if version == _native.VERSION else f" (this agent is {_native.VERSION}; the wire protocol is the same)"
    return Check("collector", "ok", f"{url} is up: rankwatch {version}{same}")


def check_spool(directory: Path) -> Check:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".doctor-") as f:
            f.write(b"rankwatch")
            f.flush()
            os.fsync(f.fileno())
        free = shutil.disk_usage(directory).free
    except OSError as e:
        return Check("spool", "fail", f"{directory} is not writable ({e.strerror or e}): set RANKWATCH_SPOOL_DIR (or spool_dir=) to a writable directory")
    gib = free / (1 << 30)
    if free < LOW_DISK_BYTES:
        return Check("spool", "warn", f"{directory} is writable but only {gib:.2f} GiB are free")
    return Check("spool", "ok", f"{directory} is writable, {gib:.1f} GiB free")


def run_checks(collector: str | None = None, spool_dir: str | None = None) -> list[Check]:
    return [check_rankwatch(), *check_torch(), check_attach(), check_collector(collector_url(collector)), check_spool(spool_root(spool_dir))]


def main(collector: str | None = None, spool_dir: str | None = None, *, as_json: bool = False) -> int:
    checks = run_checks(collector, spool_dir)
    if as_json:
        print(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        failed = [c.name for c in checks if c.status == "fail"]
        print(f"\n{len(checks)} checks, {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if any(c.status == "fail" for c in checks) else 0
