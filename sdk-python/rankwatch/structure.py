"""Structural discovery: a block's attention and MLP matrices read off its own data flow.

Family handlers and the name table (`discovery/`) know models by their names. Research code,
Megatron-core, OLMo, MPT and renamed forks call the same matrices something else, so when
neither applies, discovery traces one forward of one block and reads the matrices off what the
block computes:

* **q, k, v** are the parameters whose linear maps reach the q, k and v arguments of
  `scaled_dot_product_attention`, or of attention written out by hand (`softmax(Q Kᵀ) V`: a
  matmul of two activations, a softmax of it, a matmul of that with a third); through fused
  projections and their splits, views, head transposes, rotary embeddings, per-head norms and
  grouped-query head repeats;
* **o** is the parameter whose linear map reads the attention's output;
* **down** is the parameter whose linear map reads a nonlinearity of another linear map's
  output (not q/k/v/o): that map is **up**; where the nonlinearity was taken of a third map's
  output and multiplied into up's (a gated MLP, fused or not), that third map is **gate**.

How. The block is cloned onto the meta device (its parameters, buffers and tensor attributes
become meta tensors of the same shape and dtype; hooks are left behind; the original module and
its parameters are never touched), put in eval mode, and called once under `no_grad` and a
forked CPU random stream with a [1, 3, hidden] meta input, inside a `TorchFunctionMode`. A
block whose forward wants more (a mask, rotary tables, positions: `NeedsCall`) is traced on
the arguments of its first real forward instead, captured as meta tensors by a one-off forward
pre-hook (`capture_call`; the run installs it and traces at the next `log()`). Meta
tensors carry no values, so the mode carries a *shadow* beside each tensor: an int64 CPU tensor
of the same shape whose every element names the linear map and output feature it came from
(`source << 32 | feature`). Data movement (views, splits, transposes, concatenation, indexing,
repeats) is applied to the shadows as to the tensors, so a q that is rows 0..C of a fused
weight, or every third head of an interleaved one, arrives at the attention with exactly those
rows in its shadow, in head order; a move steered by an index tensor (whose values a meta
tensor lacks) clears it. Elementwise arithmetic passes a shadow through; two operands of one map
must be a permutation of each other within the row (rotary: x·cos + rotate_half(x)·sin, in
either order), and the one in ascending order — the head's own rows — is kept; anything else
mixes. Reductions and anything unknown clear it. The batch of one makes folded batch×head
layouts read as heads.

Exact or refused: every element of q, k and v must come from one linear map, the same on every
token; kv heads repeated for grouped-query attention must be repeated in the order
`repeat_interleave` (and SDPA's `enable_gqa`) uses, which the spectral probe's OV product
assumes; o must read the attention output feature for feature; one attention and one MLP per
block. Anything else raises `DiscoveryError` naming what was ambiguous — never a guess.

Blocks whose parameters have the same names and shapes share one trace; the sites found are
relative parameter names, resolved in each block to accessors that read the live parameter
(`discovery`'s contract). Row selections of a fused weight are views when the rows form one
ascending range, otherwise one gather (a copy) per read.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .layout import (
    AttentionShape,
    Block,
    DiscoveryError,
    MatrixAccessor,
    is_dtensor,
    rows,
)
from .layout import weight_of as _weight

NONE = -1  # no linear map's output
MIXED = -2  # elements of two different maps combined
_FEATURE_BITS = 32
_FEATURE_MASK = (1 << _FEATURE_BITS) - 1
SEQUENCE = 3  # tokens in the traced input: more than one, and unlike typical head counts

# Functions by name (`__name__` of the torch function or Tensor method the mode is handed).
_MATMULS = frozenset({"matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "linear"})
_ACTIVATIONS = frozenset(
    {
        "silu", "silu_", "gelu", "gelu_", "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_",
        "softplus", "mish", "elu", "leaky_relu", "hardswish", "hardsigmoid", "relu6", "selu", "celu",
        "quick_gelu", "logsigmoid",
    }
)
_SOFTMAX = frozenset({"softmax", "_softmax"})
# Functions that move elements without arithmetic: applied to the shadows as to the tensors.
_MOVEMENT = frozenset(
    {
        "view", "reshape", "transpose", "transpose_", "permute", "t", "split", "split_with_sizes", "chunk",
        "unbind", "tensor_split", "__getitem__", "narrow", "select", "flatten", "unflatten", "expand",
        "expand_as", "repeat", "repeat_interleave", "cat", "concat", "concatenate", "stack", "squeeze",
        "unsqueeze", "movedim", "moveaxis", "swapaxes", "swapdims", "view_as", "reshape_as", "roll", "flip",
        "contiguous", "clone", "detach", "tile",
    }
)
# Movement functions whose several tensor arguments are all data (the rest take an index).
_JOINS = frozenset({"cat", "concat", "concatenate", "stack", "expand_as", "view_as", "reshape_as"})
# Functions that keep shape and element order but change values, dtype or device (a shadow
# negated would no longer name its feature).
_CASTS = frozenset({"to", "type", "float", "half", "bfloat16", "double", "type_as", "cpu", "cuda", "__neg__", "neg"})
# Transposes of a parameter (stored (in, out) and used as (out, in), or the reverse).
_TRANSPOSES = frozenset({"t", "transpose", "T", "mT"})


@dataclass(frozen=True)
class _ParamRef:
    """A block parameter, or its transpose, as it flows into a linear map."""

    name: str
    transposed: bool


@dataclass
class _Info:
    """What the trace knows of one tensor."""

    shadow: torch.Tensor | None  # None: an expanded NONE of the tensor's shape, made on demand
    act: bool = False  # went through a nonlinearity since its last linear map
    marks: frozenset[tuple[str, int]] = frozenset()  # matmul / softmax events upstream
    param: _ParamRef | None = None


@dataclass
class _LinearUse:
    source: int
    param: str
    transposed: bool
    input_shadow: torch.Tensor
    input_act: bool


@dataclass
class _AttentionUse:
    q: torch.Tensor  # shadows in [..., heads, tokens, head_dim]
    k: torch.Tensor
    v: torch.Tensor
    output_source: int


@dataclass
class _MatMulUse:
    lhs: torch.Tensor
    rhs: torch.Tensor


@dataclass(frozen=True)
class Site:
    """One matrix of a block: a parameter (by name relative to the block), whether it is stored
    (in, out), and which of its (out, in) rows the model uses for this site (None: all)."""

    param: str  # with "{}" for the expert's index when `experts` is set
    transposed: bool
    rows: tuple[int, ...] | None = None
    experts: int | None = None  # a ModuleList of experts: the matrices stacked, (E, out, in)


@dataclass
class BlockMap:
    """What one trace found, for every block with the same parameters."""

    sites: dict[str, Site]
    attention: AttentionShape
    attn_module: str | None  # relative module paths of the activation hook points
    mlp_module: str | None
    gate_module: str | None
    experts: int | None = None


@dataclass
class _Trace:
    params: dict[int, str]
    infos: dict[int, tuple[torch.Tensor, _Info]] = field(default_factory=dict)
    linears: list[_LinearUse] = field(default_factory=list)
    attentions: list[_AttentionUse] = field(default_factory=list)
    matmuls: dict[int, _MatMulUse] = field(default_factory=dict)
    softmax_of: dict[int, int] = field(default_factory=dict)
    gates: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (gate, up) shadows
    unsupported: list[str] = field(default_factory=list)
    ambiguous: list[str] = field(default_factory=list)  # data flows that would need a guess
    next_source: int = 1

    def source(self) -> int:
        self.next_source += 1
        return self.next_source


def _labels(source: int, shape: torch.Size) -> torch.Tensor:
    """Shadow of a linear map's output: feature j of `source` along the last dimension."""
    features = torch.arange(shape[-1], dtype=torch.int64) | (source << _FEATURE_BITS)
    return features.expand(shape)


def _head_labels(source: int, shape: torch.Size) -> torch.Tensor:
    """Shadow of an attention output [..., heads, tokens, head_dim]: feature h*D + d."""
    heads, dim = shape[-3], shape[-1]
    labels = torch.arange(heads * dim, dtype=torch.int64).view(heads, 1, dim) | (source << _FEATURE_BITS)
    return labels.expand(shape)


def _combine(shadows: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    """Elementwise arithmetic: labels pass through where one operand has them; two maps mix.
    Two operands of the same map with other labels are one vector and a permutation of it
    within the last dimension (rotary: x·cos + rotate_half(x)·sin, in either order): the one
    in ascending order is kept. Anything else (a sum of two slices of a fused map) mixes."""
    result = torch.full(shape, NONE, dtype=torch.int64)
    for shadow in shadows:
        other = shadow.expand(shape)
        empty = result == NONE
        labelled = (~empty) & (other != NONE)
        different = labelled & ((other >> _FEATURE_BITS) != (result >> _FEATURE_BITS))
        permuted = labelled & ~different & (other != result)
        if bool(permuted.any()) and result.dim() > 0:
            same_set = (result.sort(-1).values == other.sort(-1).values).all(-1, keepdim=True)
            ascending_result = (result[..., 1:] >= result[..., :-1]).all(-1, keepdim=True)
            ascending_other = (other[..., 1:] >= other[..., :-1]).all(-1, keepdim=True)
            take_other = permuted & same_set & ascending_other & ~ascending_result
            unclear = permuted & ~(same_set & (ascending_result ^ ascending_other))
            result = torch.where(take_other, other, result)
            different = different | unclear
        result = torch.where(empty, other, result)
        result = torch.where(different, torch.full_like(result, MIXED), result)
    return result


class _Recorder(TorchFunctionMode):
    """Runs each torch function on the meta tensors and the same data flow on their shadows."""

    def __init__(self, trace: _Trace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out)
        except Exception as e:  # noqa: BLE001 - a shadow that cannot be followed is cleared
            self.trace.unsupported.append(f"{_name(func)}: {e}")
        return out

    # -- knowledge of tensors --------------------------------------------------------------

    def _info(self, tensor: torch.Tensor) -> _Info:
        name = self.trace.params.get(id(tensor))
        if name is not None:
            return _Info(shadow=None, param=_ParamRef(name, False))
        held = self.trace.infos.get(id(tensor))
        if held is not None and held[0] is tensor:
            return held[1]
        return _Info(shadow=None)

    def _shadow(self, tensor: torch.Tensor) -> torch.Tensor:
        info = self._info(tensor)
        if info.shadow is not None:
            return info.shadow
        return torch.tensor(NONE, dtype=torch.int64).expand(tensor.shape)

    def _keep(self, tensor: torch.Tensor, info: _Info) -> None:
        # The tensor is held with its info so that its id is not reused during the trace.
        self.trace.infos[id(tensor)] = (tensor, info)

    # -- the rules --------------------------------------------------------------------------

    def _record(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        name = _name(func)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs or not tensors:
            return
        infos = [self._info(t) for t in tensors]
        act = any(i.act for i in infos if i.param is None)
        marks = frozenset().union(*(i.marks for i in infos if i.param is None))
        if name == "scaled_dot_product_attention":
            q, k, v = (args + tuple(kwargs.get(n) for n in ("query", "key", "value")[len(args):]))[:3]
            self._attention(self._shadow(q), self._shadow(k), self._shadow(v), outputs[0])
            return
        if name in _MATMULS:
            self._matmul(name, args, kwargs, outputs[0], act)
            return
        if name == "einsum" or name == "baddbmm":
            self.trace.unsupported.append(f"{name} (not followed: name the matrices with mapping=)")
            self._keep(outputs[0], _Info(shadow=None, act=act))
            return
        if name in _SOFTMAX:
            event = self.trace.source()
            products = [ident for mark, ident in marks if mark == "mm"]
            if len(products) > 1:
                self.trace.ambiguous.append("a softmax over more than one product of activations")
            elif products:
                self.trace.softmax_of[event] = products[0]
            self._keep(outputs[0], _Info(shadow=None, act=True, marks=frozenset({("softmax", event)})))
            return
        params = [i.param for i in infos if i.param is not None]
        if params and name in _TRANSPOSES | {"__get__"} and len(tensors) == 1:
            ref = params[0]
            if name != "__get__" or _getter_name(func) in _TRANSPOSES:
                self._keep(outputs[0], _Info(shadow=None, param=_ParamRef(ref.name, not ref.transposed)))
            return
        if name == "__get__":  # a property: x.T, x.mT, x.data
            getter, first = _getter_name(func), infos[0]
            shadow = self._shadow(tensors[0])
            moved = {"T": shadow.permute(*reversed(range(shadow.dim()))), "mT": shadow.mT, "data": shadow}.get(getter)
            if moved is not None and moved.shape == outputs[0].shape:
                self._keep(outputs[0], _Info(shadow=moved, act=first.act, marks=first.marks))
            return
        if name == "view_as_complex":
            # Pairs of adjacent features become one complex number (rotary as torchtitan writes
            # it): the pair keeps its first label while the second is its neighbour.
            shadow = self._shadow(tensors[0])
            left, right = shadow[..., 0], shadow[..., 1]
            paired = (left >= 0) & (right == left + 1)
            self._keep(outputs[0], _Info(shadow=torch.where(paired, left, NONE), act=act, marks=marks))
            return
        if name == "view_as_real":
            shadow = self._shadow(tensors[0])
            pair = torch.stack((shadow, torch.where(shadow >= 0, shadow + 1, shadow)), dim=-1)
            self._keep(outputs[0], _Info(shadow=pair, act=act, marks=marks))
            return
        if name in _CASTS and len(outputs) == 1 and outputs[0].shape == tensors[0].shape:
            first = infos[0]
            if first.param is not None:
                self._keep(outputs[0], _Info(shadow=None, param=first.param))
            else:
                self._keep(outputs[0], _Info(shadow=self._shadow(tensors[0]), act=first.act, marks=first.marks))
            return
        if name in _MOVEMENT:
            if params:
                return  # a reshaped parameter is not followed (it would need its full shadow)
            if len(tensors) > 1 and name not in _JOINS:
                # An index, mask or repeats tensor says where elements go by its values, which
                # a meta tensor does not have: the result's labels are unknown.
                for tensor in outputs:
                    self._keep(tensor, _Info(shadow=None, act=act, marks=marks))
                return
            shadow_args, shadow_kwargs = pytree.tree_map(
                lambda x: self._shadow(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
            )
            moved = func(*shadow_args, **shadow_kwargs)
            moved_leaves = [t for t in pytree.tree_leaves(moved) if isinstance(t, torch.Tensor)]
            if len(moved_leaves) != len(outputs):
                raise ValueError("the shadow's result does not match the tensor's")
            for tensor, shadow in zip(outputs, moved_leaves, strict=True):
                if shadow.shape != tensor.shape:
                    raise ValueError("the shadow's shape does not match the tensor's")
                self._keep(tensor, _Info(shadow=shadow, act=act, marks=marks))
            return
        if len(outputs) != 1:
            for tensor in outputs:
                self._keep(tensor, _Info(shadow=None, act=act, marks=marks))
            return
        result = outputs[0]
        activations = [(t, i) for t, i in zip(tensors, infos, strict=True) if i.param is None]
        try:
            shape = torch.broadcast_shapes(*(t.shape for t, _ in activations))  # type: ignore[no-untyped-call]
        except RuntimeError:
            shape = None
        if shape != result.shape:
            # A reduction, a norm's statistics, a comparison: no feature survives.
            self._keep(result, _Info(shadow=None, act=act, marks=marks))
            return
        if name in _ACTIVATIONS:
            self._keep(result, _Info(shadow=self._shadow(activations[0][0]), act=True, marks=marks))
            return
        if name in ("mul", "__mul__", "__rmul__", "mul_") and len(activations) == 2:
            (a, ia), (b, ib) = activations
            gated = self._gate(a, ia, b, ib, result.shape)
            if gated is not None:
                self._keep(result, gated)
                return
        shadow = _combine([self._shadow(t) for t, _ in activations], result.shape)
        self._keep(result, _Info(shadow=shadow, act=act, marks=marks))

    def _gate(self, a: torch.Tensor, ia: _Info, b: torch.Tensor, ib: _Info, shape: torch.Size) -> _Info | None:
        """act(gate) * up: two linear maps' outputs, exactly one through a nonlinearity."""
        if ia.act == ib.act:
            return None
        gate, up = (a, b) if ia.act else (b, a)
        gate_shadow, up_shadow = self._shadow(gate).expand(shape), self._shadow(up).expand(shape)
        if bool((gate_shadow < 0).any()) or bool((up_shadow < 0).any()):
            return None
        if torch.equal(gate_shadow, up_shadow):
            return None  # x * act(x): an activation of one map (swish written out)
        self.trace.gates.append((gate_shadow, up_shadow))
        return _Info(shadow=up_shadow, act=True, marks=ia.marks | ib.marks)

    def _matmul(self, name: str, args: Any, kwargs: dict[str, Any], out: torch.Tensor, act: bool) -> None:
        operands = list(args) + [kwargs[k] for k in ("input", "mat1", "mat2", "weight", "other") if k in kwargs]
        if name == "addmm":
            operands = operands[1:3]  # addmm(bias, x, W)
        tensors = [t for t in operands if isinstance(t, torch.Tensor)][:2]
        if len(tensors) != 2:
            raise ValueError(f"{name} with {len(tensors)} tensors")
        lhs, rhs = tensors
        li, ri = self._info(lhs), self._info(rhs)
        if name == "__rmatmul__":
            lhs, rhs, li, ri = rhs, lhs, ri, li
        if li.param is not None and ri.param is None:
            self.trace.unsupported.append(f"parameter {li.param.name} multiplied from the left (not followed)")
            self._keep(out, _Info(shadow=None))
            return
        if ri.param is not None and rhs.dim() != 2:
            self.trace.unsupported.append(f"parameter {ri.param.name} of {rhs.dim()} dimensions in a matrix product (not followed)")
            self._keep(out, _Info(shadow=None))
            return
        if ri.param is not None:
            # linear(x, W) computes x Wᵀ: W is (out, in). x @ W computes with Wᵀ as (out, in).
            transposed = ri.param.transposed if name == "linear" else not ri.param.transposed
            source = self.trace.source()
            self.trace.linears.append(_LinearUse(source, ri.param.name, transposed, self._shadow(lhs), li.act))
            self._keep(out, _Info(shadow=_labels(source, out.shape)))
            return
        event = self.trace.source()
        self.trace.matmuls[event] = _MatMulUse(self._shadow(lhs), self._shadow(rhs))
        # P V after softmax(Q Kᵀ): attention written out by hand.
        softmaxes = [ident for mark, ident in li.marks if mark == "softmax"]
        if len(softmaxes) > 1:
            self.trace.ambiguous.append("attention weights mixed from several softmaxes")
        elif softmaxes:
            qk = self.trace.matmuls.get(self.trace.softmax_of.get(softmaxes[0], -1))
            if qk is not None:
                self._attention(qk.lhs, qk.rhs.transpose(-2, -1), self._shadow(rhs), out)
                return
        self._keep(out, _Info(shadow=None, act=act, marks=frozenset({("mm", event)})))

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        source = self.trace.source()
        self.trace.attentions.append(_AttentionUse(q, k, v, source))
        if out.dim() >= 3:
            self._keep(out, _Info(shadow=_head_labels(source, out.shape)))


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", "") or "")


def _getter_name(func: Any) -> str:
    """`Tensor.T.__get__` → "T" (properties reach the mode as their getters)."""
    owner = getattr(func, "__self__", None)
    return str(getattr(owner, "__name__", "") or "")


# --------------------------------------------------------------------------------------------
# The meta clone.

_HOOK_DICTS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")


def _own(value: Any) -> Any:
    """`value` for the clone: tensors as meta tensors, plain containers copied, the rest as is."""
    if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
        return _meta(value)
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _own(v)) for k, v in value.items())
    if type(value) in (list, tuple, set):
        return type(value)(_own(v) for v in value)
    return value


def meta_clone(module: nn.Module) -> tuple[nn.Module, dict[int, str]]:
    """A copy of `module` whose parameters, buffers and tensor attributes are meta tensors and
    which has no hooks; the original is only read. Returns it with its parameters' names."""
    names: dict[int, str] = {}

    def clone(original: nn.Module, prefix: str) -> nn.Module:
        # A new object with a shallow copy of __dict__, made without the class's own __new__
        # (FSDP2's module classes run __init__ again there, copy.copy would too).
        new = object.__new__(type(original))
        vars(new).update(vars(original))
        for key, value in list(vars(new).items()):
            if key not in ("_parameters", "_buffers", "_modules"):
                # Plain containers are copied (a lazy cache filled during the trace must not
                # fill the original's), their tensors as meta tensors; other objects are shared.
                vars(new)[key] = _own(value)
        for hooks in _HOOK_DICTS:
            if hooks in vars(new):
                vars(new)[hooks] = OrderedDict()
        # `Module.compile()` keeps a compiled call in the instance: the clone runs eagerly, so
        # tracing it never compiles (or recompiles) anything.
        vars(new).pop("_compiled_call_impl", None)
        parameters: dict[str, nn.Parameter | None] = {}
        for key, p in original._parameters.items():
            if p is None:
                parameters[key] = None
                continue
            meta = nn.Parameter(_meta(p), requires_grad=False)
            names[id(meta)] = prefix + key
            parameters[key] = meta
        new._parameters = parameters
        new._buffers = {k: (None if b is None else _meta(b)) for k, b in original._buffers.items()}
        new._modules = {k: (None if m is None else clone(m, f"{prefix}{k}.")) for k, m in original._modules.items()}
        return new

    with torch.no_grad():
        return clone(module, ""), names


def _hidden_size(block: nn.Module, embed: nn.Module | None) -> int:
    """The width of the residual stream: the embedding's, else the most common input width of
    the block's 2-D weights."""
    width = getattr(embed, "embedding_dim", None)
    if isinstance(width, int) and width > 0:
        return width
    counts: dict[int, int] = {}
    for p in block.parameters():
        if p.dim() == 2:
            counts[p.shape[1]] = counts.get(p.shape[1], 0) + 1
    if not counts:
        raise DiscoveryError("the block has no 2-D weights")
    return max(counts, key=lambda w: (counts[w], w))


def _dtype(block: nn.Module) -> torch.dtype:
    floating = [p.dtype for p in block.parameters() if p.is_floating_point()]
    return floating[0] if floating else torch.float32


class NeedsCall(DiscoveryError):
    """The block could not run on a synthesized [1, tokens, hidden] input: its forward wants
    arguments of its own (a mask, rotary tables, positions). `block` is the one to capture a
    real call of (`capture_call`)."""

    def __init__(self, message: str, block: nn.Module) -> None:
        super().__init__(message)
        self.block = block


@dataclass(frozen=True)
class BlockCall:
    """A block's arguments at a real forward, as meta tensors of batch 1 and `SEQUENCE` tokens
    (where that cut could be told) and plain values: enough to trace, nothing to hold."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    # The same with only the batch cut, when the sequence was cut too: a dimension that only
    # happened to equal the sequence length (a head width, say) makes the cut call fail, and
    # the trace then runs on this one.
    uncut: tuple[tuple[Any, ...], dict[str, Any]] | None = None


_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


def capture_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> BlockCall:
    """Meta copies of a real call's arguments (called from a forward pre-hook; reads shapes
    only). Anything but tensors and plain values is refused: tracing would call into it (a KV
    cache object would be updated). The batch is cut to 1 and the sequence, when the first
    tensor is [batch, tokens, hidden] and no other of its sizes equals tokens, to `SEQUENCE`
    tokens in every dimension of that length, so the shadows stay small."""
    leaves = pytree.tree_leaves((args, kwargs))
    odd = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, (torch.Tensor, *_PLAIN))]
    if odd:
        raise DiscoveryError(f"the block's forward takes {', '.join(sorted(set(odd)))}, which structural discovery does not call into")
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if not tensors:
        raise DiscoveryError("the block's forward took no tensor")
    first = tensors[0]
    batch = first.shape[0] if first.dim() >= 1 else None
    tokens = first.shape[1] if first.dim() == 3 and first.shape[1] not in (first.shape[0], first.shape[2]) else None

    def cut(value: Any, sequence: bool) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        shape = list(value.shape)
        if batch is not None and shape and shape[0] == batch:
            shape[0] = 1
        if sequence and tokens is not None and tokens > SEQUENCE:
            shape = [SEQUENCE if size == tokens else size for size in shape]
        return torch.empty(shape, dtype=value.dtype, device="meta")

    cut_args, cut_kwargs = pytree.tree_map(lambda v: cut(v, True), (tuple(args), dict(kwargs)))
    uncut = None
    if tokens is not None and tokens > SEQUENCE:
        batch_args, batch_kwargs = pytree.tree_map(lambda v: cut(v, False), (tuple(args), dict(kwargs)))
        uncut = (tuple(batch_args), dict(batch_kwargs))
    return BlockCall(tuple(cut_args), dict(cut_kwargs), uncut)


def trace_block(block: nn.Module, hidden: int, where: str, call: BlockCall | None = None) -> BlockMap:
    """Traces one forward of a meta clone of `block` and reads its matrices off the data flow:
    on `call`'s arguments when given, else on a synthesized [1, SEQUENCE, hidden] input."""
    try:
        clone, params = meta_clone(block)
    except Exception as e:  # a module that cannot be copied is a refusal, not a crash
        raise DiscoveryError(f"structural discovery could not copy {where} ({type(block).__name__}) to the meta device: {type(e).__name__}: {e}") from e
    clone.eval()  # the clone's own flag: dropout is identity and no random number is drawn
    trace = _Trace(params)
    if call is None:
        args: tuple[Any, ...] = (torch.zeros(1, SEQUENCE, hidden, dtype=_dtype(block), device="meta"),)
        kwargs: dict[str, Any] = {}
        given = f"a [1, {SEQUENCE}, {hidden}] input"
    else:
        args, kwargs, given = call.args, call.kwargs, "the arguments of its first forward"
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), _Recorder(trace):
            clone(*args, **kwargs)
    except DiscoveryError:
        raise
    except Exception as e:  # any failure is a refusal naming it
        if call is not None and call.uncut is not None:
            return trace_block(block, hidden, where, BlockCall(*call.uncut))
        message = f"structural discovery could not run {where} ({type(block).__name__}) on {given}: {type(e).__name__}: {e}"
        if call is None:
            raise NeedsCall(message, block) from e
        raise DiscoveryError(message) from e
    return _read(trace, block, where)


# --------------------------------------------------------------------------------------------
# Reading the trace.


def _distinct(values: torch.Tensor) -> set[int]:
    return {int(v) for v in values.reshape(-1).tolist()}


def _split(label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return label >> _FEATURE_BITS, label & _FEATURE_MASK


def _by_token_consistent(shadow: torch.Tensor, token_dim: int) -> torch.Tensor:
    """The shadow at the first token; refuses when another token's labels differ."""
    first = shadow.select(token_dim, 0).unsqueeze(token_dim)
    if not torch.equal(first.expand(shadow.shape), shadow):
        raise DiscoveryError("labels differ between tokens")
    return first.squeeze(token_dim)


def _features(shadow: torch.Tensor) -> torch.Tensor:
    """The labels of the last dimension, the same at every token (or a refusal)."""
    return _by_token_consistent(shadow.reshape(-1, shadow.shape[-1]), 0)


def _one_map(labels: torch.Tensor, linears: dict[int, _LinearUse]) -> tuple[_LinearUse, torch.Tensor] | None:
    """The one linear map every label names, with the features they name; None otherwise."""
    sources, features = _split(labels)
    found = _distinct(sources)
    source = next(iter(found)) if len(found) == 1 else None
    return (linears[source], features) if source in linears else None


def _rows_of(
    shadow: torch.Tensor, what: str, linears: dict[int, _LinearUse]
) -> tuple[_LinearUse, torch.Tensor]:
    """[..., heads, tokens, dim] → the linear map feeding it and its rows, [heads, dim]."""
    if shadow.dim() < 3:
        raise DiscoveryError(f"the attention's {what} is not laid out as [..., heads, tokens, head_dim]")
    heads = _by_token_consistent(shadow.reshape(-1, *shadow.shape[-3:])[0], 1)
    if bool((heads < 0).any()):
        why = "mixes two linear maps" if bool((heads == MIXED).any()) else "is not a linear map of the block's input"
        raise DiscoveryError(f"the attention's {what} {why}")
    found = _one_map(heads, linears)
    if found is None:
        raise DiscoveryError(f"the attention's {what} comes from {len(_distinct(_split(heads)[0]))} linear maps, expected one")
    return found


def _kv_heads(features: torch.Tensor, n_heads: int, what: str) -> torch.Tensor:
    """Rows of k or v per kv head, checking a grouped-query repeat is repeat_interleave's."""
    if features.shape[0] != n_heads:
        # Fewer heads than the query's (SDPA's enable_gqa, which repeats them interleaved).
        if features.shape[0] == 0 or n_heads % features.shape[0]:
            raise DiscoveryError(f"the attention's {what} has {features.shape[0]} heads for {n_heads} query heads")
        return features
    unique: list[torch.Tensor] = []
    of_head: list[int] = []
    for head in features:
        for j, seen in enumerate(unique):
            if torch.equal(seen, head):
                of_head.append(j)
                break
        else:
            of_head.append(len(unique))
            unique.append(head)
    n_kv = len(unique)
    if n_heads % n_kv or of_head != [h // (n_heads // n_kv) for h in range(n_heads)]:
        raise DiscoveryError(
            f"the attention's {what} heads are repeated in an order other than repeat_interleave's "
            f"(query head → kv head {of_head})"
        )
    return torch.stack(unique)


def _site(use: _LinearUse, features: torch.Tensor, block: nn.Module) -> Site:
    param = _weight(*_owner(block, use.param))
    out_features = param.shape[1] if use.transposed else param.shape[0]
    ordered = tuple(int(f) for f in features.reshape(-1))
    if ordered == tuple(range(out_features)):
        return Site(use.param, use.transposed)
    if len(set(ordered)) != len(ordered):
        raise DiscoveryError(f"rows of {use.param} are used twice")
    return Site(use.param, use.transposed, ordered)


def _owner(block: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding parameter `name` (dotted, relative to `block`) and its attribute."""
    owner, _, attr = name.rpartition(".")
    return (block.get_submodule(owner) if owner else block), attr


def _read(trace: _Trace, block: nn.Module, where: str) -> BlockMap:
    linears = {use.source: use for use in trace.linears}
    if trace.ambiguous:
        raise DiscoveryError(f"{where} has {trace.ambiguous[0]}: which one is the attention cannot be told exactly")
    if not trace.attentions:
        raise DiscoveryError(
            f"no attention found in {where}: neither scaled_dot_product_attention nor softmax(Q Kᵀ) V"
            + (f" (not followed: {'; '.join(trace.unsupported[:3])})" if trace.unsupported else "")
        )
    if len(trace.attentions) > 1:
        raise DiscoveryError(f"{len(trace.attentions)} attentions in {where}; structural discovery reads blocks with one")
    attention = trace.attentions[0]
    q_use, q_features = _rows_of(attention.q, "query", linears)
    k_use, k_features = _rows_of(attention.k, "key", linears)
    v_use, v_features = _rows_of(attention.v, "value", linears)
    n_heads, head_dim = q_features.shape
    k_heads = _kv_heads(k_features, n_heads, "key")
    v_heads = _kv_heads(v_features, n_heads, "value")
    if k_heads.shape != v_heads.shape:
        raise DiscoveryError(f"keys have {k_heads.shape[0]} heads and values {v_heads.shape[0]} in {where}")
    sites = {
        "q": _site(q_use, q_features, block),
        "k": _site(k_use, k_heads, block),
        "v": _site(v_use, v_heads, block),
    }
    attention_sources = {q_use.source, k_use.source, v_use.source}
    # o: the linear map reading the attention output.
    readers = [
        use for use in trace.linears
        if bool(((use.input_shadow >= 0) & ((use.input_shadow >> _FEATURE_BITS) == attention.output_source)).any())
    ]
    if len(readers) != 1:
        raise DiscoveryError(f"{len(readers)} linear maps read the attention output in {where}, expected one")
    o_use = readers[0]
    o_input = _features(o_use.input_shadow)
    expected = torch.arange(n_heads * head_dim, dtype=torch.int64) | (attention.output_source << _FEATURE_BITS)
    if not torch.equal(o_input, expected):
        raise DiscoveryError(f"{o_use.param} does not read the attention output feature for feature in {where}")
    sites["o"] = Site(o_use.param, o_use.transposed)
    # down: reads a nonlinearity of another map (not q/k/v/o).
    taken = attention_sources | {o_use.source}
    downs: list[tuple[_LinearUse, _LinearUse, torch.Tensor]] = []
    for use in trace.linears:
        if use.source in taken or not use.input_act:
            continue
        if bool((use.input_shadow < 0).any()):
            continue
        found = _one_map(_features(use.input_shadow), linears)
        if found is not None and found[0].source not in taken:
            downs.append((use, *found))
    if not downs:
        raise DiscoveryError(f"no MLP found in {where}: no linear map reads a nonlinearity of another's output")
    mlps = [_mlp_sites(down, up, features, trace, linears, block, where) for down, up, features in downs]
    experts: int | None = None
    if len(mlps) == 1:
        sites.update(mlps[0])
        gate = mlps[0].get("gate")
        gate_module = gate.param.rpartition(".")[0] if gate is not None and gate.param != mlps[0]["up"].param else None
        mlp_module = _common_parent(sites["down"].param, sites["up"].param)
    else:
        experts, expert_sites, mlp_module = _experts(mlps, block, where)
        sites.update(expert_sites)
        gate_module = None
    shape = AttentionShape(int(n_heads), int(k_heads.shape[0]), int(head_dim))
    return BlockMap(
        sites=sites,
        attention=shape,
        attn_module=_common_parent(sites["o"].param, sites["q"].param),
        mlp_module=mlp_module,
        gate_module=gate_module,
        experts=experts,
    )


def _mlp_sites(
    down: _LinearUse, up: _LinearUse, up_features: torch.Tensor, trace: _Trace, linears: dict[int, _LinearUse], block: nn.Module, where: str
) -> dict[str, Site]:
    """up, gate (when the MLP is gated) and down of one MLP."""
    sites = {"up": _site(up, up_features, block), "down": Site(down.param, down.transposed)}
    up_labels = up_features | (up.source << _FEATURE_BITS)
    for gate_shadow, up_shadow in trace.gates:
        if not torch.equal(_features(up_shadow), up_labels):
            continue
        gate = _one_map(_features(gate_shadow), linears)
        if gate is None:
            raise DiscoveryError(f"the MLP gate of {where} mixes linear maps")
        sites["gate"] = _site(*gate, block)
        break
    return sites


def _experts(mlps: list[dict[str, Site]], block: nn.Module, where: str) -> tuple[int, dict[str, Site], str | None]:
    """Several MLPs in one block: the experts of a ModuleList, site for site, or a refusal."""
    names = sorted(mlps, key=lambda m: m["down"].param)
    first = names[0]["down"].param.split(".")
    differing = {
        i for m in names for i, (a, b) in enumerate(zip(first, m["down"].param.split("."), strict=False)) if a != b
    }
    if len(differing) != 1:
        raise DiscoveryError(f"{len(mlps)} MLP output projections in {where}, and they are not the members of one ModuleList of experts")
    position = differing.pop()
    container = ".".join(first[:position])
    experts = block.get_submodule(container) if container else block
    count = len(experts) if isinstance(experts, nn.ModuleList) else 0
    by_index: dict[int, dict[str, Site]] = {}
    for m in mlps:
        parts = m["down"].param.split(".")
        if len(parts) <= position or not parts[position].isdigit():
            raise DiscoveryError(f"MLP output projections in {where} are not indexed experts")
        by_index[int(parts[position])] = m
    if count == 0 or sorted(by_index) != list(range(count)):
        raise DiscoveryError(
            f"{len(mlps)} MLPs in {where}, but `{container}` holds {count} experts and the trace reached {sorted(by_index)}"
        )
    sites: dict[str, Site] = {}
    for name in ("up", "gate", "down"):
        per = [by_index[e].get(name) for e in range(count)]
        if all(p is None for p in per):
            continue
        templates = {None if p is None else (_template(p.param, position), p.transposed, p.rows) for p in per}
        if len(templates) != 1 or None in templates:
            raise DiscoveryError(f"the experts of {where} differ in their {name} matrices")
        template, transposed, chosen = templates.pop()  # type: ignore[misc]
        sites[name] = Site(template, transposed, chosen, experts=count)
    # The experts' parent (the sparse MLP, router included) is the MLP's output; experts kept
    # directly in the block leave it to the block (None).
    return count, sites, ".".join(first[: position - 1]) or None


def _template(param: str, position: int) -> str:
    parts = param.split(".")
    parts[position] = "{}"
    return ".".join(parts)


def _common_parent(*params: str) -> str | None:
    """The deepest module holding every named parameter (None: the block itself)."""
    parts = [p.split(".")[:-1] for p in params]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common) or None


# --------------------------------------------------------------------------------------------
# Accessors over the live parameters.


def site_accessor(block: nn.Module, site: Site) -> MatrixAccessor:
    if site.experts is not None:
        # ModuleList experts live in separate tensors: stacking them is one copy per read.
        members = [
            site_accessor(block, Site(site.param.format(e), site.transposed, site.rows)) for e in range(site.experts)
        ]
        return lambda: torch.stack([read() for read in members])
    owner, attr = _owner(block, site.param)
    chosen = site.rows
    span: tuple[int, int] | None = None
    if chosen is not None and chosen == tuple(range(chosen[0], chosen[0] + len(chosen))):
        span = (chosen[0], chosen[0] + len(chosen))
    if chosen is not None and span is None and is_dtensor(_weight(owner, attr)):
        # A gather of rows scattered over shards would need the whole weight on every rank.
        raise DiscoveryError(
            f"the rows of {site.param} this model uses are not one range, and the weight is sharded (DTensor): measuring "
            "them would gather the whole weight; pass mapping= naming whole weights, or every={'spectral': 0}"
        )
    index_cache: dict[torch.device, torch.Tensor] = {}

    def read() -> torch.Tensor:
        weight = _weight(owner, attr).detach()
        if site.transposed:
            weight = weight.t()
        if chosen is None:
            return weight
        if span is not None:
            return rows(weight, *span)  # type: ignore[no-any-return]
        index = index_cache.get(weight.device)
        if index is None:
            index = index_cache[weight.device] = torch.tensor(chosen, dtype=torch.long, device=weight.device)
        return weight.index_select(0, index)  # rows in the order the model uses them: one copy

    return read


def _signature(block: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((name, tuple(p.shape)) for name, p in block.named_parameters())


def discover_blocks(members: list[nn.Module], embed: nn.Module | None, blocks_path: str, call: BlockCall | None = None) -> list[Block]:
    """Blocks of `members` from one trace per distinct parameter signature; `call` (captured
    from the first block's forward) serves every block with the first block's signature."""
    maps: dict[tuple[tuple[str, tuple[int, ...]], ...], BlockMap] = {}
    blocks: list[Block] = []
    first = _signature(members[0]) if members else None
    for index, member in enumerate(members):
        signature = _signature(member)
        found = maps.get(signature)
        if found is None:
            where = f"{blocks_path}.{index}" if blocks_path else f"block {index}"
            given = call if signature == first else None
            found = maps[signature] = trace_block(member, _hidden_size(member, embed), where, given)
        module = functools.partial(_module_at, member)
        blocks.append(
            Block(
                index=index,
                module=member,
                matrices={name: site_accessor(member, site) for name, site in found.sites.items()},
                attention=found.attention,
                attn_module=module(found.attn_module),
                mlp_module=module(found.mlp_module),
                gate_module=module(found.gate_module),
                experts=found.experts,
            )
        )
    return blocks


def _module_at(block: nn.Module, path: str | None) -> nn.Module | None:
    """The hook point at `path`; None for the block itself or a container (a ModuleDict has
    no forward of its own, so a hook on it would never fire)."""
    module = block.get_submodule(path) if path else None
    return None if isinstance(module, (nn.ModuleDict, nn.ModuleList)) else module
