"""nanoGPT: a `transformer` ModuleDict with `wte` and `h`, q/k/v fused row-wise in `c_attn`."""

from __future__ import annotations

from torch import nn

from ..layout import AttentionShape, Block, DiscoveryError, Layout, weight_of
from .common import blocks_of, get_path, linear, linear_rows, need, setting
from .registry import Family


def _looks_like_nanogpt(model: nn.Module) -> bool:
    transformer = getattr(model, "transformer", None)
    if not isinstance(transformer, nn.ModuleDict) or not {"wte", "h"} <= set(transformer.keys()):
        return False
    h = transformer["h"]
    return isinstance(h, nn.ModuleList) and len(h) > 0 and isinstance(get_path(h[0], "attn.c_attn"), nn.Linear)


def _nanogpt(model: nn.Module) -> Layout:
    family = "nanogpt"
    transformer = model.transformer
    if not isinstance(transformer, nn.ModuleDict):  # _looks_like_nanogpt checked it
        raise DiscoveryError(f"{family} layout: model.transformer is a {type(transformer).__name__}, not a ModuleDict")
    blocks: list[Block] = []
    for index, block in enumerate(blocks_of(transformer["h"])):
        where = f"transformer.h.{index}"
        attn = need(block, "attn", family, where)
        c_attn = need(attn, "c_attn", family, where + ".attn")
        width = weight_of(c_attn).shape[0] // 3
        n_heads = getattr(attn, "n_head", None) or setting(model, "config").n_head
        # CausalSelfAttention: `q, k, v = c_attn(x).split(n_embd, dim=2)`: contiguous rows.
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices={
                    "q": linear_rows(c_attn, 0, width),
                    "k": linear_rows(c_attn, width, 2 * width),
                    "v": linear_rows(c_attn, 2 * width, 3 * width),
                    "o": linear(need(attn, "c_proj", family, where + ".attn")),
                    "up": linear(need(block, "mlp.c_fc", family, where)),
                    "down": linear(need(block, "mlp.c_proj", family, where)),
                },
                attention=AttentionShape(n_heads, n_heads, width // n_heads),
                attn_module=attn,
                mlp_module=need(block, "mlp", family, where),
            )
        )
    return Layout(
        family,
        blocks,
        embed=transformer["wte"],
        final_norm=transformer["ln_f"] if "ln_f" in transformer else None,
        blocks_path="transformer.h",
    )


FAMILY = Family("nanogpt", layout=_nanogpt, recognise=_looks_like_nanogpt)
