"""GPT-2 (Hugging Face): Conv1D weights stored (in, out), q/k/v fused column-wise in `c_attn`."""

from __future__ import annotations

from torch import nn

from ..layout import AttentionShape, Block, Layout, weight_of
from .common import blocks_of, conv1d, conv1d_columns, get_path, need, setting
from .registry import Family


def _hf_gpt2(base: nn.Module) -> Layout:
    family = "gpt2"
    config = setting(base, "config")
    blocks: list[Block] = []
    for index, block in enumerate(blocks_of(need(base, "h", family, "the base model"))):
        where = f"h.{index}"
        attn = need(block, "attn", family, where)
        c_attn = need(attn, "c_attn", family, where + ".attn")
        width = weight_of(c_attn).shape[0]  # Conv1D weight is (in, out) = (C, 3C)
        n_heads = getattr(attn, "num_heads", None) or config.num_attention_heads
        # GPT2Attention: `query, key, value = c_attn(x).split(split_size, dim=2)`.
        matrices = {
            "q": conv1d_columns(c_attn, 0, width),
            "k": conv1d_columns(c_attn, width, 2 * width),
            "v": conv1d_columns(c_attn, 2 * width, 3 * width),
            "o": conv1d(need(attn, "c_proj", family, where + ".attn")),
            "up": conv1d(need(block, "mlp.c_fc", family, where)),
            "down": conv1d(need(block, "mlp.c_proj", family, where)),
        }
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices=matrices,
                attention=AttentionShape(n_heads, n_heads, width // n_heads),
                attn_module=attn,
                mlp_module=need(block, "mlp", family, where),
            )
        )
    return Layout("gpt2", blocks, embed=get_path(base, "wte"), final_norm=get_path(base, "ln_f"), blocks_path="h")


FAMILY = Family("gpt2", layout=_hf_gpt2, model_type="gpt2")
