"""One rank of tests/test_ddp_consistency.py (run as a plain process with torchrun's env vars).

Trains nothing: it runs three DDP forward/backward passes with the rankwatch probes installed,
and next to each one recomputes every reported quantity by brute force on an unwrapped copy of
the model — full local gradients gathered from all ranks in float64, activations by calling the
blocks by hand — and writes both to JSON for the test to compare.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rankwatch  # noqa: E402
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig  # noqa: E402


def main() -> None:
    out_dir, spool = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    config = NanoGPTConfig(block_size=16, vocab_size=50, n_layer=3, n_head=2, n_embd=32, dropout=0.0, bias=True)
    model = NanoGPT(config)
    reference = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    run = rankwatch.init(run="ddp-check", mode="offline", spool_dir=spool, every={"activations": 1, "spectral": 0, "sketch": 0, "dot": 1})
    run.watch(ddp)
    gen = torch.Generator().manual_seed(100 + rank)
    records = []
    for step in range(3):
        # Rank-specific data, and on rank 3 a different distribution: cosines must differ.
        x = torch.randint(0, 50 if rank != 3 else 10, (4, 16), generator=gen)
        y = torch.roll(x, -1, dims=1)
        ddp.zero_grad(set_to_none=True)
        _, loss = ddp(x, y)
        loss.backward()
        run.log(step, loss=loss.detach())

        reference.zero_grad(set_to_none=True)
        _, ref_loss = reference(x, y)
        ref_loss.backward()
        g = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in reference.parameters()]).double()
        gathered = [torch.zeros_like(g) for _ in range(world)]
        dist.all_gather(gathered, g)
        g_bar = torch.stack(gathered).mean(0)
        expected = {
            "grad_norm": g.norm().item(),
            "grad_norm_mean": g_bar.norm().item(),
            "cos_to_mean": (g @ g_bar / (g.norm() * g_bar.norm())).item(),
            "loss": ref_loss.item(),
        }
        with torch.no_grad():
            t = reference.transformer
            emb = t.wte(x)
            h = emb + t.wpe(torch.arange(16))
            expected_act = {"embed/None": emb.abs().max().item()}
            for i, block in enumerate(t.h):
                attn = block.attn(block.ln_1(h))
                mlp = block.mlp(block.ln_2(h + attn))
                h = h + attn + mlp
                expected_act[f"residual/{i}"] = h.abs().max().item()
                expected_act[f"attn_out/{i}"] = attn.abs().max().item()
                expected_act[f"mlp_out/{i}"] = mlp.abs().max().item()
            expected_act["final_norm/None"] = t.ln_f(h).abs().max().item()
        got = {k[0]: v for k, v in run.last_values.items() if k[1] is None and k[2] is None}
        got_act = {f"{k[2]}/{k[1]}": v for k, v in run.last_values.items() if k[0] == "act_max"}
        records.append({"step": step, "expected": expected, "got": got, "expected_act": expected_act, "got_act": got_act})
        # Parameters must not move between the DDP model and the reference: no optimizer step.
    run.finish(timeout=5)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(records))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
