"""The last resort: the blocks read off their own data flow (`structure.py`: one traced forward
of a meta copy of a block). Exact or refused; the refusal says what names matched and what the
trace found ambiguous."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..layout import DiscoveryError, Layout
from .common import embedding_outside, final_norm_of, hint_for

if TYPE_CHECKING:
    from ..structure import BlockCall


def by_data_flow(model: nn.Module, original: nn.Module, found: tuple[str, list[nn.Module]] | None, partial: Layout | None, call: BlockCall | None) -> Layout:
    from ..structure import NeedsCall, discover_blocks

    hint = hint_for(original)
    if found is None:
        raise DiscoveryError(hint + " (no ModuleList/ModuleDict of identical blocks found)")
    blocks_path, members = found
    embed = embedding_outside(model, blocks_path)
    try:
        blocks = discover_blocks(members, embed, blocks_path, call)
    except DiscoveryError as e:
        named = partial.blocks[0].sites() if partial is not None and partial.blocks else []
        by_name = f"names matched only {', '.join(named)}" if named else "no names matched q/k/v/o/up/gate/down"
        message = f"{hint} (blocks at `{blocks_path}` of type {type(members[0]).__name__}: {by_name}; from the data flow: {e})"
        if isinstance(e, NeedsCall):
            raise NeedsCall(message, e.block) from e
        raise DiscoveryError(message) from e
    return Layout("structural", blocks, embed=embed, final_norm=final_norm_of(model, blocks_path), blocks_path=blocks_path)
