"""`python -m rankwatch run|attach|detach`: the agent without code changes.

    python -m rankwatch run [--run NAME] [--collector URL] [--every N|probe=N,...] [--dormant] -- COMMAND...
    python -m rankwatch attach --pid PID [--run NAME] [--collector URL] [--every ...]
    python -m rankwatch detach --pid PID

The collector binary's `rankwatch run` and `rankwatch attach --pid` call this module, so the
commands read the same whichever is on PATH. `attach RUN` / `detach RUN` (a job started with
`--dormant`) go through the collector and are the binary's own.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rankwatch", description="Watch a PyTorch training job without changing its code.")
    sub = p.add_subparsers(dest="action", required=True)

    def settings(q: argparse.ArgumentParser) -> None:
        q.add_argument("--run", help="the run's name (default: made from the script's name and the time)")
        q.add_argument("--collector", help="the collector's URL (default: RANKWATCH_COLLECTOR, else http://127.0.0.1:7070)")
        q.add_argument("--mode", choices=["online", "offline"], help="stream to the collector (default) or only spool to disk")
        q.add_argument("--every", help="steps between measurements: N for every costly probe, or probe=N pairs (grad, sketch, dot, activations, spectral)")

    run = sub.add_parser("run", help="run COMMAND with the agent in every Python process it starts")
    settings(run)
    run.add_argument("--dormant", action="store_true", help="start with every probe off; `rankwatch attach RUN` turns them on")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- torchrun --nproc_per_node 2 train.py")

    for name, text in (("attach", "inject the agent into the training ranks at or below PID"), ("detach", "remove the agent's hooks from the ranks at or below PID")):
        q = sub.add_parser(name, help=text)
        q.add_argument("--pid", type=int, required=True, help="a training rank, or a launcher (torchrun, accelerate launch) above the ranks")
        q.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for every rank to answer (default 60)")
        if name == "attach":
            settings(q)
        else:
            q.set_defaults(run=None, collector=None, mode=None, every=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.action == "run":
        from .auto.launch import main as run_main

        return run_main(args)
    from .auto.inject import main as inject_main

    return inject_main(args, args.action)


if __name__ == "__main__":
    sys.exit(main())
