"""The `rankwatch` command on a training node (the wheel's console script, and `python -m rankwatch`).

    rankwatch run [--run NAME] [--collector URL] [--every N|probe=N,...] [--mapping JSON|FILE] [--dormant] -- COMMAND...
    rankwatch attach --pid PID [--run NAME] [--collector URL] [--every ...] [--mapping JSON|FILE]
    rankwatch detach --pid PID
    rankwatch sync SPOOL_DIR [--collector URL]
    rankwatch doctor [--collector URL] [--spool-dir DIR] [--json]
    rankwatch --version

Two programs answer to `rankwatch`: this one, installed with the Python package where the job
runs, and the collector binary (`serve`, `runs`, `export`, `rules`, `attach RUN`, `detach
RUN`). A user need not know which is on PATH first: each hands the other's commands over. This
one runs the collector binary named by `RANKWATCH_BIN`, else the first `rankwatch` on PATH that
is a native executable (not a script such as this one), and says how to get it when there is
none; the binary hands this module's commands to `python -m rankwatch`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ._native import VERSION
from .offline import DEFAULT_COLLECTOR

# What this program does itself; anything else is the collector binary's.
OWN_COMMANDS = ("run", "attach", "detach", "sync", "doctor")
COLLECTOR_HELP = f"the collector's URL (default: RANKWATCH_COLLECTOR, else {DEFAULT_COLLECTOR})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rankwatch",
        description="Watch a PyTorch training job without changing its code. The collector's commands (serve, runs, export, rules, attach RUN, detach RUN) run the collector binary.",
    )
    p.add_argument("--version", action="version", version=f"rankwatch {VERSION}")
    sub = p.add_subparsers(dest="action", required=True)

    def settings(q: argparse.ArgumentParser) -> None:
        q.add_argument("--run", help="the run's name (default: made from the script's name and the time)")
        q.add_argument("--collector", help=COLLECTOR_HELP)
        q.add_argument("--mode", choices=["online", "offline"], help="stream to the collector (default) or only spool to disk")
        q.add_argument("--every", help="steps between measurements: N for every costly probe, or probe=N pairs (grad, sketch, dot, activations, spectral, fingerprint)")
        q.add_argument(
            "--mapping",
            help="the model's layout where discovery cannot read it: JSON ({\"blocks\": \"path.to.blocks\", \"q\": \"attn.q\", ...}) or a JSON file; "
            "kept with the run at the collector, so a later attach to the same --run reuses it",
        )

    run = sub.add_parser("run", help="run COMMAND with the agent in every Python process it starts")
    settings(run)
    run.add_argument("--dormant", action="store_true", help="start with every probe off; `rankwatch attach RUN` turns them on")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- torchrun --nproc_per_node 2 train.py")

    for name, text in (("attach", "inject the agent into the training ranks at or below PID"), ("detach", "remove the agent's hooks from the ranks at or below PID")):
        q = sub.add_parser(name, help=f"{text} (`{name} RUN` without --pid is the collector's)")
        q.add_argument("--pid", type=int, required=True, help="a training rank, or a launcher (torchrun, accelerate launch) above the ranks")
        q.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every rank to answer (default 60)")
        if name == "attach":
            settings(q)
        else:
            q.set_defaults(run=None, collector=None, mode=None, every=None, mapping=None)

    sync = sub.add_parser("sync", help="send what an offline run (or one that lost its collector) left in its spool")
    sync.add_argument("spool_dir", help="a run's spool directory (its rank-* directories), or one rank's")
    sync.add_argument("--collector", help=COLLECTOR_HELP)
    sync.add_argument("--token", help="the ingest token (default: RANKWATCH_INGEST_TOKEN)")

    doctor = sub.add_parser("doctor", help="check the environment a job will run in: torch and CUDA, attach rights, the collector, the spool")
    doctor.add_argument("--collector", help=COLLECTOR_HELP)
    doctor.add_argument("--spool-dir", help="the spool directory to check (default: RANKWATCH_SPOOL_DIR, else ~/.cache/rankwatch/spool)")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    return p


def _is_native_executable(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"\x7fELF" and os.access(path, os.X_OK)
    except OSError:
        return False


def collector_binary() -> Path | None:
    """The collector binary: `RANKWATCH_BIN`, else the first native `rankwatch` on PATH."""
    named = os.environ.get("RANKWATCH_BIN")
    if named:
        return Path(named)
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(entry or ".") / "rankwatch"
        if candidate.is_file() and _is_native_executable(candidate):
            return candidate
    return None


def _forward(argv: list[str]) -> int:
    binary = collector_binary()
    what = argv[0] if argv else ""
    if binary is None:
        print(
            f"rankwatch: `{what}` is a command of the collector binary, which is not installed here "
            f"(this is the Python package's rankwatch {VERSION}: {', '.join(OWN_COMMANDS)}). Put the collector's "
            "`rankwatch` on PATH (the release archive rankwatch-<version>-x86_64-unknown-linux-gnu.tar.gz, or the "
            "Docker image), or name it with RANKWATCH_BIN.",
            file=sys.stderr,
        )
        return 2
    if not _is_native_executable(binary):
        print(f"rankwatch: RANKWATCH_BIN={binary} is not an executable collector binary", file=sys.stderr)
        return 2
    # Replace this process: signals and the exit status are the binary's own.
    os.execv(binary, [str(binary), *argv])


def _is_own(argv: list[str]) -> bool:
    if not argv or argv[0].startswith("-"):
        return True  # --help, --version, or a usage error: argparse answers
    if argv[0] in ("attach", "detach"):
        # `attach RUN` switches a dormant run through the collector: the binary's.
        return any(a == "--pid" or a.startswith("--pid=") or a in ("-h", "--help") for a in argv[1:])
    return argv[0] in OWN_COMMANDS


def _sync(args: argparse.Namespace) -> int:
    from .offline import collector_url, sync

    spool = Path(args.spool_dir)
    if not spool.is_dir():
        print(f"rankwatch sync: {spool} is not a directory", file=sys.stderr)
        return 2
    url = collector_url(args.collector)
    report = sync(spool, url, token=args.token)
    print(
        f"sent {report['rows']} rows in {report['batches']} batches to {url} ({report['duplicates']} batches already there); "
        f"{report['remaining']} batches remain, {report['set_aside_rows']} rows set aside as refused, {report['corrupt']} corrupt records skipped"
    )
    for error in report["errors"]:
        print(f"error: {error}", file=sys.stderr)
    return 0 if report["remaining"] == 0 and not report["errors"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not _is_own(argv):
        return _forward(argv)
    args = _parser().parse_args(argv)
    if args.action == "run":
        from .auto.launch import main as run_main

        return run_main(args)
    if args.action == "sync":
        return _sync(args)
    if args.action == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(args.collector, args.spool_dir, as_json=args.json)
    from .auto.inject import main as inject_main

    return inject_main(args, args.action)
