"""A small GPT trained with DDP on CPU (gloo), several processes, streaming to rankwatch.

    python sdk-python/examples/train_ddp.py --nproc 4 --steps 200 --collector http://127.0.0.1:7070
    torchrun --nproc-per-node 4 sdk-python/examples/train_ddp.py --steps 200   # same, via torchrun

The data is a synthetic "language": token sequences from a fixed random bigram table, so the
loss falls quickly and visibly. Every rank reads its own shard (a different generator seed per
rank), exactly as a DistributedSampler would give it. `--monitor off` runs the same job without
rankwatch, for overhead comparisons (`cargo xtask bench sdk`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rankwatch  # noqa: E402
from rankwatch.models import NanoGPT, NanoGPTConfig  # noqa: E402


def bigram_batches(rank: int, batch: int, seq: int, vocab: int, seed: int):
    """An endless stream of (inputs, targets) from a fixed bigram table; rank-specific order."""
    table_gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=table_gen) * 3.0
    probs = torch.softmax(logits, dim=-1)
    gen = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    while True:
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for t in range(seq):
            tokens[:, t + 1] = torch.multinomial(probs[tokens[:, t]], 1, generator=gen).squeeze(1)
        yield tokens[:, :-1], tokens[:, 1:]


def train(args: argparse.Namespace) -> dict:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = NanoGPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers, n_head=4, n_embd=args.width, dropout=0.0, bias=False)
    model = NanoGPT(config)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    run = None
    if args.monitor == "on":
        run = rankwatch.init(run=args.run, collector=args.collector, mode=args.mode, spool_dir=args.spool_dir, tags={"example": "train_ddp", "lr": str(args.lr)})
        run.watch(ddp, optimizer)
    data = bigram_batches(rank, args.batch, args.seq, args.vocab, args.seed)
    step_times = []
    for step in range(args.steps):
        x, y = next(data)
        started = time.perf_counter()
        _, loss = ddp(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if run is not None:
            run.log(step, loss=loss.detach(), tokens=y.numel(), lr=args.lr)
        step_times.append(time.perf_counter() - started)
    stats = run.finish() if run is not None else {}
    dist.destroy_process_group()
    return {"rank": rank, "final_loss": float(loss.detach()), "step_times": step_times, "stats": stats}


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
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
    args = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        result = train(args)
        if args.result_dir:
            Path(args.result_dir, f"rank-{result['rank']}.json").write_text(json.dumps(result))
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args, port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
