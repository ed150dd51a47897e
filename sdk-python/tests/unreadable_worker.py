"""One rank of tests/test_any_model.py: a model layer discovery cannot read, trained under DDP
with a GradScaler that is never handed to rankwatch, watched and unwatched.

The model has no list of transformer blocks at all (token mixing by a learned matrix, an MLP,
all plain attributes), so discovery fails and the layer probes are off; the loss and the gradient
probe must still run. The job scales its loss by `GradScaler("cpu", init_scale=1024)`, unscales
and clips the gradient (`clip_grad_norm_` returns the total norm of the averaged, unscaled
gradient) as mixed-precision jobs do. A hook-free copy recomputes each rank's local gradient at
the same weights, gathered over the group in float64: the brute-force ‖g_k‖, ‖ḡ‖ and cos(g_k, ḡ)
the watched twin must report. The rank writes both twins' final parameters, the reported and
expected values, clip_grad_norm_'s totals and the warnings rankwatch gave.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rankwatch  # noqa: E402

STEPS = 5
VOCAB, WIDTH, SEQ = 40, 24, 12


class Unreadable(nn.Module):
    """Embeddings, a learned token-mixing matrix and an MLP: nothing discovery can call a block."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, WIDTH)
        self.mixing = nn.Parameter(torch.randn(SEQ, SEQ) / SEQ)
        self.widen = nn.Linear(WIDTH, 3 * WIDTH)
        self.narrow = nn.Linear(3 * WIDTH, WIDTH)
        self.readout = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.table(idx)
        h = h + torch.einsum("st,btc->bsc", torch.tril(self.mixing), h)
        h = h + self.narrow(F.gelu(self.widen(h)))
        return self.readout(h)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), torch.roll(x, -1, 1).flatten())


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()

    def job(watched: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        model = Unreadable()
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.3, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        run = None
        caught: list[str] = []
        if watched:
            run = rankwatch.init(run="unreadable", mode="offline", spool_dir=out_dir / "spool", every={"grad": 1, "dot": 1, "sketch": 1})
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                run.watch(ddp, optimizer)  # no scaler=: rankwatch must find the one that scales
            caught = [str(w.message) for w in seen]
        data = torch.Generator().manual_seed(100 + rank)
        reported, expected, clipped = [], [], []
        for step in range(STEPS):
            x = torch.randint(0, VOCAB, (4, SEQ), generator=data)
            if not watched:
                expected.append(brute_force(model, x, world))
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss_of(ddp, x)).backward()
            scaler.unscale_(optimizer)
            clipped.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=1.0)))
            scaler.step(optimizer)
            scaler.update()
            if run is not None:
                run.log(step, loss=1.0)
                reported.append({f"{k[0]}": v for k, v in run.last_values.items() if k[1] is None})
                run.last_values.clear()
        tags = {}
        if run is not None:
            tags = dict(run.tags)
            run.finish(timeout=5)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return {"state": state, "reported": reported, "expected": expected, "clipped": clipped, "warnings": caught, "tags": tags}

    plain, watched = job(False), job(True)
    equal = all(torch.equal(plain["state"][k], watched["state"][k]) for k in plain["state"])
    result = {
        "equal": equal,
        "reported": watched["reported"],
        "expected": plain["expected"],
        "clipped_plain": plain["clipped"],
        "clipped_watched": watched["clipped"],
        "warnings": watched["warnings"],
        "tags": watched["tags"],
    }
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def brute_force(model: nn.Module, x: torch.Tensor, world: int) -> dict[str, float]:
    """This rank's local gradient at the current weights on a hook-free copy, and the group's."""
    twin = copy.deepcopy(model)
    loss_of(twin, x).backward()
    g = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in twin.parameters()]).double()
    gathered = [torch.zeros_like(g) for _ in range(world)]
    dist.all_gather(gathered, g)
    mean = torch.stack(gathered).mean(0)
    return {"grad_norm": float(g.norm()), "grad_norm_mean": float(mean.norm()), "cos_to_mean": float(g @ mean / (g.norm() * mean.norm()))}


if __name__ == "__main__":
    main()
