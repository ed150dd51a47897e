"""A zoo of transformer block layouts that no family table or name pattern of rankwatch knows.

Each is written the way its model family writes it (module names, fused projections and how
they are split, where the kv heads repeat, rotary embeddings, gating order), trimmed to what a
small language model needs. Every layout also says, from its own definition, which weight rows
are q, k, v, o, up, gate and down in (out, in) orientation (`Zoo.expected`): the truth layer
discovery is checked against, written independently of discovery.

Layouts:

* ``renamed_nanogpt``: nanoGPT with its names changed (`qkv`, `proj`, `fc`, `out`); fused qkv
  split along the features; hand-written causal softmax attention optional (`sdpa`).
* ``megatron``: Megatron-core names (`self_attention.linear_qkv`, `linear_proj`,
  `mlp.linear_fc1`, `linear_fc2`); the fused qkv is laid out per query group
  ([q heads of the group, k, v] × groups), so q, k and v are strided row sets; GQA; SwiGLU with
  gate and up fused in fc1 (gate first).
* ``olmo``: OLMo names (`att_proj`, `attn_out`, `ff_proj`, `ff_out`); fused qkv split by
  sizes; `x, gate = ff_proj(x).chunk(2)`: the gate is the *second* half; rotary.
* ``mpt``: MPT names (`attn.Wqkv`, `attn.out_proj`, `ffn.up_proj`, `ffn.down_proj`): the name
  table matches three of them, which used to give a silently partial map; attention written
  out by hand with a key layer norm.
* ``gqa_rotary``: grouped-query attention with rotate-half rotary embeddings, k and v fused
  in one projection, kv heads repeated with `repeat_interleave`; SwiGLU with three matrices.
* ``complex_rotary``: rotary as complex multiplication (`view_as_complex`, as torchtitan and
  Llama's reference code write it), SDPA with `enable_gqa`.
* ``handwritten``: softmax(Q Kᵀ) V by hand with the heads folded into the batch, a weight
  stored (in, out) and applied as `x @ W`.
* ``parallel``: attention and MLP in parallel from one norm (GPT-J, PaLM), GELU MLP.
* ``moe``: a top-2 mixture of 4 SwiGLU experts (a ModuleList) with a router, dense dispatch.
* ``rotary_args``: the model computes the rotary tables and the attention mask once and hands
  them to every block (`block(x, cos, sin, mask)`, no defaults, as torchtitan and Megatron do):
  a block that cannot run on its input alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

LAYOUTS = (
    "renamed_nanogpt", "megatron", "olmo", "mpt", "gqa_rotary", "complex_rotary", "handwritten", "parallel", "moe", "rotary_args",
)


@dataclass
class ZooConfig:
    layout: str = "renamed_nanogpt"
    vocab_size: int = 96
    width: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    block_size: int = 32
    experts: int = 4


def _causal(t: int, device: torch.device) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    scores = scores.masked_fill(~_causal(q.shape[-2], q.device), float("-inf"))
    return F.softmax(scores, dim=-1) @ v


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class _Rotary(nn.Module):
    cos: torch.Tensor  # buffers, registered below
    sin: torch.Tensor

    def __init__(self, head_dim: int, block_size: int) -> None:
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(block_size).float(), inv)
        emb = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, H, T, D]
        t = x.shape[-2]
        return x * self.cos[:t] + _rotate_half(x) * self.sin[:t]


# --------------------------------------------------------------------------------------------
# Blocks.


class RenamedNanoGPTBlock(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln1, self.ln2 = nn.LayerNorm(c.width), nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.fc = nn.Linear(c.width, 4 * c.width)
        self.out = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))

    @staticmethod
    def expected(block: RenamedNanoGPTBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        w = c.width
        qkv = block.qkv.weight
        return {"q": qkv[:w], "k": qkv[w : 2 * w], "v": qkv[2 * w :], "o": block.proj.weight, "up": block.fc.weight, "down": block.out.weight}


class _MegatronAttention(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads, self.groups, self.dim = c.heads, c.kv_heads, c.width // c.heads
        per_group = (c.heads // c.kv_heads + 2) * self.dim
        self.linear_qkv = nn.Linear(c.width, c.kv_heads * per_group, bias=False)
        self.linear_proj = nn.Linear(c.heads * self.dim, c.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        per = self.heads // self.groups
        mixed = self.linear_qkv(x).view(b, t, self.groups, (per + 2) * self.dim)
        q, k, v = torch.split(mixed, [per * self.dim, self.dim, self.dim], dim=3)
        q = q.reshape(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = (z.transpose(1, 2) for z in (k, v))  # [B, groups, T, D]
        k, v = (z.repeat_interleave(per, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(y.transpose(1, 2).reshape(b, t, -1))


class _MegatronMLP(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(c.width, 2 * 3 * c.width, bias=False)
        self.linear_fc2 = nn.Linear(3 * c.width, c.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(self.linear_fc1(x), 2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


class MegatronBlock(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(c.width)
        self.self_attention = _MegatronAttention(c)
        self.pre_mlp_layernorm = nn.LayerNorm(c.width)
        self.mlp = _MegatronMLP(c)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states))
        return hidden_states + self.mlp(self.pre_mlp_layernorm(hidden_states))

    @staticmethod
    def expected(block: MegatronBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        a = block.self_attention
        d, per = a.dim, a.heads // a.groups
        grouped = a.linear_qkv.weight.view(a.groups, (per + 2) * d, c.width)
        fc1 = block.mlp.linear_fc1.weight
        half = fc1.shape[0] // 2
        return {
            "q": grouped[:, : per * d].reshape(-1, c.width),
            "k": grouped[:, per * d : (per + 1) * d].reshape(-1, c.width),
            "v": grouped[:, (per + 1) * d :].reshape(-1, c.width),
            "o": a.linear_proj.weight,
            "gate": fc1[:half],
            "up": fc1[half:],
            "down": block.mlp.linear_fc2.weight,
        }


class OLMoBlock(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads, self.dim = c.heads, c.width // c.heads
        self.attn_norm, self.ff_norm = nn.LayerNorm(c.width, bias=False), nn.LayerNorm(c.width, bias=False)
        self.fused_dims = (c.width, c.width, c.width)
        self.att_proj = nn.Linear(c.width, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(c.width, c.width, bias=False)
        self.ff_proj = nn.Linear(c.width, 2 * 2 * c.width, bias=False)
        self.ff_out = nn.Linear(2 * c.width, c.width, bias=False)
        self.rotary_emb = _Rotary(self.dim, c.block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.att_proj(self.attn_norm(x)).split(self.fused_dims, dim=-1)
        q, k, v = (z.view(b, t, self.heads, self.dim).transpose(1, 2) for z in (q, k, v))
        q, k = self.rotary_emb(q), self.rotary_emb(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(b, t, c))
        h, gate = self.ff_proj(self.ff_norm(x)).chunk(2, dim=-1)
        return x + self.ff_out(F.silu(gate) * h)

    @staticmethod
    def expected(block: OLMoBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        w = c.width
        att, ff = block.att_proj.weight, block.ff_proj.weight
        half = ff.shape[0] // 2
        return {
            "q": att[:w], "k": att[w : 2 * w], "v": att[2 * w :], "o": block.attn_out.weight,
            "up": ff[:half], "gate": ff[half:], "down": block.ff_out.weight,
        }


class _MPTAttention(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.Wqkv = nn.Linear(c.width, 3 * c.width)
        self.k_ln = nn.LayerNorm(c.width)
        self.out_proj = nn.Linear(c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.Wqkv(x).chunk(3, dim=2)
        k = self.k_ln(k)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).permute(0, 2, 1, 3) for z in (q, k, v))
        y = _softmax_attention(q, k, v)
        return self.out_proj(y.permute(0, 2, 1, 3).reshape(b, t, c))


class _MPTFFN(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(c.width, 4 * c.width)
        self.act = nn.GELU(approximate="none")
        self.down_proj = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class MPTBlock(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(c.width), nn.LayerNorm(c.width)
        self.attn = _MPTAttention(c)
        self.ffn = _MPTFFN(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.ffn(self.norm_2(x))

    @staticmethod
    def expected(block: MPTBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        w = c.width
        qkv = block.attn.Wqkv.weight
        return {
            "q": qkv[:w], "k": qkv[w : 2 * w], "v": qkv[2 * w :], "o": block.attn.out_proj.weight,
            "up": block.ffn.up_proj.weight, "down": block.ffn.down_proj.weight,
        }


class GQARotaryBlock(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = c.heads, c.kv_heads, c.width // c.heads
        self.norm_a, self.norm_b = nn.RMSNorm(c.width), nn.RMSNorm(c.width)
        self.proj_q = nn.Linear(c.width, c.heads * self.dim, bias=False)
        self.proj_kv = nn.Linear(c.width, 2 * c.kv_heads * self.dim, bias=False)
        self.proj_back = nn.Linear(c.heads * self.dim, c.width, bias=False)
        self.rope = _Rotary(self.dim, c.block_size)
        self.w_a = nn.Linear(c.width, 3 * c.width, bias=False)  # gate
        self.w_b = nn.Linear(c.width, 3 * c.width, bias=False)  # up
        self.w_c = nn.Linear(3 * c.width, c.width, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm_a(x)
        q = self.proj_q(h).view(b, t, self.heads, self.dim).transpose(1, 2)
        k, v = self.proj_kv(h).view(b, t, 2, self.kv_heads, self.dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.rope(q), self.rope(k)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj_back(y.transpose(1, 2).reshape(b, t, -1))
        h = self.norm_b(x)
        return x + self.w_c(F.silu(self.w_a(h)) * self.w_b(h))

    @staticmethod
    def expected(block: GQARotaryBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        kv = block.proj_kv.weight
        half = kv.shape[0] // 2
        return {
            "q": block.proj_q.weight, "k": kv[:half], "v": kv[half:], "o": block.proj_back.weight,
            "gate": block.w_a.weight, "up": block.w_b.weight, "down": block.w_c.weight,
        }


class ComplexRotaryBlock(nn.Module):
    freqs: torch.Tensor  # a buffer, registered in __init__

    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = c.heads, c.kv_heads, c.width // c.heads
        self.pre, self.post = nn.RMSNorm(c.width), nn.RMSNorm(c.width)
        self.to_queries = nn.Linear(c.width, c.heads * self.dim, bias=False)
        self.to_keys = nn.Linear(c.width, c.kv_heads * self.dim, bias=False)
        self.to_values = nn.Linear(c.width, c.kv_heads * self.dim, bias=False)
        self.to_residual = nn.Linear(c.heads * self.dim, c.width, bias=False)
        self.expand = nn.Linear(c.width, 2 * c.width, bias=False)
        self.squeeze = nn.Linear(2 * c.width, c.width, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))
        self.register_buffer("freqs", torch.polar(torch.ones(c.block_size, self.dim // 2), torch.outer(torch.arange(c.block_size).float(), inv)), persistent=False)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D]
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        turned = pairs * self.freqs[: x.shape[1]].view(1, x.shape[1], 1, -1)
        return torch.view_as_real(turned).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.pre(x)
        q = self._rotate(self.to_queries(h).view(b, t, self.heads, self.dim)).transpose(1, 2)
        k = self._rotate(self.to_keys(h).view(b, t, self.kv_heads, self.dim)).transpose(1, 2)
        v = self.to_values(h).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.to_residual(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.squeeze(F.relu(self.expand(self.post(x))).square())

    @staticmethod
    def expected(block: ComplexRotaryBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        return {
            "q": block.to_queries.weight, "k": block.to_keys.weight, "v": block.to_values.weight,
            "o": block.to_residual.weight, "up": block.expand.weight, "down": block.squeeze.weight,
        }


class HandwrittenBlock(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads, self.dim = c.heads, c.width // c.heads
        self.n1, self.n2 = nn.LayerNorm(c.width), nn.LayerNorm(c.width)
        self.lin_q = nn.Linear(c.width, c.width)
        self.lin_k = nn.Linear(c.width, c.width)
        # Stored (in, out) and applied as x @ W, as some research code does.
        self.value_weight = nn.Parameter(torch.randn(c.width, c.width) / math.sqrt(c.width))
        self.merge = nn.Linear(c.width, c.width)
        self.grow = nn.Linear(c.width, 4 * c.width)
        self.shrink = nn.Linear(4 * c.width, c.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.n1(x)

        def fold(z: torch.Tensor) -> torch.Tensor:  # heads into the batch: [B*H, T, D]
            return z.view(b, t, self.heads, self.dim).transpose(1, 2).reshape(b * self.heads, t, self.dim)

        q, k, v = fold(self.lin_q(h)), fold(self.lin_k(h)), fold(h @ self.value_weight)
        y = _softmax_attention(q, k, v).view(b, self.heads, t, self.dim).transpose(1, 2).reshape(b, t, c)
        x = x + self.merge(y)
        return x + self.shrink(torch.tanh(self.grow(self.n2(x))))

    @staticmethod
    def expected(block: HandwrittenBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        return {
            "q": block.lin_q.weight, "k": block.lin_k.weight, "v": block.value_weight.t(), "o": block.merge.weight,
            "up": block.grow.weight, "down": block.shrink.weight,
        }


class ParallelBlock(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.norm = nn.LayerNorm(c.width)
        self.mix = nn.ModuleDict({"in_proj": nn.Linear(c.width, 3 * c.width, bias=False), "out": nn.Linear(c.width, c.width, bias=False)})
        self.ff = nn.ModuleDict({"expand": nn.Linear(c.width, 4 * c.width), "contract": nn.Linear(4 * c.width, c.width)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = self.norm(x)
        # Per-head interleaved [q_h, k_h, v_h] like GPT-NeoX.
        fused = self.mix["in_proj"](h).view(b, t, self.heads, 3 * (c // self.heads))
        q, k, v = (z.transpose(1, 2) for z in fused.chunk(3, dim=-1))
        attn = self.mix["out"](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + attn + self.ff["contract"](F.gelu(self.ff["expand"](h), approximate="tanh"))

    @staticmethod
    def expected(block: ParallelBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        d = c.width // c.heads
        per_head = cast(nn.Linear, block.mix["in_proj"]).weight.view(c.heads, 3, d, c.width)
        return {
            "q": per_head[:, 0].reshape(-1, c.width), "k": per_head[:, 1].reshape(-1, c.width),
            "v": per_head[:, 2].reshape(-1, c.width), "o": cast(nn.Linear, block.mix["out"]).weight,
            "up": cast(nn.Linear, block.ff["expand"]).weight, "down": cast(nn.Linear, block.ff["contract"]).weight,
        }


class _Expert(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate_w = nn.Linear(width, 2 * width, bias=False)
        self.up_w = nn.Linear(width, 2 * width, bias=False)
        self.down_w = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_w(F.silu(self.gate_w(x)) * self.up_w(x))


class MoEBlock(nn.Module):
    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.ln_attn, self.ln_moe = nn.LayerNorm(c.width), nn.LayerNorm(c.width)
        self.attention = nn.ModuleDict({"qkv": nn.Linear(c.width, 3 * c.width), "dense": nn.Linear(c.width, c.width)})
        self.router = nn.Linear(c.width, c.experts, bias=False)
        self.experts = nn.ModuleList([_Expert(c.width) for _ in range(c.experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attention["qkv"](self.ln_attn(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention["dense"](y.transpose(1, 2).reshape(b, t, c))
        h = self.ln_moe(x)
        probs = F.softmax(self.router(h), dim=-1)
        top, chosen = probs.topk(2, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
        # Dense dispatch: every expert sees every token, weighted (zero where not chosen).
        mixed = sum(weights[..., e : e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return x + mixed

    @staticmethod
    def expected(block: MoEBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        w = c.width
        qkv = cast(nn.Linear, block.attention["qkv"]).weight.view(3, w, w)
        stack: Callable[[str], torch.Tensor] = lambda name: torch.stack([getattr(e, name).weight for e in block.experts])  # noqa: E731
        return {
            "q": qkv[0], "k": qkv[1], "v": qkv[2], "o": cast(nn.Linear, block.attention["dense"]).weight,
            "gate": stack("gate_w"), "up": stack("up_w"), "down": stack("down_w"),
        }


class RotaryArgsBlock(nn.Module):
    takes_tables = True

    def __init__(self, c: ZooConfig) -> None:
        super().__init__()
        self.heads, self.dim = c.heads, c.width // c.heads
        self.norm1, self.norm2 = nn.RMSNorm(c.width), nn.RMSNorm(c.width)
        self.wqkv = nn.Linear(c.width, 3 * c.width, bias=False)
        self.wout = nn.Linear(c.width, c.width, bias=False)
        self.lin_in = nn.Linear(c.width, 3 * c.width, bias=False)
        self.lin_out = nn.Linear(3 * c.width, c.width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.wqkv(self.norm1(x)).view(b, t, 3, self.heads, self.dim).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.wout(y.transpose(1, 2).reshape(b, t, c))
        return x + self.lin_out(F.gelu(self.lin_in(self.norm2(x))))

    @staticmethod
    def expected(block: RotaryArgsBlock, c: ZooConfig) -> dict[str, torch.Tensor]:
        w = c.width
        qkv = block.wqkv.weight.view(3, w, w)
        return {"q": qkv[0], "k": qkv[1], "v": qkv[2], "o": block.wout.weight, "up": block.lin_in.weight, "down": block.lin_out.weight}


BLOCKS: dict[str, type[nn.Module]] = {
    "renamed_nanogpt": RenamedNanoGPTBlock,
    "megatron": MegatronBlock,
    "olmo": OLMoBlock,
    "mpt": MPTBlock,
    "gqa_rotary": GQARotaryBlock,
    "complex_rotary": ComplexRotaryBlock,
    "handwritten": HandwrittenBlock,
    "parallel": ParallelBlock,
    "moe": MoEBlock,
    "rotary_args": RotaryArgsBlock,
}

# Heads and kv heads each layout's attention has (the truth for `AttentionShape`).
KV_HEADS = {"megatron": True, "gqa_rotary": True, "complex_rotary": True}


class ZooModel(nn.Module):
    """A language model of `config.layers` blocks of one layout: `embedding`, `trunk`, `final`,
    `unembed`. Names chosen to match no pattern of rankwatch's generic table."""

    def __init__(self, config: ZooConfig) -> None:
        super().__init__()
        if config.layout not in BLOCKS:
            raise ValueError(f"unknown layout {config.layout!r}; one of {sorted(BLOCKS)}")
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.width)
        self.trunk = nn.ModuleList([BLOCKS[config.layout](config) for _ in range(config.layers)])
        self.final = nn.LayerNorm(config.width)
        self.unembed = nn.Linear(config.width, config.vocab_size, bias=False)
        self.rotary = _Rotary(config.width // config.heads, config.block_size)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embedding(idx)
        t = idx.shape[1]
        tables = (self.rotary.cos[:t], self.rotary.sin[:t], _causal(t, idx.device))
        for block in self.trunk:
            x = block(x, *tables) if getattr(block, "takes_tables", False) else block(x)
        logits = self.unembed(self.final(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def expected(self, index: int) -> dict[str, torch.Tensor]:
        """The (out, in) weight of each site of block `index`, from the layout's own definition."""
        block = self.trunk[index]
        # Each layout's block class has a static expected(block, config); nn.Module has none.
        return type(block).expected(block, self.config)  # type: ignore[attr-defined]

    def first_block_call(self) -> Any:
        """The first block's arguments at a real forward (2 × 12 tokens), as a watching run
        captures them (`rankwatch.structure.capture_call`)."""
        from rankwatch.structure import capture_call

        calls: list[Any] = []
        handle = self.trunk[0].register_forward_pre_hook(lambda _m, args, kwargs: calls.append(capture_call(args, kwargs)), with_kwargs=True)
        tokens = torch.randint(0, self.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
        try:
            with torch.no_grad():
                self(tokens)
        finally:
            handle.remove()
        return calls[0]

    def layout(self, of: nn.Module | None = None) -> Any:
        """rankwatch's discovery of this model (or of `of`, a wrapper of it such as its compiled
        form), on the first block's real call where the block wants more than its input."""
        from rankwatch.discovery import discover
        from rankwatch.structure import NeedsCall

        target = self if of is None else of
        try:
            return discover(target)
        except NeedsCall:
            return discover(target, call=self.first_block_call())

    def attention_shape(self) -> tuple[int, int, int]:
        c = self.config
        kv = c.kv_heads if KV_HEADS.get(c.layout) else c.heads
        return c.heads, kv, c.width // c.heads
