"""Which loss scaler scaled this step's loss.

Mixed-precision jobs multiply the loss by a `GradScaler`'s scale before the backward, so every
gradient the probes read is scaled too; reporting it as it is would put gradient norms off by
the scale (×1024 at `init_scale=1024`), silently. Rather than trust the user to hand the scaler
to `watch()`, rankwatch sees it: while anything listens, `GradScaler.scale` (and the `scale` of
every loaded subclass that defines its own: the deprecated `torch.cuda.amp.GradScaler`, FSDP's
`ShardedGradScaler`) is wrapped so that after the original ran, each listener hears which
scaler scaled which outputs. The wrapper calls the original with the same arguments and returns
its result unchanged, never reads a tensor on the host, and a listener that raises is dropped
from the call, not propagated: the step is the user's. The original methods are restored when
the last listener leaves.

The gradient probe listens to follow the scaler whose `scale()` saw the loss of the backward it
measures (the last one called before it: the right one also where a process holds several);
the zero-code agent listens to see the loss itself.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

Listener = Callable[[Any, Any, Any], None]  # (scaler, outputs, scaled outputs)

_lock = threading.Lock()
_listeners: list[Listener] = []
_patched: list[tuple[type, Any]] = []


def scaler_classes() -> list[type]:
    """The loaded GradScaler classes that define `scale` themselves."""
    classes: list[type] = [torch.amp.GradScaler]
    cuda_scaler = getattr(getattr(torch.cuda, "amp", None), "GradScaler", None)
    if isinstance(cuda_scaler, type):
        classes.append(cuda_scaler)
    sharded = sys.modules.get("torch.distributed.fsdp.sharded_grad_scaler")
    sharded_scaler = getattr(sharded, "ShardedGradScaler", None)
    if isinstance(sharded_scaler, type):
        classes.append(sharded_scaler)
    return [cls for cls in dict.fromkeys(classes) if "scale" in cls.__dict__]


def listen(listener: Listener) -> Callable[[], None]:
    """Calls `listener(scaler, outputs, result)` after every `GradScaler.scale` until the
    returned function is called."""
    with _lock:
        if not _listeners:
            _install()
        _listeners.append(listener)

    def stop() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)
                if not _listeners:
                    _uninstall()

    return stop


def _install() -> None:
    for cls in scaler_classes():
        original = cls.__dict__["scale"]

        def scale(self: Any, outputs: Any, _original: Any = original) -> Any:
            result = _original(self, outputs)
            for listener in list(_listeners):
                try:
                    listener(self, outputs, result)
                except Exception:  # noqa: BLE001 - the listener's failure is its own to report
                    pass
            return result

        scale.__wrapped__ = original  # type: ignore[attr-defined]
        _patched.append((cls, original))
        cls.scale = scale  # type: ignore[attr-defined]


def _uninstall() -> None:
    while _patched:
        cls, original = _patched.pop()
        cls.scale = original  # type: ignore[attr-defined]


def enabled(scaler: Any) -> bool:
    """Whether `scaler` scales (a disabled GradScaler's `scale` returns its input)."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True
