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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .run import Cadence, Mode, NoopRun, RankwatchWarning, Run, init, sync

__all__ = ["Cadence", "DiscoveryError", "Mode", "NoopRun", "RankwatchWarning", "Run", "init", "sync"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .discovery import DiscoveryError


def __getattr__(name: str) -> Any:
    if name == "DiscoveryError":
        from .discovery import DiscoveryError

        return DiscoveryError
    raise AttributeError(f"module 'rankwatch' has no attribute {name!r}")
