"""Alerts delivered to the training script: `Run.on_alert`.

The native agent polls the collector for the run's alert changes on a thread of its own and
queues them as JSON texts; the callbacks run on the training thread, inside the next `log()` or
`finish()`, so a callback may checkpoint or raise to stop the job. A callback that fails for
any other reason is a warning, and the next alert is still delivered.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from . import _native

# What a callback receives: the collector's alert (id, rule, severity, state, layer, rank, ...).
AlertCallback = Callable[[dict[str, Any]], None]


class AlertFeed:
    """The script's alert callbacks, and their delivery."""

    def __init__(self, warn: Callable[[str, str], None]) -> None:
        self._warn = warn
        self.callbacks: list[AlertCallback] = []

    def add(self, callback: AlertCallback) -> None:
        if not callable(callback):
            raise TypeError("rankwatch: on_alert needs a callable")
        self.callbacks.append(callback)

    def deliver(self, agent: _native.Agent) -> None:
        """Calls the callbacks with what the feed brought since the last call."""
        if not self.callbacks:
            return
        texts = agent.take_alerts()
        for text in texts:
            alert = json.loads(text)
            for callback in self.callbacks:
                try:
                    callback(alert)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except Exception as e:  # a broken callback must not end the job
                    if getattr(e, "stop", False):
                        raise
                    self._warn(f"callback-{id(callback)}", f"rankwatch: on_alert callback {callback!r} raised {e!r}; further alerts are still delivered")
