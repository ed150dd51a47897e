"""A model described by the user (`watch(mapping=...)`, `--mapping`): every path resolved, or a
`DiscoveryError` naming the one that does not."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..layout import AttentionShape, Block, DiscoveryError, Layout, MatrixAccessor
from ..mapping import MATRIX_SITES, check
from .common import blocks_of, get_path, param, weight_accessor


def from_mapping(roots: list[nn.Module], mapping: dict[str, Any], original: nn.Module) -> Layout:
    try:
        check(mapping)  # its shape, as the command line checks it
    except ValueError as e:
        raise DiscoveryError(str(e)) from e

    def resolve(root_candidates: Iterable[Any], path: str, what: str) -> Any:
        for root in root_candidates:
            found = get_path(root, path)
            if found is not None:
                return found
        raise DiscoveryError(f"mapping path `{path}` ({what}) not found in {type(original).__name__}")

    container = resolve(roots, mapping["blocks"], "blocks")
    members = blocks_of(container)
    transposed = set(mapping.get("transposed", ()))
    attention = None
    if mapping.get("attention") is not None:
        a = mapping["attention"]
        attention = AttentionShape(int(a["n_heads"]), int(a.get("n_kv_heads", a["n_heads"])), int(a["head_dim"]))
    blocks: list[Block] = []
    for index, block in enumerate(members):
        matrices: dict[str, MatrixAccessor] = {}
        for site in MATRIX_SITES:
            if site not in mapping:
                continue
            path = mapping[site]
            target = resolve([block], path, f"site {site!r} of block {index}")
            flip = site in transposed
            if isinstance(target, torch.Tensor):
                owner_path, _, attr = path.rpartition(".")
                owner = get_path(block, owner_path) if owner_path else block
                matrices[site] = param(owner, attr, transposed=flip)
            elif isinstance(target, nn.Module) and (accessor := weight_accessor(target, flip)):
                matrices[site] = accessor
            else:
                raise DiscoveryError(f"mapping path `{path}` (site {site!r}) has no 2-D or 3-D weight")
        experts = {m().shape[0] for m in matrices.values() if m().dim() == 3}
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices=matrices,
                attention=attention,
                experts=experts.pop() if len(experts) == 1 else None,
                attn_module=resolve([block], mapping["attn"], "attn") if "attn" in mapping else None,
                mlp_module=resolve([block], mapping["mlp"], "mlp") if "mlp" in mapping else None,
                gate_module=resolve([block], mapping["gate_act"], "gate_act") if "gate_act" in mapping else None,
            )
        )
    return Layout(
        "mapping",
        blocks,
        embed=resolve(roots, mapping["embed"], "embed") if mapping.get("embed") else None,
        final_norm=resolve(roots, mapping["final_norm"], "final_norm") if mapping.get("final_norm") else None,
        blocks_path=mapping["blocks"],
    )
