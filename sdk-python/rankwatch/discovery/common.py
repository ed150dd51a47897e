"""What every family's discovery reads a model with: accessors that return a weight in (out, in)
orientation when called (closing over a module, never a tensor, so a probe reads the current
parameter), dotted-path lookup, the wrappers peeled before anything is recognised, and the
embedding and final norm around a block list."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layout import AttentionShape, DiscoveryError, MatrixAccessor, rows, weight_of


def linear(module: nn.Module) -> MatrixAccessor:
    return lambda: weight_of(module).detach()


def linear_rows(module: nn.Module, start: int, stop: int) -> MatrixAccessor:
    # Rows of an (out, in) weight are output features: a contiguous view.
    return lambda: rows(weight_of(module).detach(), start, stop)


def conv1d(module: nn.Module) -> MatrixAccessor:
    # transformers' Conv1D computes x @ W with W (in, out): the transpose is a view.
    return lambda: weight_of(module).detach().t()


def conv1d_columns(module: nn.Module, start: int, stop: int) -> MatrixAccessor:
    return lambda: weight_of(module).detach()[:, start:stop].t()


def param(owner: nn.Module, name: str, transposed: bool = False) -> MatrixAccessor:
    def read() -> torch.Tensor:
        weight = weight_of(owner, name).detach()
        return weight.transpose(-2, -1) if transposed else weight

    return read


def param_rows(owner: nn.Module, name: str, start: int, stop: int) -> MatrixAccessor:
    return lambda: rows(getattr(owner, name).detach(), start, stop)


def sliced_param(owner: nn.Module, name: str, part: slice, transposed: bool) -> MatrixAccessor:
    # `part` selects output features of an (experts, out, in) tensor (or (experts, in, out) when
    # stored transposed): a strided view either way.
    def read() -> torch.Tensor:
        weight = weight_of(owner, name).detach()
        if transposed:
            return weight[:, :, part].transpose(-2, -1)
        return weight[:, part, :]

    return read


def stacked(modules: list[nn.Module], attr: str) -> MatrixAccessor:
    # ModuleList experts live in separate tensors; batching them needs one copy per call.
    return lambda: torch.stack([weight_of(getattr(m, attr)).detach() for m in modules])


def weight_accessor(module: nn.Module, transposed: bool) -> MatrixAccessor | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3):
        return None
    if transposed or is_conv1d(module):
        return param(module, "weight", transposed=True)
    return linear(module)


_WRAPPER_CHILDREN = ("_orig_mod", "module", "_fsdp_wrapped_module", "_forward_module")


def unwrap(model: nn.Module) -> nn.Module:
    """Peel torch.compile / DDP / DataParallel / FSDP / Lightning wrappers."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        children = dict(model.named_children())
        for name in _WRAPPER_CHILDREN:
            inner = children.get(name)
            # A wrapper holds the real model and at most bookkeeping beside it; a model that
            # merely has a child called "module" among many others is not a wrapper.
            if isinstance(inner, nn.Module) and len(children) <= 2 and not hf_model_type(model):
                model = inner
                break
        else:
            break
    return model


def hf_model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return model_type if isinstance(model_type, str) else None


def hf_base(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", None)
    if isinstance(prefix, str) and prefix:
        base = getattr(model, prefix, None)
        if isinstance(base, nn.Module):
            return base
    return model


def get_path(module: nn.Module, path: str) -> Any:
    """Resolve a dotted path through attributes, ModuleList indices and ModuleDict keys."""
    current: Any = module
    for part in path.split("."):
        if isinstance(current, (nn.ModuleList, nn.Sequential)) and part.lstrip("-").isdigit():
            index = int(part)
            current = current[index] if -len(current) <= index < len(current) else None
        elif isinstance(current, nn.ModuleDict):
            current = current[part] if part in current else None
        else:
            current = getattr(current, part, None)
        if current is None:
            return None
    return current


def setting(owner: object, name: str) -> Any:
    """A plain attribute of a module or of a model's config: an int, a transformers config.
    torch types every module attribute as `Tensor | Module`, which these are not."""
    return getattr(owner, name)


def need(owner: nn.Module, path: str, family: str, where: str) -> nn.Module:
    found = get_path(owner, path)
    if not isinstance(found, nn.Module):
        raise DiscoveryError(f"{family} layout: expected `{path}` in {where} ({type(owner).__name__}), but it is missing; pass mapping= to describe this model")
    return found


def is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D, matched by name so discovery never imports transformers.
    return type(module).__name__ == "Conv1D"


def blocks_of(container: Any) -> list[nn.Module]:
    if isinstance(container, nn.ModuleDict):
        # torchtitan keys layers "0", "1", ...: order numerically, not lexically.
        keys = sorted(container.keys(), key=lambda k: (0, int(k)) if k.isdigit() else (1, k))
        return [container[k] for k in keys]
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return list(container)
    raise DiscoveryError(f"expected a ModuleList or ModuleDict of blocks, got {type(container).__name__}")


def config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def shape_from_rows(head_dim: int, q_rows: int, kv_rows: int, family: str, where: str) -> AttentionShape:
    if head_dim <= 0 or q_rows % head_dim or kv_rows % head_dim:
        raise DiscoveryError(f"{family} layout: head_dim {head_dim} does not divide q/k widths {q_rows}/{kv_rows} in {where}")
    return AttentionShape(q_rows // head_dim, kv_rows // head_dim, head_dim)


FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_norm", "norm_f", "layer_norm")


def embedding_outside(model: nn.Module, blocks_path: str) -> nn.Module | None:
    return next(
        (m for n, m in model.named_modules() if isinstance(m, nn.Embedding) and not n.startswith(blocks_path + ".")),
        None,
    )


def final_norm_of(model: nn.Module, blocks_path: str) -> nn.Module | None:
    """The norm after the blocks: a child of their parent with a usual name, else the first
    child registered after the blocks whose class is a norm (`LayerNorm`, `RMSNorm`, ...)."""
    parent = get_path(model, blocks_path.rsplit(".", 1)[0]) if "." in blocks_path else model
    named = next((m for n in FINAL_NORM_NAMES if isinstance(m := getattr(parent, n, None), nn.Module)), None)
    if named is not None:
        return named
    leaf = blocks_path.rsplit(".", 1)[-1]
    children = list(parent.named_children())
    after = [m for i, (n, _) in enumerate(children) if n == leaf for _, m in children[i + 1 :]]
    return next((m for m in after if type(m).__name__.endswith("Norm")), None)


def hint_for(original: nn.Module) -> str:
    return f"could not discover the transformer blocks of {type(original).__name__}: pass mapping={{'blocks': 'path.to.ModuleList', 'q': 'attn.q_proj', ...}} to rankwatch"
