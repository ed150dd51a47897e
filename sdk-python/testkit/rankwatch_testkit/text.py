"""Real text without the internet: corpora cut from the Python standard library, byte-level.

Detection must be judged on training that looks like real training, and real language data
is what makes workers' losses and gradients disagree the way they do in practice (uneven
content, documents of different difficulty, a distribution that shifts). Every Python
installation carries several megabytes of English and code, so the corpora below need no
download and are the same on every machine with the same Python version:

* ``reference`` — the language reference's topic pages (``pydoc_data.topics``, ~0.5 MB of prose);
* ``docstrings`` — every module, class and function docstring of the standard library's pure
  Python sources (tests excluded), in path order (~1.8 MB: prose with code examples);
* ``code`` — the same sources as text (capped at 4 MB: a different distribution, for the
  data-mix switch).

Tokens are bytes (vocabulary 256): no tokenizer to train or ship, and what a byte-level model
learns first (spelling, indentation) is learned in a few hundred steps on a CPU.

Sampling, as real pipelines do it:

* ``uniform`` — every rank draws windows uniformly from the whole corpus with its own
  generator (the usual random sampler with a per-rank seed);
* ``shard`` — rank k draws only from its own contiguous 1/K of the corpus (file sharding):
  ranks see systematically different content, so their losses differ for good, healthily.

The seed that couples ranks is the rank's data seed (``seed_for``): the same on every rank
(identical batches: the bug of arXiv 2602.14462's first setting), different only on rank 0, or
different per rank (the correct setting).
"""

from __future__ import annotations

import ast
import hashlib
import math
import os
import sys
import sysconfig
from pathlib import Path

import torch

SOURCES = ("reference", "docstrings", "code")
SAMPLINGS = ("uniform", "shard")
SEED_MODES = ("per-rank", "same", "rank0")
CODE_CAP = 4 << 20


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _build(source: str) -> bytes:
    if source == "reference":
        import pydoc_data.topics as topics

        return "\n\n".join(topics.topics[k] for k in sorted(topics.topics)).encode()
    parts: list[str] = []
    size = 0
    for path in _stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if source == "code":
            parts.append(text)
            size += len(text)
            if size >= CODE_CAP:
                break
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    parts.append(doc)
    return "\n\n".join(parts).encode()[:CODE_CAP]


def corpus(source: str, cache_dir: str | os.PathLike[str] | None = None) -> torch.Tensor:
    """The corpus `source` as a uint8 tensor of bytes, built once and cached in `cache_dir`
    (default ``~/.cache/rankwatch/corpus``), keyed by the Python version that made it."""
    if source not in SOURCES:
        raise ValueError(f"unknown corpus {source!r}; expected one of {', '.join(SOURCES)}")
    cache = Path(cache_dir or Path.home() / ".cache" / "rankwatch" / "corpus")
    path = cache / f"{source}-py{sys.version_info[0]}.{sys.version_info[1]}.bin"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        data = _build(source)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)  # atomic: ranks building it at once each write their own copy
    data = path.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def fingerprint(data: torch.Tensor) -> str:
    """A short hash of a corpus, recorded with results (corpora differ between Python versions)."""
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:12]


def seed_for(seed: int, rank: int, mode: str) -> int:
    """Rank `rank`'s data (and dropout) seed under `mode`."""
    if mode == "per-rank":
        return seed * 1000 + rank
    if mode == "same":
        return seed * 1000
    if mode == "rank0":
        return seed * 1000 + (1 if rank == 0 else 0)
    raise ValueError(f"unknown seed mode {mode!r}; expected one of {', '.join(SEED_MODES)}")


class Windows:
    """Endless batches of (inputs, targets) windows of `seq` bytes from `data`, drawn by this
    rank's own generator; `state`/`restore` carry the generator across a checkpoint."""

    def __init__(self, data: torch.Tensor, *, rank: int, world: int, batch: int, seq: int, sampling: str, seed: int) -> None:
        if sampling not in SAMPLINGS:
            raise ValueError(f"unknown sampling {sampling!r}; expected one of {', '.join(SAMPLINGS)}")
        if sampling == "shard":
            size = len(data) // world
            data = data[rank * size : (rank + 1) * size]
        if len(data) <= seq + 1:
            raise ValueError(f"corpus of {len(data)} bytes is too small for windows of {seq}")
        self.data = data.long()
        self.batch = batch
        self.seq = seq
        self.offsets = torch.arange(seq + 1)
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - self.seq - 1, (self.batch,), generator=self.generator)
        # One gather for the whole batch (this runs every training step).
        windows = self.data[starts[:, None] + self.offsets]
        return windows[:, :-1], windows[:, 1:]

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def learning_rate(step: int, *, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up to `peak` over `warmup` steps, then cosine decay to `floor`·peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
