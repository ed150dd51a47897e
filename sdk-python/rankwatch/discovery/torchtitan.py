"""torchtitan's Llama: `tok_embeddings`, `layers` of `attention.wq/wk/wv/wo` and `feed_forward.w1/w2/w3`."""

from __future__ import annotations

from torch import nn

from ..layout import Block, Layout, weight_of
from .common import blocks_of, get_path, linear, need, setting, shape_from_rows
from .registry import Family


def _looks_like_torchtitan(model: nn.Module) -> bool:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)) or len(layers) == 0:
        return False
    first = blocks_of(layers)[0]
    return hasattr(model, "tok_embeddings") and isinstance(get_path(first, "attention.wq"), nn.Module) and isinstance(get_path(first, "feed_forward.w1"), nn.Module)


def _torchtitan(model: nn.Module) -> Layout:
    family = "torchtitan_llama"
    blocks: list[Block] = []
    for index, block in enumerate(blocks_of(model.layers)):
        where = f"layers.{index}"
        attn = need(block, "attention", family, where)
        wq = need(attn, "wq", family, where + ".attention")
        wk = need(attn, "wk", family, where + ".attention")
        head_dim = getattr(attn, "head_dim", None) or weight_of(wq).shape[0] // setting(attn, "n_heads")
        ffn = need(block, "feed_forward", family, where)
        w1 = need(ffn, "w1", family, where + ".feed_forward")
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices={
                    "q": linear(wq),
                    "k": linear(wk),
                    "v": linear(need(attn, "wv", family, where + ".attention")),
                    "o": linear(need(attn, "wo", family, where + ".attention")),
                    # FeedForward: w2(silu(w1(x)) * w3(x)): w1 is the GATE, w3 the up projection.
                    "up": linear(need(ffn, "w3", family, where + ".feed_forward")),
                    "gate": linear(w1),
                    "down": linear(need(ffn, "w2", family, where + ".feed_forward")),
                },
                attention=shape_from_rows(head_dim, weight_of(wq).shape[0], weight_of(wk).shape[0], family, where),
                attn_module=attn,
                mlp_module=ffn,
                gate_module=w1,
            )
        )
    return Layout(
        family,
        blocks,
        embed=get_path(model, "tok_embeddings"),
        final_norm=get_path(model, "norm"),
        blocks_path="layers",
    )


FAMILY = Family("torchtitan_llama", layout=_torchtitan, recognise=_looks_like_torchtitan)
