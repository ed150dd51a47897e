"""Starting the ranks of an example job on one machine: a free port for the rendezvous and one
process per rank with torch.distributed's environment (what torchrun sets) in place."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nothing listens on now (the rendezvous binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world: int, port: int, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    target(rank, *args)


def spawn_ranks(target: Callable[..., None], world: int, *args: Any) -> None:
    """Runs `target(rank, *args)` in `world` processes and waits for all of them; a rank that
    fails fails the call. `target` must be a module-level function (it is pickled by name)."""
    mp.spawn(_rank_main, args=(world, free_port(), target, args), nprocs=world, join=True)
