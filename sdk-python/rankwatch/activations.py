"""Activation maxima and token cosine, measured by forward hooks while armed.

Sites (the `Site` vocabulary of the analytics crate): "embed" (the embedding module's output), "residual" (each block's
output, i.e. the residual stream after the block), "attn_out" and "mlp_out" (the attention and
MLP sublayer outputs, before the residual add), "gate" (opt-in: the gate projection's
pre-activation output of gated MLPs) and "final_norm". For each armed site the probe keeps
max |a| over real tokens — `torch.linalg.vector_norm(a, ord=inf)` — and, per block, the mean
pairwise cosine of the token states in the residual stream:

    token_cosine = (‖Σ_t u_t‖² − Σ_t ‖u_t‖²) / (T (T − 1)),   u_t = h_t / ‖h_t‖,

computed per sequence over its T real tokens (sequences with T < 2 are skipped) and averaged
over all sequences seen while armed. Σ‖u_t‖² equals T except for exactly-zero states, which it
counts as orthogonal instead of dividing by zero. 1 means every token points the same way (rank
collapse); it costs O(T·D) instead of the O(T²·D) of the explicit cosine matrix.

Padding. A [batch, seq] mask (1 = real token) is taken from the top model's `attention_mask`
argument (keyword, or positional when the forward signature names it) by a forward pre-hook, or
given with `set_mask`. A captured mask applies to the forward call it came with; a `set_mask`
mask applies until replaced. Masked positions are replaced by 0 before the max (0 cannot raise
a max of absolute values) and left out of the cosine, so huge or non-finite values in padding
never reach a metric. A mask applies to 3-D [batch, seq, hidden] activations whose batch
matches; its last `seq` columns are used, which also covers a KV cache. Other shapes are
measured unmasked.

Cost and cadence. Hooks do nothing until `arm()`; the caller decides the cadence and
`disarm()`s after the step. Armed hooks run a few fused reductions under `no_grad` and fold them,
in place, into float32 device tensors made at `arm()` (`torch.maximum(..., out=)` and `add_`): no
host sync, no Python branching on tensor values; `collect()` hands the folded tensors out and
starts over with new ones. Several forward calls while armed (gradient-accumulation
micro-batches, or gradient-checkpointing recomputation) fold into one value: the max over all of
them, the mean over all sequences. `new_step()` (the run calls it after each optimizer step)
sets the fold aside and starts a new one, so a probe armed for several steps reports the last
optimizer step's forwards only (or, when no forward came after it, the step before). With
`training_only` (what a run sets), forward passes without autograd (evaluation under `no_grad`)
are not training steps and are left out. Forward passes run inside a backward — activation
checkpointing recomputing a block — repeat a forward already measured and are left out too (the
fold would not change, and the recompute would pay the probe twice).

Memory. The token cosine works on float32 unit vectors of the hidden states; it takes them
`chunk_bytes` at a time along the sequence, so its temporary memory is bounded (64 MiB by
default) whatever the batch, sequence length and width. An error inside a hook turns the probe off (`error` says why) instead of reaching the
training step.

torch.compile. A model compiled after the probe exists traces its hooks into the graphs. Off by
default there: observing an activation inside a compiled graph adds a reduction to the graph
inductor fuses, and a different fusion can change the training step's own arithmetic (a
bf16 intermediate kept in registers in one kernel is rounded to memory in another). The hook
then does nothing inside the trace but note `compiled_skipped` (the run says so once); the
compiled graph is the unwatched one. With `compiled=True` (opted in) the hooks are traced, and
their only Python state is what the trace can guard on cheaply: `armed` (a bool: one graph
armed, one disarmed, each compiled once) and the fold's tensors, mutated in place and never
replaced by a missing key or None between calls — so arming costs at most two graphs per model,
with no graph break. A model compiled before the probe exists never calls its hooks: the run
leaves the probe off there (see run.py).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .layout import Layout

Metric = tuple[str, int | None, str | None, torch.Tensor]

DEFAULT_SITES: tuple[str, ...] = ("embed", "residual", "attn_out", "mlp_out", "final_norm")
KNOWN_SITES: frozenset[str] = frozenset(DEFAULT_SITES) | {"gate"}


def _first_tensor(output: Any) -> torch.Tensor | None:
    # HF attention and some decoder layers return tuples; the hidden states come first.
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    return output if isinstance(output, torch.Tensor) else None


def _attention_mask_position(model: nn.Module) -> int | None:
    """Index of `attention_mask` among the positional arguments of model.forward, if any."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for position, parameter in enumerate(parameters):
        if parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            return None
        if parameter.name == "attention_mask":
            return position
    return None


# (metric, site, layer): ("act_max", site, layer) or ("token_cosine", None, layer).
FoldKey = tuple[str, str | None, int | None]


class _Fold:
    """One fold's running values: a 0-dim max per act_max key, a [2] (Σ per-sequence cosine,
    sequences) per token_cosine key, each made before the forwards that fill them; `seen` says
    which keys a forward reached (written by the hooks, read on the host at collect)."""

    __slots__ = ("seen", "values")

    def __init__(self, values: dict[FoldKey, torch.Tensor]) -> None:
        self.values = values
        self.seen: dict[FoldKey, bool] = dict.fromkeys(values, False)

    def any_seen(self) -> bool:
        return any(self.seen.values())


def _device_of(module: nn.Module | None, fallback: torch.device) -> torch.device:
    parameter = next(module.parameters(), None) if module is not None else None
    return parameter.device if parameter is not None else fallback


class ActivationProbe:
    """Forward hooks for act_max per site and token_cosine per block (see module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        sites: tuple[str, ...] = DEFAULT_SITES,
        gate: bool = False,
        token_cosine: bool = True,
        training_only: bool = False,
        chunk_bytes: int = 64 << 20,
        compiled: bool = False,
    ) -> None:
        unknown = set(sites) - KNOWN_SITES
        if unknown:
            raise ValueError(f"unknown activation sites {sorted(unknown)}; known: {sorted(KNOWN_SITES)}")
        self._sites = tuple(dict.fromkeys(sites + (("gate",) if gate else ())))
        self._armed = False
        self._training_only = training_only
        self.compiled = compiled  # measure inside torch.compile graphs too (opted in)
        self.compiled_skipped = False  # a compiled graph ran the hooks while not opted in
        self.chunk_bytes = chunk_bytes
        self.elapsed = 0.0  # seconds spent in the hooks, since the run last read it
        self.error: BaseException | None = None
        self._user_mask: torch.Tensor | None = None
        self._forward_mask: torch.Tensor | None = None
        self._handles: list[RemovableHandle] = []
        self._model = model
        # Report order: embed, then each block's sites and cosine, then final_norm; each key's
        # tensors live on the device of the module it measures.
        self._order: list[FoldKey] = []
        self._where: dict[FoldKey, nn.Module] = {}
        self._fold: _Fold | None = None  # filled by the armed forwards
        self._completed: _Fold | None = None  # set aside by new_step()

        self._mask_position = _attention_mask_position(model)
        self._handles.append(model.register_forward_pre_hook(self._capture_mask, with_kwargs=True))

        if "embed" in self._sites and layout.embed is not None:
            self._watch(layout.embed, "embed", None)
        for block in layout.blocks:
            if "residual" in self._sites or token_cosine:
                self._handles.append(
                    block.module.register_forward_hook(
                        self._block_hook(block.index, "residual" in self._sites, token_cosine)
                    )
                )
                if "residual" in self._sites:
                    self._key(("act_max", "residual", block.index), block.module)
                if token_cosine:
                    self._key(("token_cosine", None, block.index), block.module)
            for site, module in (
                ("attn_out", block.attn_module),
                ("mlp_out", block.mlp_module),
                ("gate", block.gate_module),
            ):
                if site in self._sites and module is not None:
                    self._watch(module, site, block.index)
        if "final_norm" in self._sites and layout.final_norm is not None:
            self._watch(layout.final_norm, "final_norm", None)

    # ----------------------------------------------------------------------------------------
    # Public API.

    def arm(self) -> None:
        self._armed = True
        if self._fold is None:
            self._fold = self._new_fold()

    def disarm(self) -> None:
        self._armed = False

    def new_step(self) -> None:
        """Sets the fold aside: the next armed forward pass starts a new one (one optimizer
        step ended)."""
        if self._armed and self._fold is not None and self._fold.any_seen():
            try:  # inside the optimizer's step hook: a failure turns the probe off, no more
                self._completed, self._fold = self._fold, self._new_fold()
            except Exception as e:  # noqa: BLE001 - a probe must never break the step
                self.error = e
                self._armed = False

    @property
    def armed(self) -> bool:
        return self._armed

    def set_mask(self, mask: torch.Tensor | None) -> None:
        """[batch, seq] with 1 for real tokens; used when a forward call brings no mask."""
        self._user_mask = None if mask is None else (mask.detach() != 0)

    def collect(self) -> list[Metric]:
        """The values folded since the last optimizer step (or the step before, when no forward
        came after it), then start over."""
        fold = self._fold if self._fold is not None and self._fold.any_seen() else self._completed
        self._completed = None
        self._fold = self._new_fold() if self._armed else None
        if fold is None:
            return []
        out: list[Metric] = []
        for key in self._order:
            if not fold.seen[key]:
                continue
            metric, site, layer = key
            value = fold.values[key]
            if metric == "act_max":
                out.append(("act_max", layer, site, value))
            else:
                # A count of 0 (every sequence shorter than 2 real tokens) gives NaN: there
                # was nothing to measure, and deciding that on the host would need a sync.
                out.append(("token_cosine", layer, None, value[0] / value[1]))
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._armed = False
        self._fold = self._completed = None

    # ----------------------------------------------------------------------------------------
    # Folds.

    def _key(self, key: FoldKey, module: nn.Module) -> None:
        self._order.append(key)
        self._where[key] = module

    def _new_fold(self) -> _Fold:
        fallback = _device_of(self._model, torch.device("cpu"))
        return _Fold(
            {
                key: torch.zeros(() if key[0] == "act_max" else (2,), dtype=torch.float32, device=_device_of(self._where[key], fallback))
                for key in self._order
            }
        )

    def _slot(self, key: FoldKey, like: torch.Tensor) -> torch.Tensor:
        """The fold's tensor for `key`, on `like`'s device (a module whose parameters live
        elsewhere than its activations gets a tensor beside the activations, once)."""
        fold = self._fold
        assert fold is not None  # armed: arm() made it
        slot = fold.values[key]
        if slot.device != like.device:
            slot = fold.values[key] = torch.zeros_like(slot, device=like.device)
        fold.seen[key] = True
        return slot

    # ----------------------------------------------------------------------------------------
    # Hooks.

    def _live(self) -> bool:
        # Inside a compiled graph's trace: not opted in, the hook adds nothing to the graph.
        if torch.compiler.is_compiling() and not self.compiled:
            self.compiled_skipped = True
            return False
        if not self._armed or self.error is not None or (self._training_only and not torch.is_grad_enabled()):
            return False
        # Checkpoint recomputation inside a backward repeats a forward already measured.
        # (Compiled graphs recompute without calling hooks.)
        return torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1

    def _measure(self, work: Callable[[], None]) -> None:
        """Runs a hook's folds without autograd; an error turns the probe off. Eager, it also
        times them (a compiled graph has no host time of its own to give)."""
        compiling = torch.compiler.is_compiling()
        started = 0.0 if compiling else time.perf_counter()
        try:
            with torch.no_grad():
                work()
        except Exception as e:  # noqa: BLE001 - a probe must never break the step
            self.error = e
        if not compiling:
            self.elapsed += time.perf_counter() - started

    def _capture_mask(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self._live():
            return None
        mask = kwargs.get("attention_mask")
        if mask is None and self._mask_position is not None and len(args) > self._mask_position:
            mask = args[self._mask_position]
        # Only a 2-D [batch, seq] mask says which tokens are real; 4-D additive masks do not.
        self._forward_mask = mask.detach() != 0 if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        return None

    def _mask_for(self, activation: torch.Tensor) -> torch.Tensor | None:
        mask = self._forward_mask if self._forward_mask is not None else self._user_mask
        if (
            mask is None
            or activation.dim() != 3
            or mask.shape[0] != activation.shape[0]
            or mask.shape[1] < activation.shape[1]
        ):
            return None
        return mask[:, mask.shape[1] - activation.shape[1] :].to(activation.device)

    def _watch(self, module: nn.Module, site: str, layer: int | None) -> None:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if not self._live():
                return None
            activation = _first_tensor(output)
            if activation is not None:
                self._measure(lambda: self._fold_max(site, layer, activation))
            return None

        self._handles.append(module.register_forward_hook(hook))
        self._key(("act_max", site, layer), module)

    def _block_hook(self, layer: int, track_max: bool, track_cosine: bool) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if not self._live():
                return None
            hidden = _first_tensor(output)
            if hidden is None:
                return None

            def work() -> None:
                if track_max:
                    self._fold_max("residual", layer, hidden)
                if track_cosine and hidden.dim() == 3:
                    self._fold_cosine(layer, hidden)

            self._measure(work)
            return None

        return hook

    def _fold_max(self, site: str, layer: int | None, activation: torch.Tensor) -> None:
        activation = activation.detach()
        mask = self._mask_for(activation)
        if mask is not None:
            activation = torch.where(mask.unsqueeze(-1), activation, activation.new_zeros(()))
        value = torch.linalg.vector_norm(activation, ord=float("inf")).float()
        # The fold starts at 0, which no max of absolute values can be below.
        slot = self._slot(("act_max", site, layer), value)
        torch.maximum(slot, value, out=slot)

    def _fold_cosine(self, layer: int, hidden: torch.Tensor) -> None:
        hidden = hidden.detach()
        batch, seq, width = hidden.shape
        mask = self._mask_for(hidden)
        if mask is None and seq < 2:
            return
        if mask is not None:
            tokens = mask.sum(dim=1, dtype=torch.float32)
        else:
            tokens = torch.full((batch,), float(seq), device=hidden.device)
        # Σ_t u_t and Σ_t ‖u_t‖² per sequence, a bounded slice of the sequence at a time.
        step = max(1, self.chunk_bytes // max(1, batch * width * 4))
        summed = torch.zeros(batch, width, dtype=torch.float32, device=hidden.device)
        squares = torch.zeros(batch, dtype=torch.float32, device=hidden.device)
        for start in range(0, seq, step):
            part = hidden[:, start : start + step].float()
            units = part / torch.linalg.vector_norm(part, dim=-1, keepdim=True).clamp_min(1e-30)
            if mask is not None:
                # where, not multiply: padding may hold inf/NaN, and NaN * 0 is NaN.
                units = torch.where(mask[:, start : start + step].unsqueeze(-1), units, units.new_zeros(()))
            summed += units.sum(dim=1)
            squares += units.square().sum(dim=(1, 2))
        pair_sum = summed.square().sum(-1) - squares
        valid = tokens >= 2
        per_sequence = torch.where(valid, pair_sum / (tokens * (tokens - 1)).clamp_min(1.0), 0.0)
        self._slot(("token_cosine", None, layer), hidden).add_(torch.stack((per_sequence.sum(), valid.sum(dtype=torch.float32))))
