"""A small nanoGPT-style language model, for examples and tests.

This is a faithful, trimmed re-implementation of the `GPT` class in Andrej Karpathy's nanoGPT
`model.py`: the same module names and structure (`transformer.wte`, `transformer.wpe`,
`transformer.h[i].attn.c_attn` as one fused `nn.Linear(C, 3C)` whose output splits into q, k, v
in that order, `attn.c_proj`, `mlp.c_fc`, `mlp.c_proj`, `transformer.ln_f`, a tied `lm_head`), so
that layer discovery is exercised on exactly the layout nanoGPT users have. What was left out is
what rankwatch does not need: checkpoint loading from GPT-2, the optimizer factory, MFU
estimation and generation.

Two deliberate differences: `forward` always returns logits for every position (nanoGPT returns
only the last position when no targets are given), and it accepts an optional `attention_mask`
([batch, seq], 1 = real token) that is used only to leave padded positions out of the loss —
attention stays purely causal, so with right padding real tokens never see padding anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast, overload

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class NanoGPTConfig:
    block_size: int = 64
    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    dropout: float = 0.0
    bias: bool = True
    # Post-LN blocks (the original Transformer's x = LN(x + f(x))) instead of nanoGPT's pre-LN;
    # deep post-LN stacks trained without warm-up are a classic natural collapse.
    post_ln: bool = False


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's cannot switch the bias off alone)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        head_size = channels // self.n_head
        q = q.view(batch, seq, self.n_head, head_size).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, head_size).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, head_size).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.post_ln = config.post_ln

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_ln:
            x = self.ln_1(x + self.attn(x))
            return self.ln_2(x + self.mlp(x))
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


if TYPE_CHECKING:
    from collections.abc import Iterator

    # What `NanoGPT.transformer` holds, for mypy: a ModuleDict's attributes are `Tensor | Module`
    # to it, and a ModuleList's items `Module`.

    class _Blocks(nn.ModuleList):
        def __iter__(self) -> Iterator[Block]: ...
        @overload
        def __getitem__(self, idx: slice) -> _Blocks: ...
        @overload
        def __getitem__(self, idx: int) -> Block: ...
        def __getitem__(self, idx: int | slice) -> Block | _Blocks: ...

    class _Transformer(nn.ModuleDict):
        wte: nn.Embedding
        wpe: nn.Embedding
        drop: nn.Dropout
        h: _Blocks
        ln_f: LayerNorm


class NanoGPT(nn.Module):
    def __init__(self, config: NanoGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = cast("_Transformer", nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            )
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying, as in nanoGPT.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # nanoGPT's scaled init of the residual projections (GPT-2 paper).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (logits [batch, seq, vocab], mean token cross-entropy or None)."""
        _, seq = idx.size()
        if seq > self.config.block_size:
            raise ValueError(f"sequence of length {seq} exceeds block_size {self.config.block_size}")
        pos = torch.arange(0, seq, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            if attention_mask is not None:
                targets = targets.masked_fill(attention_mask == 0, -1)
            loss = F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1
            )
        return logits, loss
