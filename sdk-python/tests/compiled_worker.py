"""One rank of the compiled-activations twins (test_compiled_activations.py): the OLMo zoo
model watched before `torch.compile` (or not watched), trained a few steps, each job from a
fresh dynamo state, counted with dynamo's own counters. Run alone (`train`, imported by the
test) or as one of several gloo ranks under DistributedDataParallel over the compiled model, as
nanoGPT does (`python compiled_worker.py OUT`, under `conftest.run_ranks`): each rank writes
whether its watched twin (opted in) ended bit-identical to the unwatched one, both twins' graph
counts and breaks, and which activation metrics it reported.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

import rankwatch
from rankwatch_testkit.zoo import ZooConfig, ZooModel

STEPS = 8
CONFIG = ZooConfig(layout="olmo")


def train(tmp_path: Path, watch: dict[str, Any] | None, *, ddp: bool = False) -> dict[str, Any]:
    """One job; `watch` the arguments of `run.watch` (None: unwatched); `ddp` wraps the compiled
    model in DistributedDataParallel (a process group must exist)."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = ZooModel(CONFIG)
    run = None
    if watch is not None:
        run = rankwatch.init(run="compiled", mode="offline", spool_dir=tmp_path, every={"activations": 2, "spectral": 4})
        run.watch(model, **watch)
    compiled: torch.nn.Module = cast(torch.nn.Module, torch.compile(model))  # an OptimizedModule; the stub says Callable
    if ddp:
        compiled = torch.nn.parallel.DistributedDataParallel(compiled)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1 + (dist.get_rank() if ddp else 0))
    last_armed: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", rankwatch.RankwatchWarning)
        for step in range(STEPS):
            x = torch.randint(0, CONFIG.vocab_size, (3, 12), generator=data)
            if run is not None and run._activations is not None and run._activations.armed:
                last_armed = ({k: v.detach().clone() for k, v in model.state_dict().items()}, x)
            compiled(x, torch.roll(x, -1, 1))[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if run is not None:
                run.log(step)
        tags = dict(run.tags) if run is not None else {}
        reported = dict(run.last_values) if run is not None else {}
        if run is not None:
            run.finish()
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, rankwatch.RankwatchWarning)],
        "tags": tags,
        "reported": reported,
        "last_armed": last_armed,
    }


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    plain = train(out / f"plain-{rank}", None, ddp=True)
    watched = train(out / f"watched-{rank}", {"compiled_activations": True}, ddp=True)
    result = {
        "equal": all(torch.equal(a, b) for a, b in zip(plain["params"], watched["params"], strict=True)),
        "graphs": [plain["graphs"], watched["graphs"]],
        "breaks": [plain["breaks"], watched["breaks"]],
        "metrics": sorted({key[0] for key in watched["reported"]}),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
