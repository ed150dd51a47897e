"""A small GPT trained with DDP on CPU (gloo), several processes, streaming to rankwatch.

    python sdk-python/examples/train_ddp.py --nproc 4 --steps 200 --collector http://127.0.0.1:7070
    torchrun --nproc-per-node 4 sdk-python/examples/train_ddp.py --steps 200   # same, via torchrun

The data is a synthetic "language": a fixed corpus of token sequences drawn from a random bigram
table, so the loss falls quickly and visibly. Every epoch it is shuffled with a seed all ranks
share and cut into one shard per rank, exactly as a DistributedSampler does. `--monitor off` runs
the same job without rankwatch, for overhead comparisons (`cargo xtask bench sdk`).

`--fault KIND@STEP[:key=value...]` (repeatable) injects what goes wrong in real jobs — a rank
with another data seed, corrupted labels, a silently perturbed local gradient, a layer pushed
toward collapse, activation growth, NaN, a rank that stops reporting — see `rankwatch_testkit.faults`.
`--on-alert stop` makes the job checkpoint-and-stop when a critical alert arrives.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rankwatch  # noqa: E402
from rankwatch_testkit.faults import Fault, Injector  # noqa: E402
from rankwatch_testkit.faults import check as check_faults  # noqa: E402
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig  # noqa: E402
from rankwatch_testkit.spawn import spawn_ranks  # noqa: E402


def bigram_corpus(sequences: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """A fixed corpus of token sequences from a random bigram table (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 3.0, dim=-1)
    tokens = torch.empty(sequences, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (sequences,), generator=gen)
    for t in range(seq):
        tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=gen).squeeze(1)
    return tokens


def sharded_batches(corpus: torch.Tensor, rank: int, world: int, batch: int, shuffle_seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets): each epoch a permutation from `shuffle_seed` (shared by all
    ranks, as DistributedSampler's), rank `rank` taking every `world`-th sequence of it."""
    epoch = 0
    while True:
        order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(shuffle_seed + epoch))
        shard = order[rank::world]
        for i in range(0, len(shard) - batch + 1, batch):
            tokens = corpus[shard[i : i + batch]]
            yield tokens[:, :-1], tokens[:, 1:]
        epoch += 1


def train(args: argparse.Namespace) -> dict[str, Any]:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = NanoGPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0, bias=False)
    model = NanoGPT(config)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    faults = Injector([Fault.parse(f) for f in args.fault], rank)
    faults.attach(model, list(model.transformer.h), optimizer)
    run = None
    alerts: list[dict[str, Any]] = []
    if args.monitor == "on":
        tags = {"example": "train_ddp", "lr": str(args.lr)}
        if args.fault:
            tags["faults"] = " ".join(args.fault)
        run = rankwatch.init(run=args.run, collector=args.collector, mode=args.mode, spool_dir=args.spool_dir, tags=tags, every={k: int(v) for k, v in (kv.split("=") for kv in args.cadence)} or None)
        run.watch(ddp, optimizer)
        run.on_alert(alerts.append, poll_interval=0.5)
    corpus = bigram_corpus(args.corpus, args.seq, args.vocab, args.seed)
    data = sharded_batches(corpus, rank, world, args.batch, faults.data_seed(args.seed))
    step_times = []
    skipped: list[int] = []
    stopped_at = None
    for step in range(args.steps):
        faults.begin_step(step)
        x, y = next(data)
        y = faults.targets(y)
        started = time.perf_counter()
        _, loss = ddp(x, y)
        loss = faults.loss(loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        faults.end_backward()
        # As torch.amp's GradScaler does: a step whose averaged gradient is not finite is
        # skipped (the same on every rank, since the gradient is the all-reduced one).
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if torch.isfinite(torch.stack(torch._foreach_norm(grads))).all():
            optimizer.step()
        else:
            skipped.append(step)
        if run is not None and faults.reporting():
            run.log(step, loss=loss.detach(), tokens=y.numel(), lr=args.lr)
        step_times.append(time.perf_counter() - started)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if args.on_alert == "stop":
            # Every rank hears the alert, but not at the same step: agree on stopping (a
            # rank that stopped alone would hang the others' all-reduce).
            # fired_at_ms, not state: a NaN step's alert may fire and resolve between polls.
            critical = any(a["severity"] == "critical" and a.get("fired_at_ms") is not None for a in alerts)
            flag = torch.tensor([1.0 if critical else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                stopped_at = step
                if rank == 0 and args.result_dir:
                    torch.save(model.state_dict(), Path(args.result_dir, "checkpoint.pt"))
                break
    stats = run.finish() if run is not None else {}
    faults.remove()
    dist.destroy_process_group()
    return {"rank": rank, "final_loss": float(loss.detach()), "step_times": step_times, "stats": stats, "alerts": alerts, "stopped_at": stopped_at, "skipped_steps": skipped, "flipped": faults.flipped}


def _worker(rank: int, args: argparse.Namespace) -> None:
    result = train(args)
    if args.result_dir:
        Path(args.result_dir, f"rank-{rank}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="processes to spawn when not under torchrun")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--run", default=None, help="run name (default: generated)")
    p.add_argument("--collector", default=None, help="collector URL (default: $RANKWATCH_COLLECTOR or http://127.0.0.1:7070)")
    p.add_argument("--mode", default="online", choices=["online", "offline", "disabled"])
    p.add_argument("--monitor", default="on", choices=["on", "off"])
    p.add_argument("--spool-dir", default=None)
    p.add_argument("--result-dir", default=None, help="write each rank's loss, step times and agent stats as JSON here")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=96)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--corpus", type=int, default=4096, help="sequences in the synthetic corpus")
    p.add_argument("--fault", action="append", default=[], help="KIND@STEP[:key=value...], see rankwatch_testkit.faults (repeatable)")
    p.add_argument("--cadence", action="append", default=[], help="probe cadence override, e.g. activations=5 (repeatable)")
    p.add_argument("--on-alert", default="record", choices=["record", "stop"], help="stop: checkpoint and stop all ranks on a critical alert")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step (to pace a demo)")
    args = p.parse_args(argv)
    check_faults(args.fault, p.error)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        result = train(args)
        if args.result_dir:
            Path(args.result_dir, f"rank-{result['rank']}.json").write_text(json.dumps(result))
        return
    spawn_ranks(_worker, args.nproc, args)


if __name__ == "__main__":
    main()
