"""Hugging Face decoders with Llama-like attention (separate q/k/v/o projections, or Phi-3's fused
qkv_proj) and dense gated, fused gate/up (Phi-3) or mixture-of-experts MLPs: one table of
`config.model_type` → layout spec, one reader for them all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..layout import AttentionShape, Block, DiscoveryError, Layout, MatrixAccessor, weight_of
from .common import blocks_of, config_int, get_path, linear, linear_rows, need, param, setting, shape_from_rows, sliced_param, stacked
from .registry import Family


@dataclass(frozen=True)
class _DecoderSpec:
    attention: str  # "separate" (q/k/v/o_proj) or "fused_qkv" (Phi-3 qkv_proj)
    mlp: str  # "gated", "fused_gate_up" (Phi-3) or "moe" (dense gated layers allowed too)


_DECODER_FAMILIES: dict[str, tuple[str, _DecoderSpec]] = {
    "llama": ("llama", _DecoderSpec("separate", "gated")),
    "mistral": ("mistral", _DecoderSpec("separate", "gated")),
    "qwen2": ("qwen2", _DecoderSpec("separate", "gated")),
    "qwen3": ("qwen3", _DecoderSpec("separate", "gated")),
    "gemma": ("gemma", _DecoderSpec("separate", "gated")),
    "phi3": ("phi3", _DecoderSpec("fused_qkv", "fused_gate_up")),
    "mixtral": ("mixtral", _DecoderSpec("separate", "moe")),
    "qwen2_moe": ("qwen2_moe", _DecoderSpec("separate", "moe")),
    "qwen3_moe": ("qwen3_moe", _DecoderSpec("separate", "moe")),
}


def _decoder_attention(block: nn.Module, config: Any, family: str, spec: _DecoderSpec, where: str) -> tuple[dict[str, MatrixAccessor], AttentionShape, nn.Module]:
    attn = need(block, "self_attn", family, where)
    o_proj = need(attn, "o_proj", family, where + ".self_attn")
    head_dim = getattr(attn, "head_dim", None) or config_int(config, "head_dim") or config.hidden_size // config.num_attention_heads
    if spec.attention == "separate":
        q = need(attn, "q_proj", family, where + ".self_attn")
        k = need(attn, "k_proj", family, where + ".self_attn")
        v = need(attn, "v_proj", family, where + ".self_attn")
        shape = shape_from_rows(head_dim, weight_of(q).shape[0], weight_of(k).shape[0], family, where)
        matrices = {"q": linear(q), "k": linear(k), "v": linear(v)}
    else:
        # Phi-3: qkv_proj output is [q (n_heads*hd) | k (n_kv*hd) | v (n_kv*hd)] (Phi3Attention).
        qkv = need(attn, "qkv_proj", family, where + ".self_attn")
        n_heads = config.num_attention_heads
        n_kv = config_int(config, "num_key_value_heads") or n_heads
        q_rows, kv_rows = n_heads * head_dim, n_kv * head_dim
        if weight_of(qkv).shape[0] != q_rows + 2 * kv_rows:
            raise DiscoveryError(f"{family} layout: qkv_proj has {weight_of(qkv).shape[0]} outputs, expected {q_rows} + 2*{kv_rows} in {where}")
        shape = AttentionShape(n_heads, n_kv, head_dim)
        matrices = {
            "q": linear_rows(qkv, 0, q_rows),
            "k": linear_rows(qkv, q_rows, q_rows + kv_rows),
            "v": linear_rows(qkv, q_rows + kv_rows, q_rows + 2 * kv_rows),
        }
    matrices["o"] = linear(o_proj)
    return matrices, shape, attn


def _moe_experts(experts: nn.Module, family: str, where: str) -> tuple[dict[str, MatrixAccessor], int]:
    """Routed experts as (E, out, in) accessors, for 3-D parameter and ModuleList storage."""
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3:
        # transformers >= 5: gate_up_proj [E, 2I, H], down_proj [E, H, I]; forward does
        # `gate, up = linear(x, gate_up_proj[e]).chunk(2)`: the gate is the first half. The
        # @use_experts_implementation decorator records other storages in attributes.
        transposed = bool(getattr(experts, "is_transposed", False))
        concatenated = bool(getattr(experts, "is_concatenated", True))
        n_experts = gate_up.shape[0]
        width = gate_up.shape[-1] if transposed else gate_up.shape[1]
        half = width // 2
        gate_part = slice(0, half) if concatenated else slice(0, None, 2)
        up_part = slice(half, width) if concatenated else slice(1, None, 2)
        return (
            {
                "up": sliced_param(experts, "gate_up_proj", up_part, transposed),
                "gate": sliced_param(experts, "gate_up_proj", gate_part, transposed),
                "down": param(experts, "down_proj", transposed),
            },
            n_experts,
        )
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        first = experts[0]
        members = list(experts)
        if all(hasattr(first, n) for n in ("gate_proj", "up_proj", "down_proj")):
            names = {"up": "up_proj", "gate": "gate_proj", "down": "down_proj"}
        elif all(hasattr(first, n) for n in ("w1", "w2", "w3")):
            # Mixtral (transformers < 5): w1 = gate, w3 = up, w2 = down.
            names = {"up": "w3", "gate": "w1", "down": "w2"}
        else:
            raise DiscoveryError(f"{family} layout: unrecognised expert module in {where}")
        return {site: stacked(members, attr) for site, attr in names.items()}, len(members)
    raise DiscoveryError(f"{family} layout: no expert weights found in {where}")


def _decoder_mlp(block: nn.Module, family: str, spec: _DecoderSpec, where: str) -> tuple[dict[str, MatrixAccessor], int | None, nn.Module, nn.Module | None]:
    # Mixtral before transformers 5 called its sparse block `block_sparse_moe`.
    mlp = get_path(block, "mlp")
    if mlp is None:
        mlp = get_path(block, "block_sparse_moe")
    if not isinstance(mlp, nn.Module):
        raise DiscoveryError(f"{family} layout: expected `mlp` in {where}, but it is missing")
    experts = getattr(mlp, "experts", None)
    if spec.mlp == "moe" and experts is not None:
        matrices, n_experts = _moe_experts(experts, family, where + ".mlp.experts")
        return matrices, n_experts, mlp, None
    if spec.mlp == "fused_gate_up":
        # Phi-3: `gate, up = gate_up_proj(x).chunk(2)`: gate is the first half (Phi3MLP).
        gate_up = need(mlp, "gate_up_proj", family, where + ".mlp")
        half = weight_of(gate_up).shape[0] // 2
        matrices = {
            "up": linear_rows(gate_up, half, 2 * half),
            "gate": linear_rows(gate_up, 0, half),
            "down": linear(need(mlp, "down_proj", family, where + ".mlp")),
        }
        return matrices, None, mlp, None
    # Dense gated MLP (also the dense layers of Qwen-MoE: mlp_only_layers, decoder_sparse_step).
    gate = need(mlp, "gate_proj", family, where + ".mlp")
    matrices = {
        "up": linear(need(mlp, "up_proj", family, where + ".mlp")),
        "gate": linear(gate),
        "down": linear(need(mlp, "down_proj", family, where + ".mlp")),
    }
    return matrices, None, mlp, gate


def _hf_decoder(base: nn.Module, family: str, spec: _DecoderSpec) -> Layout:
    config = setting(base, "config")
    layers = need(base, "layers", family, "the base model")
    blocks: list[Block] = []
    for index, block in enumerate(blocks_of(layers)):
        where = f"layers.{index}"
        attn_matrices, shape, attn = _decoder_attention(block, config, family, spec, where)
        mlp_matrices, n_experts, mlp, gate = _decoder_mlp(block, family, spec, where)
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices={**attn_matrices, **mlp_matrices},
                attention=shape,
                experts=n_experts,
                attn_module=attn,
                mlp_module=mlp,
                gate_module=gate,
            )
        )
    return Layout(
        family=family,
        blocks=blocks,
        embed=get_path(base, "embed_tokens"),
        final_norm=get_path(base, "norm"),
        blocks_path="layers",
    )


def _hf_decoder_of(family: str, spec: _DecoderSpec) -> Callable[[nn.Module], Layout]:
    return lambda base: _hf_decoder(base, family, spec)


FAMILIES = tuple(Family(family, layout=_hf_decoder_of(family, spec), model_type=model_type) for model_type, (family, spec) in _DECODER_FAMILIES.items())
