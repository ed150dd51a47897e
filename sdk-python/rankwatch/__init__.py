"""rankwatch: training observability from inside the job.

```python
import rankwatch
run = rankwatch.init(run="llama-ft-7", collector="http://127.0.0.1:7070")
run.watch(model, optimizer)
for step, batch in enumerate(loader):
    ...
    run.log(step, loss=loss, tokens=n_tokens)   # tensors welcome; never a host sync
run.finish()                                     # or: with rankwatch.init(...) as run:
```

Integrations load lazily: `rankwatch.integrations.transformers.RankwatchCallback` and
`rankwatch.integrations.lightning.RankwatchCallback`.

`import rankwatch` does not need PyTorch: `rankwatch.sync`, `rankwatch.__version__` and the
`rankwatch` command work without it, and the names that need it (`init`, `Run`, ...) are
imported on first use, where a missing torch is named instead of failing inside the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._native import VERSION as __version__  # the package's version, from Cargo.toml
from .offline import sync

__all__ = ["Cadence", "DiscoveryError", "Mode", "NoopRun", "RankwatchWarning", "Run", "__version__", "init", "sync"]

if TYPE_CHECKING:
    from .cadence import Cadence
    from .discovery import DiscoveryError
    from .offline import Mode
    from .run import NoopRun, RankwatchWarning, Run
    from .settings import init

# Names imported on first use, and the module that has each.
_LAZY = {"Cadence": "cadence", "Mode": "offline", "init": "settings", "NoopRun": "run", "RankwatchWarning": "run", "Run": "run", "DiscoveryError": "discovery"}


class MissingDependency(ModuleNotFoundError):
    """A part of rankwatch was used whose dependency is not installed."""


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rankwatch' has no attribute {name!r}")
    import importlib
    import sys

    try:
        found = importlib.import_module(f".{module}", __name__)
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise MissingDependency(
            f"rankwatch.{name} needs PyTorch, which is not installed for {sys.executable}: "
            "pip install torch (or pip install 'rankwatch[torch]'). Without it, rankwatch.sync and the "
            "`rankwatch` command (sync, doctor) still work.",
            name="torch",
        ) from e
    value = getattr(found, name)
    globals()[name] = value
    return value
