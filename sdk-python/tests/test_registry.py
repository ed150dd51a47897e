"""Discovery's registry: each family listed once, dispatched by what identifies it."""

from __future__ import annotations

import pytest
from torch import nn

from rankwatch.discovery import FAMILIES, Layout
from rankwatch.discovery.registry import Family


def test_each_family_is_listed_once_and_each_model_type_has_one_reader() -> None:
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names)), names
    model_types = [f.model_type for f in FAMILIES if f.model_type is not None]
    assert len(model_types) == len(set(model_types)), model_types
    assert {"llama", "mistral", "qwen2", "gemma", "phi3", "mixtral", "qwen2_moe", "gpt2", "gpt_neox", "bert"} <= set(model_types)
    assert {f.name for f in FAMILIES if f.recognise is not None} == {"nanogpt", "torchtitan_llama"}


def test_a_family_is_identified_one_way() -> None:
    def layout(model: nn.Module) -> Layout:
        raise AssertionError("not called")

    with pytest.raises(ValueError, match="exactly one of model_type and recognise"):
        Family("both", layout=layout, model_type="x", recognise=lambda m: True)
    with pytest.raises(ValueError, match="exactly one of model_type and recognise"):
        Family("neither", layout=layout)
