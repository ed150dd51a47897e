"""The map of a model that every probe reads: its blocks, each block's weight matrices (as
accessors that read the current parameter) and attention shape; and the few helpers that read
a weight whatever its sharding.

It sits below `discovery` (which builds a `Layout` per model family) and `structure` (which
reads blocks off their data flow), so that neither imports the other's module for these types.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import nn

from .mapping import MATRIX_SITES

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


MatrixAccessor = Callable[[], torch.Tensor]


class DiscoveryError(ValueError):
    """The model's layout could not be determined; the message says what was missing."""


@dataclass(frozen=True)
class AttentionShape:
    n_heads: int
    n_kv_heads: int
    head_dim: int


@dataclass
class Block:
    index: int
    # The block itself; its output (element 0 of a tuple) is the residual stream after the block.
    module: nn.Module
    # site -> accessor of the weight in (out, in) orientation, or (experts, out, in) for MoE.
    matrices: dict[str, MatrixAccessor]
    attention: AttentionShape | None = None
    experts: int | None = None
    attn_module: nn.Module | None = None
    mlp_module: nn.Module | None = None
    gate_module: nn.Module | None = None

    def sites(self) -> list[str]:
        """The matrix sites of this block, in vocabulary order."""
        return [site for site in MATRIX_SITES if site in self.matrices]


@dataclass
class Layout:
    family: str
    blocks: list[Block]
    embed: nn.Module | None = None
    final_norm: nn.Module | None = None
    # Dotted path of the block container inside the unwrapped model, for messages and docs.
    blocks_path: str = field(default="", compare=False)

    def to_info(self) -> dict[str, Any]:
        """The layout as the JSON of the Rust `ModelLayout` (analytics::record)."""
        layers: list[dict[str, Any]] = []
        for block in self.blocks:
            layer: dict[str, Any] = {"index": block.index, "sites": block.sites()}
            if block.attention is not None:
                layer["attention"] = {
                    "n_heads": block.attention.n_heads,
                    "n_kv_heads": block.attention.n_kv_heads,
                    "head_dim": block.attention.head_dim,
                }
            if block.experts is not None:
                layer["experts"] = block.experts
            layers.append(layer)
        return {"family": self.family, "layers": layers}


@dataclass(frozen=True)
class RowSlice:
    """Rows start:stop of a DTensor weight sharded along its rows (FSDP2 shards dim 0; so does
    column-wise tensor parallelism). Slicing the DTensor itself would all-gather the whole
    weight first; the spectral probe instead intersects each rank's block with the rows."""

    base: torch.Tensor  # a DTensor
    start: int
    stop: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.stop - self.start, *self.base.shape[1:]))

    def dim(self) -> int:
        return self.base.dim()


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """Whether `tensor` is a DTensor (False where torch is built without distributed)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(tensor, DTensor)


def rows(weight: torch.Tensor, start: int, stop: int) -> Any:
    """weight[start:stop]: a view, or a `RowSlice` of a DTensor sharded along its rows."""
    if is_dtensor(weight):
        from torch.distributed.tensor import Shard

        if any(isinstance(p, Shard) and p.dim == 0 for p in weight.placements):
            return RowSlice(weight, start, stop)
    return weight[start:stop]


def weight_of(module: nn.Module, name: str = "weight") -> torch.Tensor:
    """`module.weight` (or another parameter of it), the tensor an accessor reads."""
    weight = getattr(module, name)
    if not isinstance(weight, torch.Tensor):
        raise DiscoveryError(f"expected a tensor {name!r} in {type(module).__name__}, found {type(weight).__name__}")
    return weight
