"""A training script that knows nothing of rankwatch, to watch without changing it:

    rankwatch run --run plain -- torchrun --nproc_per_node 2 train_plain.py --steps 200
    torchrun --nproc_per_node 2 train_plain.py --steps 1000 --step-delay 0.2 &   # then:
    rankwatch attach --pid $!

`cargo xtask demo --attach` and the zero-code tests (sdk-python/tests/test_attach.py) use it.

A small GPT-2 (Hugging Face classes from a config, random init) on random tokens, under
DistributedDataParallel when started by torchrun (gloo; with --fsdp2, sharded by FSDP2's
`fully_shard` on every block and the model instead), AdamW, 0.. --steps optimizer steps,
optionally with gradient accumulation. Deterministic: the same arguments give bit-identical
parameters. Rank 0 writes them to --out at the end. With --pause-at K it stops before step K
until the file --resume exists, polling in Python (a process sleeping in C would run no
injected code), and writes --paused when it gets there, so a test can attach at a known step.

    python train_plain.py --steps 30 --out params.pt [--accumulation 2] [--fsdp2] [--pause-at 10 --paused F --resume G]

With --zoo LAYOUT the model is one of the test kit's block layouts that no family table of
rankwatch knows (`rankwatch_testkit.zoo`: megatron, olmo, mpt, ...) instead of GPT-2; with
--compile it is `torch.compile`d before DDP wraps it, as nanoGPT does.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
import transformers


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--accumulation", type=int, default=1)
    p.add_argument("--out", type=Path)
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--paused", type=Path)
    p.add_argument("--resume", type=Path)
    p.add_argument("--fsdp2", action="store_true", help="shard with FSDP2 instead of DDP (under torchrun)")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds of Python-level waiting after each step")
    p.add_argument("--zoo", help="a block layout of rankwatch_testkit.zoo instead of GPT-2")
    p.add_argument("--compile", action="store_true", help="torch.compile the model before DDP wraps it")
    args = p.parse_args()
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    torch.manual_seed(0)
    model: torch.nn.Module
    if args.zoo:
        from rankwatch_testkit.zoo import ZooConfig, ZooModel

        model = ZooModel(ZooConfig(layout=args.zoo, vocab_size=96))
    else:
        config = transformers.GPT2Config(vocab_size=96, bos_token_id=0, eos_token_id=0, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    # torch.compile of a module is a module (OptimizedModule); its stub says only Callable.
    trained: torch.nn.Module = cast(torch.nn.Module, torch.compile(model)) if args.compile else model
    if distributed and args.fsdp2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        # A ZooModel (--zoo) keeps its blocks in `trunk`, a GPT2LMHeadModel in `transformer.h`.
        for block in cast(torch.nn.ModuleList, model.trunk if args.zoo else cast(transformers.GPT2LMHeadModel, model).transformer.h):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif distributed:
        trained = torch.nn.parallel.DistributedDataParallel(trained)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        if step == args.pause_at:
            if args.paused is not None:
                args.paused.write_text(str(os.getpid()))
            while args.resume is not None and not args.resume.exists():
                time.sleep(0.02)
        for _ in range(args.accumulation):
            x = torch.randint(0, 96, (4, 16), generator=data)
            if args.zoo:
                loss = trained(x, torch.roll(x, -1, 1))[1]
            else:
                loss = trained(input_ids=x, labels=x).loss
            (loss / args.accumulation).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        deadline = time.monotonic() + args.step_delay
        while time.monotonic() < deadline:
            time.sleep(0.01)
        print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
    # Sharded parameters are gathered whole (a collective: every rank takes part).
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}
    if rank == 0 and args.out is not None:
        torch.save(state, args.out)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
