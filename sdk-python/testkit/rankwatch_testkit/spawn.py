"""Starting the ranks of an example job on one machine: a free port for the rendezvous and one
process per rank with torch.distributed's environment (what torchrun sets) in place.

The ranks are forked when that is safe, spawned otherwise. A spawned rank starts a fresh
Python that imports torch again, and its first DistributedDataParallel imports
`torch._dynamo`: on two cores that was 12-15 s of a 4-rank job's start, every time, and the
test suites start dozens of them. A forked rank inherits the modules this process imported
(about 5 s for the same job, the same final parameters bit for bit). Forking is safe only
from a process with no other thread and no CUDA context, which is what this checks first.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

# How long the other ranks have to end on their own once one rank has failed.
GRACE_SECONDS = 15.0


def free_port() -> int:
    """A TCP port nothing listens on now (the rendezvous binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    inherited = _live_runs()
    try:
        target(rank, *args)
    except BaseException as e:
        _end_runs_started_here(inherited, e)
        raise
    _end_runs_started_here(inherited, None)
    # The rank's work is done and its runs are ended: leave without the interpreter's teardown,
    # as a forked rank does anyway. In torch 2.15 that teardown aborts a process now and then
    # ("terminate called without an active exception": a gloo work thread frees its last work
    # item after Python has finalized); 3 of 10 spawned runs of a plain 2-rank DDP job over
    # gloo, no rankwatch imported, aborted so on this machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _live_runs() -> list[Any]:
    """This process's unfinished rankwatch runs; none (and nothing imported) for a job that
    does not use rankwatch."""
    run_module = sys.modules.get("rankwatch.run")
    return run_module.live_runs() if run_module is not None else []


def _end_runs_started_here(inherited: list[Any], error: BaseException | None) -> None:
    """Ends the runs `target` started and left unfinished, as leaving a `with
    rankwatch.init(...)` block would: a crash if it raised (`SystemExit` included; the
    collector is not told the rank finished), else a finish.

    A forked rank ends in `os._exit`, skipping the interpreter shutdown that drops an agent and
    delivers what it still holds; ending the runs here makes both start methods end alike. A
    run inherited from the launcher through the fork is the launcher's, never ended here. A run
    that fails to end is reported and the others are still ended; the rank's own outcome, its
    error or its success, is what the launcher sees."""
    for run in _live_runs():
        if any(run is mine for mine in inherited):
            continue
        try:
            if error is None:
                run.finish()
            else:
                run.__exit__(type(error), error, error.__traceback__)
        except BaseException as e:  # noqa: BLE001 - the rank's own outcome must not be replaced
            print(f"rankwatch_testkit: could not end run {getattr(run, 'id', '?')!r}: {e!r}", file=sys.stderr)


def _threads() -> int:
    """Threads of this process, Python's and native ones alike (an OpenMP pool, an agent's
    sender); Python's alone where /proc is missing."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def start_method() -> str:
    """"fork" where a child cannot inherit a lock held by another thread or a CUDA context
    (Linux, one thread, CUDA untouched), "spawn" otherwise; `RANKWATCH_START_METHOD` overrides."""
    chosen = os.environ.get("RANKWATCH_START_METHOD")
    if chosen in ("fork", "spawn"):
        return chosen
    if sys.platform == "linux" and _threads() == 1 and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


def spawn_ranks(target: Callable[..., None], world: int, *args: Any) -> None:
    """Runs `target(rank, *args)` in `world` processes and waits for all of them; a rank that
    fails fails the call. `target` must be a module-level function (spawned ranks unpickle it
    by name)."""
    method = start_method()
    if method == "fork":
        # Imported once here instead of by every rank's first DDP. It starts no thread in the
        # torch of this writing; asked again in case a later one does.
        import torch._dynamo  # noqa: F401

        method = start_method()
    ranks = mp.start_processes(_rank_main, args=(world, free_port(), target, args), nprocs=world, join=False, start_method=method)
    # When one rank fails, the others get GRACE_SECONDS to end on their own (and end their
    # runs, delivering what they logged) before they are terminated; with no grace they were
    # terminated at once, losing what their agents held.
    while not ranks.join(grace_period=GRACE_SECONDS):
        pass
