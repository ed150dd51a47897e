"""The families discovery knows, each described once: its name, how it is recognised (a Hugging
Face `config.model_type`, or a structural test for other codebases) and the reader that maps
it. A new family is one module with a `Family` and one line in the package's `FAMILIES`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..layout import Layout


@dataclass(frozen=True)
class Family:
    """One model family. A Hugging Face family is read from its base model (`base_model_prefix`);
    any other from the model itself, when `recognise` says it is one."""

    name: str
    layout: Callable[[nn.Module], Layout]
    model_type: str | None = None  # Hugging Face `config.model_type`
    recognise: Callable[[nn.Module], bool] | None = None

    def __post_init__(self) -> None:
        if (self.model_type is None) == (self.recognise is None):
            raise ValueError(f"family {self.name}: give exactly one of model_type and recognise")
