"""A byte-level GPT trained on real text with DDP on CPU (gloo), streaming to rankwatch: the
harness the detection benchmark (`cargo xtask bench detection`) runs many times.

    python sdk-python/examples/train_text.py --nproc 4 --steps 2000 --run healthy-1
    python sdk-python/examples/train_text.py --nproc 4 --steps 2000 --switch 1000:reference --resume-at 1500

What makes it a realistic healthy run (rankwatch_testkit.text): a corpus cut from the Python
standard library (docstrings, the language reference, source code; no download), bytes as
tokens, a nanoGPT model, AdamW with linear warm-up and cosine decay, gradient clipping, and
optionally a data-mix switch part-way (`--switch STEP:SOURCE`), a checkpoint resume
(`--resume-at STEP`: every process exits after saving, and a new set of processes loads the
checkpoint and carries on under the same run name, as a restarted job does), per-rank file
sharding (`--sampling shard`), dropout, and the data-seed coupling of arXiv 2602.14462
(`--seed-mode same|rank0|per-rank`). Faults from `rankwatch_testkit.faults` (`--fault`)
make the unhealthy twins.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "testkit"))

from rankwatch_testkit.faults import Fault, Injector
from rankwatch_testkit.faults import check as check_faults
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig
from rankwatch_testkit.spawn import spawn_ranks
from rankwatch_testkit.text import SAMPLINGS, SEED_MODES, SOURCES, Windows, corpus, fingerprint, learning_rate, seed_for

import rankwatch


def _switch(text: str) -> tuple[int, str]:
    step, _, source = text.partition(":")
    if not step.isdigit() or source not in SOURCES:
        raise argparse.ArgumentTypeError(f"--switch {text!r}: expected STEP:SOURCE with SOURCE one of {', '.join(SOURCES)}")
    return int(step), source


def _ramp(text: str) -> tuple[int, float, int]:
    parts = text.split(":")
    try:
        step, factor, length = int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) > 2 else 100
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected STEP:FACTOR[:STEPS]") from None
    if step < 0 or factor <= 0 or length < 1 or len(parts) > 3:
        raise argparse.ArgumentTypeError(f"{text!r}: STEP ≥ 0, FACTOR > 0 and STEPS ≥ 1 expected")
    return step, factor, length


def ramp_factor(step: int, ramp: tuple[int, float, int] | None) -> float:
    """1 before the ramp's start, then rising linearly to its factor over its length."""
    if ramp is None or step < ramp[0]:
        return 1.0
    start, factor, length = ramp
    return 1.0 + (factor - 1.0) * min(1.0, (step - start + 1) / length)


def train(args: argparse.Namespace, first: int, last: int) -> dict[str, Any]:
    """Steps [first, last) of the job on this process's rank, resuming from the checkpoint when
    `first` > 0 and writing one when `last` < the job's length."""
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    seed = seed_for(args.seed, rank, args.seed_mode)
    torch.manual_seed(seed)  # dropout's stream: coupled across ranks as the data seed is
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = NanoGPTConfig(block_size=args.seq, vocab_size=256, n_layer=args.layers, n_head=args.heads, n_embd=args.width, dropout=args.dropout, bias=False, post_ln=args.post_ln)
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)  # the same initialisation everywhere (DDP broadcasts rank 0's anyway)
        model = NanoGPT(config)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    # Two groups so that --mlp-lr can move the MLPs' learning rate alone (the same optimizer
    # state either way: AdamW's state is per parameter).
    mlp = [p for n, p in model.named_parameters() if ".mlp." in n]
    rest = [p for n, p in model.named_parameters() if ".mlp." not in n]
    groups: list[dict[str, Any]] = [{"params": rest}, {"params": mlp, "mlp": True}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    faults = Injector([Fault.parse(f) for f in args.fault], rank)
    data_seed = faults.data_seed(seed)
    sources = {s: corpus(s, args.corpus_dir) for s in {args.source, *(s for _, s in args.switch)}}

    def windows(source: str, of: int = rank, seed: int = data_seed) -> Windows:
        return Windows(sources[source], rank=of, world=world, batch=args.batch, seq=args.seq, sampling=args.sampling, seed=seed)

    data = windows(args.source)
    # duplicate_data: the other rank's batches, drawn in step with its own generator.
    other = faults.duplicated_shard(world)
    shadow = None if other is None else windows(args.source, other, seed_for(args.seed, other, args.seed_mode))
    source = args.source
    checkpoint = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if first > 0:
        assert checkpoint is not None
        saved = torch.load(checkpoint / "model.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        source = saved["source"]
        data = windows(source)
        data.restore(torch.load(checkpoint / f"data-{rank}.pt", weights_only=False))
        if other is not None:  # the other rank's draws so far (one batch a step)
            shadow = windows(source, other, seed_for(args.seed, other, args.seed_mode))
            for _ in range(first):
                shadow.next()
    faults.attach(model, list(model.transformer.h), optimizer)
    run = None
    if args.monitor == "on":
        tags = {"example": "train_text", "lr": str(args.lr), "source": args.source, "sampling": args.sampling, "seed_mode": args.seed_mode}
        if args.fault:
            tags["faults"] = " ".join(args.fault)
        run = rankwatch.init(run=args.run, collector=args.collector, spool_dir=args.spool_dir, tags=tags, every={k: int(v) for k, v in (kv.split("=") for kv in args.cadence)} or None)
        run.watch(ddp, optimizer, spectral_budget=args.spectral_budget)
    losses: list[float] = []
    started = time.perf_counter()
    loss = torch.zeros(())
    for step in range(first, last):
        for at, new in args.switch:
            if step == at and new != source:
                source, state = new, data.state()
                data = windows(source)
                data.restore(state)
                if other is not None:
                    assert shadow is not None  # made whenever `other` is
                    their_state = shadow.state()
                    shadow = windows(source, other, seed_for(args.seed, other, args.seed_mode))
                    shadow.restore(their_state)
        faults.begin_step(step)
        lr = learning_rate(step, peak=args.lr, warmup=args.warmup, total=args.steps) * ramp_factor(step, args.lr_ramp)
        for group in optimizer.param_groups:
            group["lr"] = lr * (ramp_factor(step, args.mlp_lr) if group.get("mlp") else 1.0)
        x, y = data.next()
        if shadow is not None:
            theirs = shadow.next()
            if faults.reads_shard_of(world) is not None:
                x, y = theirs
        y = faults.targets(y)
        _, loss = ddp(x, y)
        loss = faults.loss(loss)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        faults.end_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if run is not None and faults.reporting():
            run.log(step, loss=loss.detach(), tokens=y.numel(), lr=lr)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - started
    if run is not None:
        run.finish()
    faults.remove()
    if last < (args.stop_at or args.steps) and checkpoint is not None:  # a later half follows
        checkpoint.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "source": source}, checkpoint / "model.pt")
        torch.save(data.state(), checkpoint / f"data-{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "first_step": first, "losses": losses, "seconds": seconds, "corpus": {s: fingerprint(d) for s, d in sources.items()}}


def _worker(rank: int, args: argparse.Namespace, first: int, last: int) -> None:
    result = train(args, first, last)
    if args.result_dir:
        Path(args.result_dir, f"rank-{rank}-from-{first}.json").write_text(json.dumps(result))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="processes (ranks) to spawn")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--stop-at", type=int, default=None, help="end after this many steps, the learning-rate schedule still spanning --steps (a run cut where nothing after matters)")
    p.add_argument("--run", default=None, help="run name (needed with --resume-at, so both halves are one run)")
    p.add_argument("--collector", default=None, help="collector URL (default: $RANKWATCH_COLLECTOR or http://127.0.0.1:7070)")
    p.add_argument("--monitor", default="on", choices=["on", "off"])
    p.add_argument("--spool-dir", default=None)
    p.add_argument("--result-dir", default=None, help="write each rank's losses and timing as JSON here")
    p.add_argument("--checkpoint-dir", default=None, help="where --resume-at saves and loads (default: under --result-dir)")
    p.add_argument("--corpus-dir", default=None, help="corpus cache (default ~/.cache/rankwatch/corpus)")
    p.add_argument("--source", default="docstrings", choices=SOURCES)
    p.add_argument("--switch", type=_switch, action="append", default=[], help="STEP:SOURCE: the data mix changes at STEP (repeatable)")
    p.add_argument("--sampling", default="uniform", choices=SAMPLINGS)
    p.add_argument("--seed-mode", default="per-rank", choices=SEED_MODES, help="how ranks' data and dropout seeds relate")
    p.add_argument("--resume-at", type=int, default=None, help="stop every process at STEP after a checkpoint, then restart from it")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--post-ln", action="store_true", help="post-LN blocks, x = LN(x + f(x)), instead of pre-LN")
    p.add_argument("--lr-ramp", type=_ramp, default=None, help="STEP:FACTOR[:STEPS]: from STEP the learning rate rises to FACTOR× the schedule's over STEPS (default 100)")
    p.add_argument("--mlp-lr", type=_ramp, default=None, help="STEP:FACTOR[:STEPS]: the same ramp for the MLPs' learning rate alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--fault", action="append", default=[], help="KIND@STEP[:key=value...], see rankwatch_testkit.faults (repeatable)")
    p.add_argument("--spectral-budget", type=float, default=0.01, help="share of step time the spectral probe may take (1 measures every layer at every call)")
    p.add_argument("--cadence", action="append", default=[], help="probe cadence override, e.g. activations=5 (repeatable)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    check_faults(args.fault, p.error)
    if args.stop_at is not None and not 0 < args.stop_at <= args.steps:
        p.error(f"--stop-at {args.stop_at} must be inside (0, --steps]")
    if args.resume_at is not None:
        if not 0 < args.resume_at < args.steps:
            p.error(f"--resume-at {args.resume_at} must be inside (0, --steps)")
        if not args.run:
            p.error("--resume-at needs --run, so both halves report to one run")
        if not (args.checkpoint_dir or args.result_dir):
            p.error("--resume-at needs --checkpoint-dir or --result-dir")
        args.checkpoint_dir = args.checkpoint_dir or str(Path(args.result_dir, "checkpoint"))
    if args.result_dir:
        Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    for s in {args.source, *(s for _, s in args.switch)}:
        corpus(s, args.corpus_dir)  # built once here, not by every rank at once
    halves = [(0, args.steps)] if args.resume_at is None else [(0, args.resume_at), (args.resume_at, args.steps)]
    stop = args.stop_at or args.steps
    for first, last in halves:
        if first >= stop:
            break
        last = min(last, stop)
        spawn_ranks(_worker, args.nproc, args, first, last)


if __name__ == "__main__":
    main()
