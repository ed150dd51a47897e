"""Layer discovery: where a model keeps its transformer blocks and their weight matrices.

Every probe in rankwatch needs the same map of the model: the list of blocks, and in each block
the attention and MLP matrices (q, k, v, o, up, gate, down) in one orientation, (out, in), so
that `W @ x` is what the model computes. Models disagree on almost everything else — GPT-2 stores
`Conv1D` weights as (in, out); GPT-NeoX fuses q, k and v *per head*; Phi-3 fuses q/k/v with
grouped-query sizes and gate/up with the gate first; torchtitan calls the gate `w1`; recent
transformers store MoE experts as 3-D parameters. Guessing from names gets several of those
wrong silently, so discovery is explicit per family:

1. Wrappers are peeled first: `torch.compile` (`_orig_mod`), DDP / DataParallel / FSDP-style
   `.module`, Lightning's `_forward_module`; then a Hugging Face task head (`...ForCausalLM`) is
   replaced by its base model (`base_model_prefix`).
2. A Hugging Face model is dispatched on `config.model_type` to a handler that knows that
   family's layout and *requires* it: a missing projection is a `DiscoveryError`, not a shorter
   list. Non-HF layouts (nanoGPT, torchtitan Llama) are recognised by their characteristic
   structure (a `transformer` ModuleDict with `wte`/`h`; `tok_embeddings` + `attention.wq` +
   `feed_forward.w1`).
3. Anything else goes to the generic fallback: the largest ModuleList/ModuleDict of identical
   blocks, searched for linear children by the documented `GENERIC_SITE_PATTERNS` table (plus
   `nn.MultiheadAttention`'s fused `in_proj_weight`). It is taken only when it names q, k, v, o,
   up and down in every block.
4. Otherwise the blocks are read off their own data flow (`structure.py`: one traced forward of
   a meta copy of a block finds which weights feed the attention's q/k/v, which reads its
   output, and the MLP chain after it). That is exact or refused: the refusal names what was
   ambiguous, the model class, and points at `mapping=`.
5. A user `mapping` overrides all of the above (see `discover`).

Matrices are returned by zero-argument accessors rather than tensors, so that a probe always
reads the *current* parameter (optimizers, FSDP and `load_state_dict` may replace tensors), and
slices of fused weights are views (no copy) wherever the layout allows. The two exceptions are
documented where they happen: GPT-NeoX's per-head interleaved q/k/v (a strided gather needs one
copy) and ModuleList-style experts (stacking needs one copy).

MoE blocks report the *routed* experts as 3-D (experts, out, in) tensors. Qwen2-MoE's always-on
`shared_expert` has a different width, cannot be stacked with the routed experts and is not
reported as a matrix site; its output still reaches the "mlp_out" activation site, because that
hooks the whole sparse-MoE block.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

# The layout types are discovery's answer, and part of its interface.
from .layout import AttentionShape as AttentionShape
from .layout import Block as Block
from .layout import DiscoveryError as DiscoveryError
from .layout import Layout as Layout
from .layout import MatrixAccessor, rows
from .layout import weight_of as _weight
from .mapping import MATRIX_SITES, check

if TYPE_CHECKING:

    from .structure import BlockCall


# --------------------------------------------------------------------------------------------
# Accessors. Each closes over a module (never a tensor) and reads `.weight` when called.


def _linear(module: nn.Module) -> MatrixAccessor:
    return lambda: _weight(module).detach()


def _linear_rows(module: nn.Module, start: int, stop: int) -> MatrixAccessor:
    # Rows of an (out, in) weight are output features: a contiguous view.
    return lambda: rows(_weight(module).detach(), start, stop)


def _conv1d(module: nn.Module) -> MatrixAccessor:
    # transformers' Conv1D computes x @ W with W (in, out): the transpose is a view.
    return lambda: _weight(module).detach().t()


def _conv1d_columns(module: nn.Module, start: int, stop: int) -> MatrixAccessor:
    return lambda: _weight(module).detach()[:, start:stop].t()


def _param(owner: nn.Module, name: str, transposed: bool = False) -> MatrixAccessor:
    def read() -> torch.Tensor:
        weight = _weight(owner, name).detach()
        return weight.transpose(-2, -1) if transposed else weight

    return read


def _sliced_param(
    owner: nn.Module, name: str, part: slice, transposed: bool
) -> MatrixAccessor:
    # `part` selects output features of an (experts, out, in) tensor (or (experts, in, out) when
    # stored transposed): a strided view either way.
    def read() -> torch.Tensor:
        weight = _weight(owner, name).detach()
        if transposed:
            return weight[:, :, part].transpose(-2, -1)
        return weight[:, part, :]

    return read


def _stacked(modules: list[nn.Module], attr: str) -> MatrixAccessor:
    # ModuleList experts live in separate tensors; batching them needs one copy per call.
    return lambda: torch.stack([_weight(getattr(m, attr)).detach() for m in modules])


def _neox_qkv(module: nn.Module, n_heads: int, head_dim: int, which: int) -> MatrixAccessor:
    # GPT-NeoX lays the fused output out as [n_heads, 3, head_dim] (see GPTNeoXAttention.forward:
    # view(..., -1, 3 * head_size) then chunk(3)), so q rows are strided per head. The gather
    # cannot be expressed as a 2-D view; reshape makes the one unavoidable copy.
    def read() -> torch.Tensor:
        weight = _weight(module).detach()
        per_head = weight.view(n_heads, 3, head_dim, weight.shape[-1])
        return per_head[:, which].reshape(n_heads * head_dim, weight.shape[-1])

    return read


# --------------------------------------------------------------------------------------------
# Helpers.

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
            if isinstance(inner, nn.Module) and len(children) <= 2 and not _hf_model_type(model):
                model = inner
                break
        else:
            break
    return model


def _hf_model_type(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return model_type if isinstance(model_type, str) else None


def _hf_base(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", None)
    if isinstance(prefix, str) and prefix:
        base = getattr(model, prefix, None)
        if isinstance(base, nn.Module):
            return base
    return model


def _get(module: nn.Module, path: str) -> Any:
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


def _setting(owner: object, name: str) -> Any:
    """A plain attribute of a module or of a model's config: an int, a transformers config.
    torch types every module attribute as `Tensor | Module`, which these are not."""
    return getattr(owner, name)


def _need(owner: nn.Module, path: str, family: str, where: str) -> nn.Module:
    found = _get(owner, path)
    if not isinstance(found, nn.Module):
        raise DiscoveryError(
            f"{family} layout: expected `{path}` in {where} ({type(owner).__name__}), "
            "but it is missing; pass mapping= to describe this model"
        )
    return found


def _is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D, matched by name so discovery never imports transformers.
    return type(module).__name__ == "Conv1D"


def _blocks_of(container: Any) -> list[nn.Module]:
    if isinstance(container, nn.ModuleDict):
        # torchtitan keys layers "0", "1", ...: order numerically, not lexically.
        keys = sorted(container.keys(), key=lambda k: (0, int(k)) if k.isdigit() else (1, k))
        return [container[k] for k in keys]
    if isinstance(container, (nn.ModuleList, nn.Sequential)):
        return list(container)
    raise DiscoveryError(f"expected a ModuleList or ModuleDict of blocks, got {type(container).__name__}")


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _shape_from_rows(
    head_dim: int, q_rows: int, kv_rows: int, family: str, where: str
) -> AttentionShape:
    if head_dim <= 0 or q_rows % head_dim or kv_rows % head_dim:
        raise DiscoveryError(
            f"{family} layout: head_dim {head_dim} does not divide q/k widths {q_rows}/{kv_rows} "
            f"in {where}"
        )
    return AttentionShape(q_rows // head_dim, kv_rows // head_dim, head_dim)


# --------------------------------------------------------------------------------------------
# Hugging Face decoder families (Llama-like attention; dense, fused or MoE MLPs).


@dataclass(frozen=True)
class _DecoderSpec:
    attention: str  # "separate" (q/k/v/o_proj) or "fused_qkv" (Phi-3 qkv_proj)
    mlp: str  # "gated", "fused_gate_up" (Phi-3) or "moe" (dense gated layers allowed too)


_DECODER_FAMILIES: dict[str, tuple[str, _DecoderSpec]] = {
    "llama": ("llama", _DecoderSpec("separate", "gated")),
    "mistral": ("mistral", _DecoderSpec("separate", "gated")),
    "qwen2": ("qwen2", _DecoderSpec("separate", "gated")),
    "qwen3": ("qwen3", _DecoderSpec("separate", "gated")),
    "gemma": ("gemma", _DecoderSpec("separate", "gated")),
    "phi3": ("phi3", _DecoderSpec("fused_qkv", "fused_gate_up")),
    "mixtral": ("mixtral", _DecoderSpec("separate", "moe")),
    "qwen2_moe": ("qwen2_moe", _DecoderSpec("separate", "moe")),
    "qwen3_moe": ("qwen3_moe", _DecoderSpec("separate", "moe")),
}


def _decoder_attention(
    block: nn.Module, config: Any, family: str, spec: _DecoderSpec, where: str
) -> tuple[dict[str, MatrixAccessor], AttentionShape, nn.Module]:
    attn = _need(block, "self_attn", family, where)
    o_proj = _need(attn, "o_proj", family, where + ".self_attn")
    head_dim = (
        getattr(attn, "head_dim", None)
        or _config_int(config, "head_dim")
        or config.hidden_size // config.num_attention_heads
    )
    if spec.attention == "separate":
        q = _need(attn, "q_proj", family, where + ".self_attn")
        k = _need(attn, "k_proj", family, where + ".self_attn")
        v = _need(attn, "v_proj", family, where + ".self_attn")
        shape = _shape_from_rows(head_dim, _weight(q).shape[0], _weight(k).shape[0], family, where)
        matrices = {"q": _linear(q), "k": _linear(k), "v": _linear(v)}
    else:
        # Phi-3: qkv_proj output is [q (n_heads*hd) | k (n_kv*hd) | v (n_kv*hd)] (Phi3Attention).
        qkv = _need(attn, "qkv_proj", family, where + ".self_attn")
        n_heads = config.num_attention_heads
        n_kv = _config_int(config, "num_key_value_heads") or n_heads
        q_rows, kv_rows = n_heads * head_dim, n_kv * head_dim
        if _weight(qkv).shape[0] != q_rows + 2 * kv_rows:
            raise DiscoveryError(
                f"{family} layout: qkv_proj has {_weight(qkv).shape[0]} outputs, expected "
                f"{q_rows} + 2*{kv_rows} in {where}"
            )
        shape = AttentionShape(n_heads, n_kv, head_dim)
        matrices = {
            "q": _linear_rows(qkv, 0, q_rows),
            "k": _linear_rows(qkv, q_rows, q_rows + kv_rows),
            "v": _linear_rows(qkv, q_rows + kv_rows, q_rows + 2 * kv_rows),
        }
    matrices["o"] = _linear(o_proj)
    return matrices, shape, attn


def _moe_experts(
    experts: nn.Module, family: str, where: str
) -> tuple[dict[str, MatrixAccessor], int]:
    """Routed experts as (E, out, in) accessors, for 3-D parameter and ModuleList storage."""
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3:
        # transformers >= 5: gate_up_proj [E, 2I, H], down_proj [E, H, I]; forward does
        # `gate, up = linear(x, gate_up_proj[e]).chunk(2)`: the gate is the first half. The
        # @use_experts_implementation decorator records other storages in attributes.
        transposed = bool(getattr(experts, "is_transposed", False))
        concatenated = bool(getattr(experts, "is_concatenated", True))
        n_experts = gate_up.shape[0]
        width = gate_up.shape[-1] if transposed else gate_up.shape[1]
        half = width // 2
        gate_part = slice(0, half) if concatenated else slice(0, None, 2)
        up_part = slice(half, width) if concatenated else slice(1, None, 2)
        return (
            {
                "up": _sliced_param(experts, "gate_up_proj", up_part, transposed),
                "gate": _sliced_param(experts, "gate_up_proj", gate_part, transposed),
                "down": _param(experts, "down_proj", transposed),
            },
            n_experts,
        )
    if isinstance(experts, nn.ModuleList) and len(experts) > 0:
        first = experts[0]
        members = list(experts)
        if all(hasattr(first, n) for n in ("gate_proj", "up_proj", "down_proj")):
            names = {"up": "up_proj", "gate": "gate_proj", "down": "down_proj"}
        elif all(hasattr(first, n) for n in ("w1", "w2", "w3")):
            # Mixtral (transformers < 5): w1 = gate, w3 = up, w2 = down.
            names = {"up": "w3", "gate": "w1", "down": "w2"}
        else:
            raise DiscoveryError(f"{family} layout: unrecognised expert module in {where}")
        return {site: _stacked(members, attr) for site, attr in names.items()}, len(members)
    raise DiscoveryError(f"{family} layout: no expert weights found in {where}")


def _decoder_mlp(
    block: nn.Module, family: str, spec: _DecoderSpec, where: str
) -> tuple[dict[str, MatrixAccessor], int | None, nn.Module, nn.Module | None]:
    # Mixtral before transformers 5 called its sparse block `block_sparse_moe`.
    mlp = _get(block, "mlp")
    if mlp is None:
        mlp = _get(block, "block_sparse_moe")
    if not isinstance(mlp, nn.Module):
        raise DiscoveryError(f"{family} layout: expected `mlp` in {where}, but it is missing")
    experts = getattr(mlp, "experts", None)
    if spec.mlp == "moe" and experts is not None:
        matrices, n_experts = _moe_experts(experts, family, where + ".mlp.experts")
        return matrices, n_experts, mlp, None
    if spec.mlp == "fused_gate_up":
        # Phi-3: `gate, up = gate_up_proj(x).chunk(2)`: gate is the first half (Phi3MLP).
        gate_up = _need(mlp, "gate_up_proj", family, where + ".mlp")
        half = _weight(gate_up).shape[0] // 2
        matrices = {
            "up": _linear_rows(gate_up, half, 2 * half),
            "gate": _linear_rows(gate_up, 0, half),
            "down": _linear(_need(mlp, "down_proj", family, where + ".mlp")),
        }
        return matrices, None, mlp, None
    # Dense gated MLP (also the dense layers of Qwen-MoE: mlp_only_layers, decoder_sparse_step).
    gate = _need(mlp, "gate_proj", family, where + ".mlp")
    matrices = {
        "up": _linear(_need(mlp, "up_proj", family, where + ".mlp")),
        "gate": _linear(gate),
        "down": _linear(_need(mlp, "down_proj", family, where + ".mlp")),
    }
    return matrices, None, mlp, gate


def _hf_decoder(base: nn.Module, family: str, spec: _DecoderSpec) -> Layout:
    config = _setting(base, "config")
    layers = _need(base, "layers", family, "the base model")
    blocks: list[Block] = []
    for index, block in enumerate(_blocks_of(layers)):
        where = f"layers.{index}"
        attn_matrices, shape, attn = _decoder_attention(block, config, family, spec, where)
        mlp_matrices, n_experts, mlp, gate = _decoder_mlp(block, family, spec, where)
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices={**attn_matrices, **mlp_matrices},
                attention=shape,
                experts=n_experts,
                attn_module=attn,
                mlp_module=mlp,
                gate_module=gate,
            )
        )
    return Layout(
        family=family,
        blocks=blocks,
        embed=_get(base, "embed_tokens"),
        final_norm=_get(base, "norm"),
        blocks_path="layers",
    )


# --------------------------------------------------------------------------------------------
# GPT-2, GPT-NeoX, BERT.


def _hf_gpt2(base: nn.Module) -> Layout:
    family = "gpt2"
    config = _setting(base, "config")
    blocks: list[Block] = []
    for index, block in enumerate(_blocks_of(_need(base, "h", family, "the base model"))):
        where = f"h.{index}"
        attn = _need(block, "attn", family, where)
        c_attn = _need(attn, "c_attn", family, where + ".attn")
        width = _weight(c_attn).shape[0]  # Conv1D weight is (in, out) = (C, 3C)
        n_heads = getattr(attn, "num_heads", None) or config.num_attention_heads
        # GPT2Attention: `query, key, value = c_attn(x).split(split_size, dim=2)`.
        matrices = {
            "q": _conv1d_columns(c_attn, 0, width),
            "k": _conv1d_columns(c_attn, width, 2 * width),
            "v": _conv1d_columns(c_attn, 2 * width, 3 * width),
            "o": _conv1d(_need(attn, "c_proj", family, where + ".attn")),
            "up": _conv1d(_need(block, "mlp.c_fc", family, where)),
            "down": _conv1d(_need(block, "mlp.c_proj", family, where)),
        }
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices=matrices,
                attention=AttentionShape(n_heads, n_heads, width // n_heads),
                attn_module=attn,
                mlp_module=_need(block, "mlp", family, where),
            )
        )
    return Layout("gpt2", blocks, embed=_get(base, "wte"), final_norm=_get(base, "ln_f"), blocks_path="h")


def _hf_gpt_neox(base: nn.Module) -> Layout:
    family = "gpt_neox"
    config = _setting(base, "config")
    blocks: list[Block] = []
    for index, block in enumerate(_blocks_of(_need(base, "layers", family, "the base model"))):
        where = f"layers.{index}"
        attn = _need(block, "attention", family, where)
        qkv = _need(attn, "query_key_value", family, where + ".attention")
        n_heads = config.num_attention_heads
        head_dim = getattr(attn, "head_size", None) or config.hidden_size // n_heads
        if _weight(qkv).shape[0] != 3 * n_heads * head_dim:
            raise DiscoveryError(f"{family} layout: query_key_value width mismatch in {where}")
        matrices = {
            "q": _neox_qkv(qkv, n_heads, head_dim, 0),
            "k": _neox_qkv(qkv, n_heads, head_dim, 1),
            "v": _neox_qkv(qkv, n_heads, head_dim, 2),
            "o": _linear(_need(attn, "dense", family, where + ".attention")),
            "up": _linear(_need(block, "mlp.dense_h_to_4h", family, where)),
            "down": _linear(_need(block, "mlp.dense_4h_to_h", family, where)),
        }
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices=matrices,
                attention=AttentionShape(n_heads, n_heads, head_dim),
                attn_module=attn,
                mlp_module=_need(block, "mlp", family, where),
            )
        )
    return Layout(
        family,
        blocks,
        embed=_get(base, "embed_in"),
        final_norm=_get(base, "final_layer_norm"),
        blocks_path="layers",
    )


def _hf_bert(base: nn.Module) -> Layout:
    family = "bert"
    blocks: list[Block] = []
    layers = _need(base, "encoder.layer", family, "the base model")
    for index, block in enumerate(_blocks_of(layers)):
        where = f"encoder.layer.{index}"
        self_attn = _need(block, "attention.self", family, where)
        query = _need(self_attn, "query", family, where + ".attention.self")
        key = _need(self_attn, "key", family, where + ".attention.self")
        head_dim = getattr(self_attn, "attention_head_size", None) or (
            _weight(query).shape[0] // _setting(base, "config").num_attention_heads
        )
        attn_dense = _need(block, "attention.output.dense", family, where)
        down = _need(block, "output.dense", family, where)
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices={
                    "q": _linear(query),
                    "k": _linear(key),
                    "v": _linear(_need(self_attn, "value", family, where + ".attention.self")),
                    "o": _linear(attn_dense),
                    "up": _linear(_need(block, "intermediate.dense", family, where)),
                    "down": _linear(down),
                },
                attention=_shape_from_rows(
                    head_dim, _weight(query).shape[0], _weight(key).shape[0], family, where
                ),
                # BERT is post-LN: the sublayer modules end in residual + LayerNorm, so the
                # projections themselves are the "before the residual add" points that match
                # attn_out / mlp_out of pre-LN models.
                attn_module=attn_dense,
                mlp_module=down,
            )
        )
    return Layout(family, blocks, embed=_get(base, "embeddings"), final_norm=None, blocks_path="encoder.layer")


def _hf_decoder_of(family: str, spec: _DecoderSpec) -> Callable[[nn.Module], Layout]:
    return lambda base: _hf_decoder(base, family, spec)


_HF_FAMILIES: dict[str, Callable[[nn.Module], Layout]] = {
    **{
        model_type: _hf_decoder_of(family, spec)
        for model_type, (family, spec) in _DECODER_FAMILIES.items()
    },
    "gpt2": _hf_gpt2,
    "gpt_neox": _hf_gpt_neox,
    "bert": _hf_bert,
}


# --------------------------------------------------------------------------------------------
# Non-HF families: nanoGPT and torchtitan Llama.


def _looks_like_nanogpt(model: nn.Module) -> bool:
    transformer = getattr(model, "transformer", None)
    if not isinstance(transformer, nn.ModuleDict) or not {"wte", "h"} <= set(transformer.keys()):
        return False
    h = transformer["h"]
    return (
        isinstance(h, nn.ModuleList)
        and len(h) > 0
        and isinstance(_get(h[0], "attn.c_attn"), nn.Linear)
    )


def _nanogpt(model: nn.Module) -> Layout:
    family = "nanogpt"
    transformer = model.transformer
    if not isinstance(transformer, nn.ModuleDict):  # _looks_like_nanogpt checked it
        raise DiscoveryError(f"{family} layout: model.transformer is a {type(transformer).__name__}, not a ModuleDict")
    blocks: list[Block] = []
    for index, block in enumerate(_blocks_of(transformer["h"])):
        where = f"transformer.h.{index}"
        attn = _need(block, "attn", family, where)
        c_attn = _need(attn, "c_attn", family, where + ".attn")
        width = _weight(c_attn).shape[0] // 3
        n_heads = getattr(attn, "n_head", None) or _setting(model, "config").n_head
        # CausalSelfAttention: `q, k, v = c_attn(x).split(n_embd, dim=2)`: contiguous rows.
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices={
                    "q": _linear_rows(c_attn, 0, width),
                    "k": _linear_rows(c_attn, width, 2 * width),
                    "v": _linear_rows(c_attn, 2 * width, 3 * width),
                    "o": _linear(_need(attn, "c_proj", family, where + ".attn")),
                    "up": _linear(_need(block, "mlp.c_fc", family, where)),
                    "down": _linear(_need(block, "mlp.c_proj", family, where)),
                },
                attention=AttentionShape(n_heads, n_heads, width // n_heads),
                attn_module=attn,
                mlp_module=_need(block, "mlp", family, where),
            )
        )
    return Layout(
        family,
        blocks,
        embed=transformer["wte"],
        final_norm=transformer["ln_f"] if "ln_f" in transformer else None,
        blocks_path="transformer.h",
    )


def _looks_like_torchtitan(model: nn.Module) -> bool:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleDict, nn.ModuleList)) or len(layers) == 0:
        return False
    first = _blocks_of(layers)[0]
    return (
        hasattr(model, "tok_embeddings")
        and isinstance(_get(first, "attention.wq"), nn.Module)
        and isinstance(_get(first, "feed_forward.w1"), nn.Module)
    )


def _torchtitan(model: nn.Module) -> Layout:
    family = "torchtitan_llama"
    blocks: list[Block] = []
    for index, block in enumerate(_blocks_of(model.layers)):
        where = f"layers.{index}"
        attn = _need(block, "attention", family, where)
        wq = _need(attn, "wq", family, where + ".attention")
        wk = _need(attn, "wk", family, where + ".attention")
        head_dim = getattr(attn, "head_dim", None) or _weight(wq).shape[0] // _setting(attn, "n_heads")
        ffn = _need(block, "feed_forward", family, where)
        w1 = _need(ffn, "w1", family, where + ".feed_forward")
        blocks.append(
            Block(
                index=index,
                module=block,
                matrices={
                    "q": _linear(wq),
                    "k": _linear(wk),
                    "v": _linear(_need(attn, "wv", family, where + ".attention")),
                    "o": _linear(_need(attn, "wo", family, where + ".attention")),
                    # FeedForward: w2(silu(w1(x)) * w3(x)): w1 is the GATE, w3 the up projection.
                    "up": _linear(_need(ffn, "w3", family, where + ".feed_forward")),
                    "gate": _linear(w1),
                    "down": _linear(_need(ffn, "w2", family, where + ".feed_forward")),
                },
                attention=_shape_from_rows(
                    head_dim, _weight(wq).shape[0], _weight(wk).shape[0], family, where
                ),
                attn_module=attn,
                mlp_module=ffn,
                gate_module=w1,
            )
        )
    return Layout(
        family,
        blocks,
        embed=_get(model, "tok_embeddings"),
        final_norm=_get(model, "norm"),
        blocks_path="layers",
    )


# --------------------------------------------------------------------------------------------
# Generic fallback.

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
_FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_norm", "norm_f", "layer_norm")


def _weight_accessor(module: nn.Module, transposed: bool) -> MatrixAccessor | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (2, 3):
        return None
    if transposed or _is_conv1d(module):
        return _param(module, "weight", transposed=True)
    return _linear(module)


def _largest_block_list(model: nn.Module) -> tuple[str, list[nn.Module]] | None:
    best: tuple[str, list[nn.Module]] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) == 0:
            continue
        members = _blocks_of(module)
        if len({type(m) for m in members}) != 1:
            continue
        # Count parameters rather than entries so a list of 100 tiny norms loses to 12 blocks.
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > sum(p.numel() for m in best[1] for p in m.parameters()):
            best = (name, members)
    return best


def _attention_shape_from(attn: nn.Module | None, config: Any, q_rows: int | None) -> AttentionShape | None:
    sources = [s for s in (attn, config) if s is not None]
    n_heads = next((v for s in sources if (v := _config_int(s, *_HEAD_COUNT_NAMES))), None)
    if n_heads is None:
        return None
    n_kv = next((v for s in sources if (v := _config_int(s, *_KV_HEAD_COUNT_NAMES))), n_heads)
    head_dim = next((v for s in sources if (v := _config_int(s, *_HEAD_DIM_NAMES))), None)
    if head_dim is None and q_rows is not None and q_rows % n_heads == 0:
        head_dim = q_rows // n_heads
    return AttentionShape(n_heads, n_kv, head_dim) if head_dim else None


def _generic(model: nn.Module, original: nn.Module, found: tuple[str, list[nn.Module]] | None) -> Layout:
    hint = _hint(original)
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
                    q=_param_rows(child, "in_proj_weight", 0, e),
                    k=_param_rows(child, "in_proj_weight", e, 2 * e),
                    v=_param_rows(child, "in_proj_weight", 2 * e, 3 * e),
                    o=_linear(child.out_proj),
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
                accessor = _weight_accessor(child, transposed=False)
                if accessor is not None:
                    matrices[site] = accessor
                    paths[site] = path
        if not matrices:
            raise DiscoveryError(
                hint + f" (blocks at `{blocks_path}` of type {type(block).__name__} have no "
                "linear children named like q/k/v/o/up/gate/down)"
            )
        if attn_module is None and "o" in paths and "." in paths["o"]:
            attn_module = _get(block, paths["o"].rsplit(".", 1)[0])
        mlp_module = None
        if "down" in paths and "." in paths["down"]:
            mlp_module = _get(block, paths["down"].rsplit(".", 1)[0])
        if attention is None and "q" in matrices:
            attention = _attention_shape_from(
                attn_module, getattr(model, "config", None), matrices["q"]().shape[0]
            )
        gate_module = _get(block, paths["gate"]) if "gate" in paths else None
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
        embed=_embedding_outside(model, blocks_path),
        final_norm=_final_norm(model, blocks_path),
        blocks_path=blocks_path,
    )


def _param_rows(owner: nn.Module, name: str, start: int, stop: int) -> MatrixAccessor:
    return lambda: rows(getattr(owner, name).detach(), start, stop)


# --------------------------------------------------------------------------------------------
# User mapping.

def _from_mapping(roots: list[nn.Module], mapping: dict[str, Any], original: nn.Module) -> Layout:
    try:
        check(mapping)  # its shape, as the command line checks it
    except ValueError as e:
        raise DiscoveryError(str(e)) from e

    def resolve(root_candidates: Iterable[Any], path: str, what: str) -> Any:
        for root in root_candidates:
            found = _get(root, path)
            if found is not None:
                return found
        raise DiscoveryError(
            f"mapping path `{path}` ({what}) not found in {type(original).__name__}"
        )

    container = resolve(roots, mapping["blocks"], "blocks")
    members = _blocks_of(container)
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
                owner = _get(block, owner_path) if owner_path else block
                matrices[site] = _param(owner, attr, transposed=flip)
            elif isinstance(target, nn.Module) and (accessor := _weight_accessor(target, flip)):
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


# --------------------------------------------------------------------------------------------


def _find_known(model: nn.Module) -> Layout | None:
    model_type = _hf_model_type(model)
    if model_type in _HF_FAMILIES:
        return _HF_FAMILIES[model_type](_hf_base(model))
    if _looks_like_nanogpt(model):
        return _nanogpt(model)
    if _looks_like_torchtitan(model):
        return _torchtitan(model)
    return None


def discover(model: nn.Module, mapping: dict[str, Any] | None = None, *, call: BlockCall | None = None) -> Layout:
    """Find the blocks and matrices of `model`.

    `mapping` describes a model discovery does not know, with dotted paths (ModuleList indices
    and ModuleDict keys allowed):

        {"blocks": "encoder.layers",              # from the (unwrapped) model or its base model
         "q": "attn.wq", "k": ..., "v": ..., "o": ..., "up": ..., "gate": ..., "down": ...,
         "transposed": ["q", ...],                # weights stored (in, out)
         "attention": {"n_heads": 8, "n_kv_heads": 2, "head_dim": 64},
         "embed": "tok_emb", "final_norm": "norm",  # from the model
         "attn": "attn", "mlp": "ffn", "gate_act": "ffn.w_gate"}  # activation hook points

    A site path may end in a module with `.weight` or in a parameter (2-D, or 3-D experts).
    Any path that does not resolve raises `DiscoveryError` naming it.

    `call` is the first block's arguments at a real forward (`structure.capture_call`), for
    blocks that cannot run on a synthesized input (`structure.NeedsCall`).
    """
    inner = unwrap(model)
    if mapping is not None:
        roots = [inner] + ([_hf_base(inner)] if _hf_base(inner) is not inner else [])
        return _from_mapping(roots, mapping, model)
    layout = _find_known(inner)
    if layout is not None:
        return layout
    # A known model held inside a container (a LightningModule's `self.model`, say).
    for _, module in inner.named_modules():
        if module is not inner and (_hf_model_type(module) in _HF_FAMILIES):
            return _HF_FAMILIES[_hf_model_type(module)](_hf_base(module))  # type: ignore[index]
    found = _largest_block_list(inner)
    by_name: Layout | None = None
    try:
        by_name = _generic(inner, model, found)
    except DiscoveryError:
        pass  # no name matched: the data flow decides
    if by_name is not None and all(set(_COMPLETE) <= set(b.matrices) for b in by_name.blocks):
        return by_name
    # No name matched every matrix: read the blocks off their data flow rather than report a
    # partial map (MPT's `Wqkv` beside `out_proj`/`up_proj`/`down_proj`, say).
    return _structural(inner, model, found, by_name, call)


def _hint(original: nn.Module) -> str:
    return (
        f"could not discover the transformer blocks of {type(original).__name__}: "
        "pass mapping={'blocks': 'path.to.ModuleList', 'q': 'attn.q_proj', ...} to rankwatch"
    )


# The sites a name match must find in every block to be taken without tracing.
_COMPLETE = ("q", "k", "v", "o", "up", "down")


def _structural(
    model: nn.Module, original: nn.Module, found: tuple[str, list[nn.Module]] | None, partial: Layout | None, call: BlockCall | None
) -> Layout:
    from .structure import NeedsCall, discover_blocks

    hint = _hint(original)
    if found is None:
        raise DiscoveryError(hint + " (no ModuleList/ModuleDict of identical blocks found)")
    blocks_path, members = found
    embed = _embedding_outside(model, blocks_path)
    try:
        blocks = discover_blocks(members, embed, blocks_path, call)
    except DiscoveryError as e:
        named = partial.blocks[0].sites() if partial is not None and partial.blocks else []
        by_name = f"names matched only {', '.join(named)}" if named else "no names matched q/k/v/o/up/gate/down"
        message = f"{hint} (blocks at `{blocks_path}` of type {type(members[0]).__name__}: {by_name}; from the data flow: {e})"
        if isinstance(e, NeedsCall):
            raise NeedsCall(message, e.block) from e
        raise DiscoveryError(message) from e
    return Layout("structural", blocks, embed=embed, final_norm=_final_norm(model, blocks_path), blocks_path=blocks_path)


def _embedding_outside(model: nn.Module, blocks_path: str) -> nn.Module | None:
    return next(
        (m for n, m in model.named_modules() if isinstance(m, nn.Embedding) and not n.startswith(blocks_path + ".")),
        None,
    )


def _final_norm(model: nn.Module, blocks_path: str) -> nn.Module | None:
    """The norm after the blocks: a child of their parent with a usual name, else the first
    child registered after the blocks whose class is a norm (`LayerNorm`, `RMSNorm`, ...)."""
    parent = _get(model, blocks_path.rsplit(".", 1)[0]) if "." in blocks_path else model
    named = next((m for n in _FINAL_NORM_NAMES if isinstance(m := getattr(parent, n, None), nn.Module)), None)
    if named is not None:
        return named
    leaf = blocks_path.rsplit(".", 1)[-1]
    children = list(parent.named_children())
    after = [m for i, (n, _) in enumerate(children) if n == leaf for _, m in children[i + 1 :]]
    return next((m for m in after if type(m).__name__.endswith("Norm")), None)
