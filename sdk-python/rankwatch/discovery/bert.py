"""BERT-style encoders (Hugging Face): post-LN blocks under `encoder.layer`."""

from __future__ import annotations

from torch import nn

from ..layout import Block, Layout, weight_of
from .common import blocks_of, get_path, linear, need, setting, shape_from_rows
from .registry import Family


def _hf_bert(base: nn.Module) -> Layout:
    family = "bert"
    blocks: list[Block] = []
    layers = need(base, "encoder.layer", family, "the base model")
    for index, block in enumerate(blocks_of(layers)):
        where = f"encoder.layer.{index}"
        self_attn = need(block, "attention.self", family, where)
        query = need(self_attn, "query", family, where + ".attention.self")
        key = need(self_attn, "key", family, where + ".attention.self")
        head_dim = getattr(self_attn, "attention_head_size", None) or (weight_of(query).shape[0] // setting(base, "config").num_attention_heads)
        attn_dense = need(block, "attention.output.dense", family, where)
        down = need(block, "output.dense", family, where)
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices={
                    "q": linear(query),
                    "k": linear(key),
                    "v": linear(need(self_attn, "value", family, where + ".attention.self")),
                    "o": linear(attn_dense),
                    "up": linear(need(block, "intermediate.dense", family, where)),
                    "down": linear(down),
                },
                attention=shape_from_rows(head_dim, weight_of(query).shape[0], weight_of(key).shape[0], family, where),
                # BERT is post-LN: the sublayer modules end in residual + LayerNorm, so the
                # projections themselves are the "before the residual add" points that match
                # attn_out / mlp_out of pre-LN models.
                attn_module=attn_dense,
                mlp_module=down,
            )
        )
    return Layout(family, blocks, embed=get_path(base, "embeddings"), final_norm=None, blocks_path="encoder.layer")


FAMILY = Family("bert", layout=_hf_bert, model_type="bert")
