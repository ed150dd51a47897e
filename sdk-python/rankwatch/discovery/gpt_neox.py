"""GPT-NeoX / Pythia (Hugging Face): q/k/v fused per head in `query_key_value`."""

from __future__ import annotations

import torch
from torch import nn

from ..layout import AttentionShape, Block, DiscoveryError, Layout, MatrixAccessor, weight_of
from .common import blocks_of, get_path, linear, need, setting
from .registry import Family


def _neox_qkv(module: nn.Module, n_heads: int, head_dim: int, which: int) -> MatrixAccessor:
    # GPT-NeoX lays the fused output out as [n_heads, 3, head_dim] (see GPTNeoXAttention.forward:
    # view(..., -1, 3 * head_size) then chunk(3)), so q rows are strided per head. The gather
    # cannot be expressed as a 2-D view; reshape makes the one unavoidable copy.
    def read() -> torch.Tensor:
        weight = weight_of(module).detach()
        per_head = weight.view(n_heads, 3, head_dim, weight.shape[-1])
        return per_head[:, which].reshape(n_heads * head_dim, weight.shape[-1])

    return read


def _hf_gpt_neox(base: nn.Module) -> Layout:
    family = "gpt_neox"
    config = setting(base, "config")
    blocks: list[Block] = []
    for index, block in enumerate(blocks_of(need(base, "layers", family, "the base model"))):
        where = f"layers.{index}"
        attn = need(block, "attention", family, where)
        qkv = need(attn, "query_key_value", family, where + ".attention")
        n_heads = config.num_attention_heads
        head_dim = getattr(attn, "head_size", None) or config.hidden_size // n_heads
        if weight_of(qkv).shape[0] != 3 * n_heads * head_dim:
            raise DiscoveryError(f"{family} layout: query_key_value width mismatch in {where}")
        matrices = {
            "q": _neox_qkv(qkv, n_heads, head_dim, 0),
            "k": _neox_qkv(qkv, n_heads, head_dim, 1),
            "v": _neox_qkv(qkv, n_heads, head_dim, 2),
            "o": linear(need(attn, "dense", family, where + ".attention")),
            "up": linear(need(block, "mlp.dense_h_to_4h", family, where)),
            "down": linear(need(block, "mlp.dense_4h_to_h", family, where)),
        }
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices=matrices,
                attention=AttentionShape(n_heads, n_heads, head_dim),
                attn_module=attn,
                mlp_module=need(block, "mlp", family, where),
            )
        )
    return Layout(
        family,
        blocks,
        embed=get_path(base, "embed_in"),
        final_norm=get_path(base, "final_layer_norm"),
        blocks_path="layers",
    )


FAMILY = Family("gpt_neox", layout=_hf_gpt_neox, model_type="gpt_neox")
