"""The interpreter's exit, for runs the process never finished.

A script that never calls `finish()`, and the zero-code agent, which has no place to call it,
leave their runs open when the process ends. `install` registers one exit handler (once per
process; a forked child inherits it) that is handed whether the process is ending in failure,
so that a crash still reads as a crash at the collector (no rank reports `finished`, its alerts
stay open), as when a `with` block is left by an exception.

Failure is read the way wandb's exit hooks read it, without depending on who prints the error:
- an uncaught exception: the interpreter sets `sys.last_value` (`sys.last_exc` from 3.12)
  before it prints one, ahead of the exit handlers;
- a non-zero code given to `sys.exit`, which is wrapped to keep it: that is how
  `multiprocessing` ends a spawned worker whose target raised (it prints the traceback itself),
  and how scripts and launchers say they failed. `raise SystemExit(1)` bypasses the wrapper and
  reads as a clean end.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from typing import NoReturn

_installed = False
_exit_code: object = None  # the last code given to sys.exit


def ending_in_failure() -> bool:
    """Whether the process is ending on an uncaught exception or a non-zero `sys.exit`."""
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return True
    # sys.exit("message") prints the message and exits 1.
    return _exit_code is not None and _exit_code != 0


def install(on_exit: Callable[[bool], None]) -> None:
    """Calls `on_exit(ending_in_failure())` at the interpreter's exit (registered once)."""
    global _installed
    if _installed:
        return
    _installed = True
    original = sys.exit

    def recording_exit(code: object = None) -> NoReturn:
        global _exit_code
        _exit_code = code
        original(code)  # type: ignore[arg-type]

    sys.exit = recording_exit
    atexit.register(lambda: on_exit(ending_in_failure()))
