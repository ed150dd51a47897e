"""The interpreter's exit, for runs the process never finished.

A script that never calls `finish()`, and the zero-code agent, which has no place to call it,
leave their runs open when the process ends. `watch` registers one exit handler (once per
process; a forked child inherits it) that is handed whether the process is ending in failure,
so that a crash still reads as a crash at the collector (no rank reports `finished`, its alerts
stay open), as when a `with` block is left by an exception.

Failure is read the way wandb's exit hooks read it, without depending on who prints the error:
- an uncaught exception: the interpreter sets `sys.last_value` (`sys.last_exc` from 3.12)
  before it prints one, ahead of the exit handlers (one already set when the first run
  started, by an interactive session, is not counted);
- a non-zero code given to `sys.exit` on the main thread, which is wrapped while a run is
  live to keep it: that is how `multiprocessing` ends a spawned worker whose target raised (it
  prints the traceback itself), and how scripts and launchers say they failed. The wrapper is
  removed when the last run ends.

What this cannot see: `raise SystemExit(1)` and the builtin `exit(1)` bypass the wrapper and
read as a clean end, as does a `sys.exit(1)` whose `SystemExit` the program caught and went on
from (it reads as a failure). A process that leaves by `os._exit` (a forked `multiprocessing`
child, a DataLoader worker) or is killed by a signal runs no exit handler: its runs are never
finished, and the collector closes their steps on its timeout.
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

# What the exit waits to deliver, for every unfinished run together: what `finish()` waits for
# one run, so a slow collector (an fsync on a loaded disk) gets as long as at an explicit end.
EXIT_TIMEOUT_S = 10.0

_registered = False
_wrapper: Callable[..., NoReturn] | None = None  # sys.exit's, its `__wrapped__` the original
_exit_code: object = None  # the last code given to sys.exit on the main thread
_stale_exception: object = None  # an uncaught exception printed before the first run


def _last_exception() -> object:
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def ending_in_failure() -> bool:
    """Whether the process is ending on an uncaught exception or a non-zero `sys.exit`."""
    last = _last_exception()
    if last is not None and last is not _stale_exception:
        return True
    # sys.exit("message") prints the message and exits 1.
    return _exit_code is not None and _exit_code != 0


def watch(on_exit: Callable[[bool], None]) -> None:
    """While a run is live: `on_exit(ending_in_failure())` at the interpreter's exit (the
    handler registered once) and `sys.exit` wrapped to keep its code."""
    global _registered, _wrapper, _exit_code, _stale_exception
    if not _registered:
        _registered = True
        _stale_exception = _last_exception()
        atexit.register(lambda: on_exit(ending_in_failure()))
    if _wrapper is not None and sys.exit is _wrapper:
        return
    original = sys.exit

    @functools.wraps(original)
    def recording_exit(code: object = None) -> NoReturn:
        global _exit_code
        if threading.current_thread() is threading.main_thread():
            _exit_code = code
        original(code)  # type: ignore[arg-type]

    _wrapper, _exit_code = recording_exit, None
    sys.exit = recording_exit


def release() -> None:
    """The last run ended: `sys.exit` is given back (unless something wrapped it since)."""
    global _wrapper
    if _wrapper is not None and sys.exit is _wrapper:
        sys.exit = _wrapper.__wrapped__  # type: ignore[attr-defined]
    _wrapper = None
