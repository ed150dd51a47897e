"""The generic fallback by names: the largest list of identical blocks, each searched for linear
children whose dotted paths match `GENERIC_SITE_PATTERNS` (plus `nn.MultiheadAttention`'s fused
`in_proj_weight`). Taken only when it names every matrix of every block; otherwise the data flow
decides (`by_data_flow.py`)."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..layout import AttentionShape, Block, DiscoveryError, Layout, MatrixAccessor
from .common import blocks_of, config_int, embedding_outside, final_norm_of, get_path, hint_for, linear, param_rows, weight_accessor

# Relative paths inside a block (regular expressions matched against the full dotted path) that
# name each matrix in common codebases. Order matters only for ties; an ambiguous block (two
# children matching one site) is reported, never resolved by guessing.
GENERIC_SITE_PATTERNS: dict[str, tuple[str, ...]] = {
    "q": (r"(^|\.)(q_proj|query|wq|q_lin|to_q|q)$",),
    "k": (r"(^|\.)(k_proj|key|wk|k_lin|to_k|k)$",),
    "v": (r"(^|\.)(v_proj|value|wv|v_lin|to_v|v)$",),
    "o": (
        r"(^|\.)(o_proj|out_proj|wo|out_lin|to_out(\.0)?)$",
        r"(^|\.)(attn|attention|self_attn)\.(c_proj|dense)$",
        r"(^|\.)attention\.output\.dense$",
    ),
    "up": (
        r"(^|\.)(up_proj|fc1|c_fc|dense_h_to_4h|lin1|fc_in|w_in|linear1)$",
        r"(^|\.)intermediate\.dense$",
    ),
    "gate": (r"(^|\.)(gate_proj|w_gate)$",),
    "down": (
        r"(^|\.)(down_proj|fc2|dense_4h_to_h|lin2|fc_out|w_out|linear2)$",
        r"(^|\.)(mlp|ffn|feed_forward)\.c_proj$",
        r"^output\.dense$",
    ),
}


_HEAD_COUNT_NAMES = ("num_heads", "n_heads", "num_attention_heads", "n_head")


_KV_HEAD_COUNT_NAMES = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_kv_head")


_HEAD_DIM_NAMES = ("head_dim", "head_size", "attention_head_size")


# The sites a name match must find in every block to be taken without tracing.
COMPLETE = ("q", "k", "v", "o", "up", "down")


def largest_block_list(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    best: tuple[str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) == 0:
            continue
        members = blocks_of(module)
        if len({type(m) for m in members}) != 1:
            continue
        # Count parameters rather than entries so a list of 100 tiny norms loses to 12 blocks.
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > sum(p.numel() for m in best[1] for p in m.parameters()):
            best = (name, members)
    return best


def _attention_shape_from(attn: nn.Module | None, config: Any, q_rows: int | None) -> AttentionShape | None:
    sources = [s for s in (attn, config) if s is not None]
    n_heads = next((v for s in sources if (v := config_int(s, *_HEAD_COUNT_NAMES))), None)
    if n_heads is None:
        return None
    n_kv = next((v for s in sources if (v := config_int(s, *_KV_HEAD_COUNT_NAMES))), n_heads)
    head_dim = next((v for s in sources if (v := config_int(s, *_HEAD_DIM_NAMES))), None)
    if head_dim is None and q_rows is not None and q_rows % n_heads == 0:
        head_dim = q_rows // n_heads
    return AttentionShape(n_heads, n_kv, head_dim) if head_dim else None


def by_names(model: nn.Module, original: nn.Module, found: tuple[str, list[nn.Module]] | None) -> Layout:
    hint = hint_for(original)
    if found is None:
        raise DiscoveryError(hint + " (no ModuleList/ModuleDict of identical blocks found)")
    blocks_path, members = found
    blocks: list[Block] = []
    for index, block in enumerate(members):
        matrices: dict[str, MatrixAccessor] = {}
        paths: dict[str, str] = {}
        attention: AttentionShape | None = None
        attn_module: nn.Module | None = None
        for path, child in block.named_modules():
            if isinstance(child, nn.MultiheadAttention) and child.in_proj_weight is not None:
                # nn.MultiheadAttention: in_proj_weight rows are [q | k | v], out_proj is o.
                e = child.embed_dim
                matrices.update(
                    q=param_rows(child, "in_proj_weight", 0, e),
                    k=param_rows(child, "in_proj_weight", e, 2 * e),
                    v=param_rows(child, "in_proj_weight", 2 * e, 3 * e),
                    o=linear(child.out_proj),
                )
                paths.update(q=path, k=path, v=path, o=path + ".out_proj")
                attention = AttentionShape(child.num_heads, child.num_heads, child.head_dim)
                attn_module = child
                continue
            if not path:
                continue
            for site, patterns in GENERIC_SITE_PATTERNS.items():
                if site in paths or not any(re.search(p, path) for p in patterns):
                    continue
                accessor = weight_accessor(child, transposed=False)
                if accessor is not None:
                    matrices[site] = accessor
                    paths[site] = path
        if not matrices:
            raise DiscoveryError(hint + f" (blocks at `{blocks_path}` of type {type(block).__name__} have no linear children named like q/k/v/o/up/gate/down)")
        if attn_module is None and "o" in paths and "." in paths["o"]:
            attn_module = get_path(block, paths["o"].rsplit(".", 1)[0])
        mlp_module = None
        if "down" in paths and "." in paths["down"]:
            mlp_module = get_path(block, paths["down"].rsplit(".", 1)[0])
        if attention is None and "q" in matrices:
            attention = _attention_shape_from(attn_module, getattr(model, "config", None), matrices["q"]().shape[0])
        gate_module = get_path(block, paths["gate"]) if "gate" in paths else None
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices=matrices,
                attention=attention,
                attn_module=attn_module,
                mlp_module=mlp_module,
                gate_module=gate_module,
            )
        )
    return Layout(
        "generic",
        blocks,
        embed=embedding_outside(model, blocks_path),
        final_norm=final_norm_of(model, blocks_path),
        blocks_path=blocks_path,
    )
