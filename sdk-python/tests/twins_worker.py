"""One rank of tests/test_twins.py: the same small GPT trained twice, unwatched and watched.

Both twins start from the same weights and random state and see the same data; the watched
one runs every probe at its finest cadence (gradient statistics with dot mode, sketch and
activations due on every logged step, spectral norms). Next to the unwatched twin a shadow copy
recomputes, without DDP or hooks, each rank's local gradient of every step (summed over its
micro-batches), gathers them over the data-parallel group in float64, and records the
brute-force values the watched twin should have reported: ‖g_k‖, ‖ḡ‖, cos(g_k, ḡ), and under a
GradScaler whether the scaler skipped the step. The rank writes the twins' final parameters and
both sets of values to JSON; the test compares them.

Layouts (argv[1]): world, subgroups (two DDP groups of two ranks), comm_hook (a bf16
compression hook registered by the user first), accumulation (no_sync micro-batches, logged
every other step), amp (fp16 autocast with a GradScaler that starts too high, so it skips
steps), bf16 (bf16 autocast), unwatch (finish() after step 2, training goes on), checkpoint
(every block under reentrant activation checkpointing: gradients accumulate inside nested
backward passes).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rankwatch  # noqa: E402
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig  # noqa: E402

STEPS = 7


def main() -> None:
    layout, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if layout == "subgroups":
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        group, dp_ranks = groups[rank // 2], [0, 1] if rank < 2 else [2, 3]
    else:
        group, dp_ranks = None, list(range(world))
    micro = 2 if layout == "accumulation" else 1
    log_every = 2 if layout == "accumulation" else (3 if layout == "world" else 1)

    def job(watched: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]], list[dict[str, Any]]]:
        torch.manual_seed(0)
        config = NanoGPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, dropout=0.1, bias=True)
        model = NanoGPT(config)
        if layout == "checkpoint":
            from torch.utils.checkpoint import checkpoint

            for block in model.transformer.h:
                block.forward = (lambda forward: lambda x: checkpoint(forward, x, use_reentrant=True))(block.forward)  # type: ignore[method-assign]  # checkpointing the block, as a user does
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        if layout == "comm_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127) if layout == "amp" else None
        autocast = {"amp": torch.float16, "bf16": torch.bfloat16}.get(layout)
        run = None
        if watched:
            # In "world" the probes are due every 5th step while steps 0, 3, 6 are logged: each
            # must be armed by the logged step that follows a due one.
            every = (
                {"grad": 1, "sketch": 5, "dot": 5, "activations": 5, "spectral": 5, "fingerprint": 5}
                if layout == "world"
                else {"grad": 1, "sketch": 1, "dot": 1, "activations": 1, "spectral": 1, "fingerprint": 1}
            )
            run = rankwatch.init(run=f"twins-{layout}", mode="offline", spool_dir=out_dir / "spool", every=every)
            run.watch(ddp, optimizer, scaler=scaler)
        # Seeded per rank after setup: dropout draws the same stream in both twins.
        torch.manual_seed(1000 + rank)
        data = torch.Generator().manual_seed(100 + rank)
        reported: list[dict[str, Any]] = []
        expected: list[dict[str, Any]] = []
        for step in range(STEPS):
            batches = [torch.randint(0, 50 if rank != 3 else 10, (4, 16), generator=data) for _ in range(micro)]
            shadow_state = None
            if not watched:
                shadow_state = (copy.deepcopy(model.state_dict()), torch.get_rng_state())
            optimizer.zero_grad(set_to_none=True)
            for i, x in enumerate(batches):
                sync = i == micro - 1
                with (nullcontext() if sync else ddp.no_sync()):
                    with torch.autocast("cpu", dtype=autocast) if autocast else nullcontext():
                        _, loss = ddp(x, torch.roll(x, -1, 1))
                    (scaler.scale(loss) if scaler else loss).backward()
            scale_before = scaler.get_scale() if scaler else None
            # The averaged gradient DDP actually handed the optimizer (a compression hook rounds it).
            reduced = float(torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in model.parameters()]).double().norm()) / (scale_before or 1.0)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            logged = step % log_every == 0
            if run is not None and logged:
                run.log(step, loss=loss.detach())
                reported.append({"step": step, "values": {f"{k[0]}/{k[1]}/{k[2]}": v for k, v in run.last_values.items()}})
                run.last_values.clear()
            if layout == "unwatch" and run is not None and step == 2:
                run.finish(timeout=5)
                run = None
            if shadow_state is not None and logged:
                expected.append({"step": step, "reduced_norm": reduced, **shadow(model, shadow_state, batches, autocast, dp_ranks, group)})
                if scaler:
                    expected[-1]["amp_skipped"] = float(scaler.get_scale() < cast(float, scale_before))  # set with the scaler
        if run is not None:
            run.finish(timeout=5)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, reported, expected

    plain, _, expected = job(watched=False)
    watched, reported, _ = job(watched=True)
    equal = {k: bool(torch.equal(plain[k], watched[k])) for k in plain}
    max_diff = max(float((plain[k].double() - watched[k].double()).abs().max()) for k in plain)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps({"equal": equal, "max_diff": max_diff, "reported": reported, "expected": expected, "dp_ranks": dp_ranks}))
    dist.destroy_process_group()


def shadow(model: NanoGPT, state: tuple[dict[str, torch.Tensor], torch.Tensor], batches: list[torch.Tensor], autocast: torch.dtype | None, dp_ranks: list[int], group: object) -> dict[str, float]:
    """Brute force, on a hook-free copy with the weights and random state before the step."""
    weights, rng = state
    copy_ = copy.deepcopy(model)
    for block in copy_.transformer.h:
        block.__dict__.pop("forward", None)  # no checkpointing: it would call the original blocks
    copy_.load_state_dict(weights)
    saved = torch.get_rng_state()
    torch.set_rng_state(rng)
    for x in batches:
        with torch.autocast("cpu", dtype=autocast) if autocast else nullcontext():
            _, loss = copy_(x, torch.roll(x, -1, 1))
        loss.backward()
    torch.set_rng_state(saved)
    g = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in copy_.parameters()]).double()
    gathered = [torch.zeros_like(g) for _ in dp_ranks]
    dist.all_gather(gathered, g, group=cast("dist.ProcessGroup | None", group))  # this rank's group, or the world
    g_bar = torch.stack(gathered).mean(0)
    return {
        "grad_norm": float(g.norm()),
        "grad_norm_mean": float(g_bar.norm()),
        "cos_to_mean": float(g @ g_bar / (g.norm() * g_bar.norm())),
    }


if __name__ == "__main__":
    main()
