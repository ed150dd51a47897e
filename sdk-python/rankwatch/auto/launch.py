"""`rankwatch run [options] -- COMMAND`: COMMAND runs with the agent in every Python process.

The environment carries everything: this package's `boot/` directory first on PYTHONPATH (its
`sitecustomize` starts the agent once torch is imported), RANKWATCH_AUTO=1, and the run's
settings as the RANKWATCH_* variables `rankwatch.init` reads (and `--mapping` as
RANKWATCH_MAPPING, which the agent hands to `watch`). torchrun, `accelerate launch`,
srun and mpirun pass the environment on to the ranks they start, so one command covers them
all. The run name is chosen here, once, so that every rank of every node launched with the
same `--run` reports into the same run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ..cadence import PROBES

BOOT = Path(__file__).resolve().parent / "boot"
SDK = Path(__file__).resolve().parent.parent.parent  # the directory holding `rankwatch/`


def parse_every(text: str) -> int | dict[str, int]:
    """`50` or `grad=1,spectral=100`, as `rankwatch.init(every=)` takes it."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in PROBES or not value.strip().isdigit():
            raise ValueError(f"--every takes a number of steps or probe=steps pairs (probes: {', '.join(PROBES)}), got {part!r}")
        out[name.strip()] = int(value)
    if not out:
        raise ValueError("--every is empty")
    return out


def resolve_mapping(given: str | None, run: str | None, collector: str | None) -> dict[str, Any] | None:
    """`--mapping` parsed (ValueError naming what is wrong), else the one kept at the collector
    for `run` by an earlier watch of it, else None."""
    from ..mapping import parse, stored
    from ..offline import collector_url

    if given:
        return parse(given)
    if not run:
        return None
    found = stored(collector_url(collector), run, os.environ.get("RANKWATCH_INGEST_TOKEN"))
    if found is not None:
        print(f"rankwatch: using the mapping kept at the collector for run {run!r}", file=sys.stderr)
    return found


def default_run_name(command: list[str]) -> str:
    """`<script>-<date>-<time>`: the first argument that looks like a script or a module."""
    stem = "run"
    for arg in command:
        if arg.endswith(".py"):
            stem = Path(arg).stem
            break
    stem = re.sub(r"[^A-Za-z0-9_.-]", "-", stem) or "run"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def environment(
    command: list[str],
    *,
    run: str | None,
    collector: str | None,
    every: Any,
    dormant: bool,
    mode: str | None,
    mapping: dict[str, Any] | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    paths = [str(BOOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["RANKWATCH_AUTO"] = "1"
    env["RANKWATCH_SDK_PATH"] = str(SDK)
    env["RANKWATCH_RUN"] = run or env.get("RANKWATCH_RUN") or default_run_name(command)
    if collector:
        env["RANKWATCH_COLLECTOR"] = collector
    if mode:
        env["RANKWATCH_MODE"] = mode
    if every is not None:
        env["RANKWATCH_EVERY"] = json.dumps(every)
    env["RANKWATCH_DORMANT"] = "1" if dormant else "0"
    if mapping is not None:
        env["RANKWATCH_MAPPING"] = json.dumps(mapping)
    return env


def main(args: Any) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("rankwatch run: give the command to run after --, e.g. rankwatch run -- torchrun --nproc_per_node 2 train.py", file=sys.stderr)
        return 2
    try:
        every = parse_every(args.every) if args.every else None
    except ValueError as e:
        print(f"rankwatch run: {e}", file=sys.stderr)
        return 2
    if args.collector and not args.collector.startswith("http://"):
        print(f"rankwatch run: --collector must be an http:// URL, got {args.collector!r}", file=sys.stderr)
        return 2
    program = shutil.which(command[0])
    if program is None:
        print(f"rankwatch run: {command[0]!r} is not a command on PATH", file=sys.stderr)
        return 127
    try:
        mapping = resolve_mapping(args.mapping, args.run, args.collector)
    except ValueError as e:
        print(f"rankwatch run: {e}", file=sys.stderr)
        return 2
    env = environment(command, run=args.run, collector=args.collector, every=every, dormant=args.dormant, mode=args.mode, mapping=mapping)
    state = "dormant: `rankwatch attach " + env["RANKWATCH_RUN"] + "` turns the probes on" if args.dormant else "watching"
    print(f"rankwatch: run {env['RANKWATCH_RUN']!r} ({state})", file=sys.stderr)
    sys.stderr.flush()
    os.execve(program, command, env)
    return 0  # not reached
