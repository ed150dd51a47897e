"""Run a function right after a module is imported, without importing it ourselves.

`sitecustomize` runs in every Python process a launcher starts — the torchrun agent, the
training ranks, data-loader workers, a tokenizer script — and most must pay nothing. So the
agent never imports torch: it waits for the process to do so. `when_imported(name, callback)`
calls `callback(module)` at once if `name` is already imported, else from a finder placed
first on `sys.meta_path` that, for that one name, wraps the real loader's `exec_module`. It
is the mechanism of `wrapt.when_imported` and of OpenTelemetry's instrumentors, reduced to
what the agent needs: one name, once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

_lock = threading.Lock()


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self._busy = False

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or self._busy:
            return None
        # The real spec, from the finders after this one.
        self._busy = True
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        finder = self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                # The real loader back, so the module looks as it would without us.
                module.__loader__ = loader
                if module.__spec__ is not None:
                    module.__spec__.loader = loader
                finder.fire(module)

        spec.loader = _Loader()
        return spec

    def fire(self, module: ModuleType) -> None:
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        self.callback(module)


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """`callback(module)` once `name` has been imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    with _lock:
        sys.meta_path.insert(0, _Finder(name, callback))
