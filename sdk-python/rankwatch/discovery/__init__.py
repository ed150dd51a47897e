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
2. A Hugging Face model is dispatched on `config.model_type` to the family that knows its
   layout and *requires* it: a missing projection is a `DiscoveryError`, not a shorter
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

The package: `registry.py` (what a family is), one module per family (`hf_decoders.py`: the
Llama-like Hugging Face decoders from one table; `gpt2.py`, `gpt_neox.py`, `bert.py`,
`nanogpt.py`, `torchtitan.py`), the fallbacks `by_names.py` and `by_data_flow.py`,
`user_mapping.py`, and `common.py` (accessors and lookups every one of them uses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

# The layout types are discovery's answer, and part of its interface.
from ..layout import AttentionShape as AttentionShape
from ..layout import Block as Block
from ..layout import DiscoveryError as DiscoveryError
from ..layout import Layout as Layout
from . import bert, gpt2, gpt_neox, hf_decoders, nanogpt, torchtitan
from .by_data_flow import by_data_flow
from .by_names import COMPLETE, by_names, largest_block_list
from .by_names import GENERIC_SITE_PATTERNS as GENERIC_SITE_PATTERNS
from .common import hf_base, hf_model_type
from .common import unwrap as unwrap
from .registry import Family
from .user_mapping import from_mapping

if TYPE_CHECKING:
    from ..structure import BlockCall

# Every family discovery knows, in the order they are tried.
FAMILIES: tuple[Family, ...] = (*hf_decoders.FAMILIES, gpt2.FAMILY, gpt_neox.FAMILY, bert.FAMILY, nanogpt.FAMILY, torchtitan.FAMILY)
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES if f.model_type is not None}
_RECOGNISED = [(f.recognise, f.layout) for f in FAMILIES if f.recognise is not None]


def _find_known(model: nn.Module) -> Layout | None:
    """The layout of a model of a known family, else None."""
    hf = _BY_MODEL_TYPE.get(hf_model_type(model) or "")
    if hf is not None:
        return hf.layout(hf_base(model))
    for recognise, layout in _RECOGNISED:
        if recognise(model):
            return layout(model)
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
        roots = [inner] + ([hf_base(inner)] if hf_base(inner) is not inner else [])
        return from_mapping(roots, mapping, model)
    layout = _find_known(inner)
    if layout is not None:
        return layout
    # A known model held inside a container (a LightningModule's `self.model`, say).
    for _, module in inner.named_modules():
        family = _BY_MODEL_TYPE.get(hf_model_type(module) or "") if module is not inner else None
        if family is not None:
            return family.layout(hf_base(module))
    found = largest_block_list(inner)
    by_name: Layout | None = None
    try:
        by_name = by_names(inner, model, found)
    except DiscoveryError:
        pass  # no name matched: the data flow decides
    if by_name is not None and all(set(COMPLETE) <= set(b.matrices) for b in by_name.blocks):
        return by_name
    # No name matched every matrix: read the blocks off their data flow rather than report a
    # partial map (MPT's `Wqkv` beside `out_proj`/`up_proj`/`down_proj`, say).
    return by_data_flow(inner, model, found, by_name, call)
