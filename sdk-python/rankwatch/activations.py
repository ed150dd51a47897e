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
`disarm()`s after the step. Armed hooks run a few fused reductions under `no_grad` and fold them
into 0-dim device tensors with `torch.maximum` and running sums: no host sync, no Python
branching on tensor values; `collect()` hands the tensors out and starts over. Several forward
calls while armed (gradient-accumulation micro-batches, or gradient-checkpointing
recomputation) fold into one value: the max over all of them, the mean over all sequences.
`new_step()` (the run calls it after each optimizer step) makes the next forward start the fold
afresh, so a probe armed for several steps reports the last optimizer step's forwards only.
With `training_only` (what a run sets), forward passes without autograd (evaluation under
`no_grad`) are not training steps and are left out. Forward passes run inside a backward —
activation checkpointing recomputing a block — repeat a forward already measured and are left
out too (the fold would not change, and the recompute would pay the probe twice).

Memory. The token cosine works on float32 unit vectors of the hidden states; it takes them
`chunk_bytes` at a time along the sequence, so its temporary memory is bounded (64 MiB by
default) whatever the batch, sequence length and width. An error inside a hook turns the probe off (`error` says why) instead of reaching the
training step.

Register the probe before `torch.compile`: compiled graphs bake in the hooks that exist when
they are traced. Toggling `arm()` then costs one guard (and a second graph), not a re-trace per
step.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .discovery import Layout

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
    ) -> None:
        unknown = set(sites) - KNOWN_SITES
        if unknown:
            raise ValueError(f"unknown activation sites {sorted(unknown)}; known: {sorted(KNOWN_SITES)}")
        self._sites = tuple(dict.fromkeys(sites + (("gate",) if gate else ())))
        self._armed = False
        self._restart = False
        self._training_only = training_only
        self.chunk_bytes = chunk_bytes
        self.elapsed = 0.0  # seconds spent in the hooks, since the run last read it
        self.error: BaseException | None = None
        self._user_mask: torch.Tensor | None = None
        self._forward_mask: torch.Tensor | None = None
        self._handles: list[RemovableHandle] = []
        # (site, layer) -> running max; layer -> running (sum of per-sequence cosines, count).
        self._maxima: dict[tuple[str, int | None], torch.Tensor] = {}
        self._cosines: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # Report order: embed, then each block's sites and cosine, then final_norm.
        self._order: list[tuple[str, str | None, int | None]] = []

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
                    self._order.append(("act_max", "residual", block.index))
                if token_cosine:
                    self._order.append(("token_cosine", None, block.index))
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

    def disarm(self) -> None:
        self._armed = False

    def new_step(self) -> None:
        """The next armed forward pass starts a new fold (one optimizer step ended)."""
        self._restart = True

    def _live(self) -> bool:
        if not self._armed or self.error is not None or (self._training_only and not torch.is_grad_enabled()):
            return False
        if torch._C._current_graph_task_id() != -1:
            return False  # checkpoint recomputation inside a backward: measured in the forward
        if self._restart:
            self._restart = False
            self._maxima = {}
            self._cosines = {}
        return True

    @property
    def armed(self) -> bool:
        return self._armed

    def set_mask(self, mask: torch.Tensor | None) -> None:
        """[batch, seq] with 1 for real tokens; used when a forward call brings no mask."""
        self._user_mask = None if mask is None else (mask.detach() != 0)

    def collect(self) -> list[Metric]:
        """All values accumulated since the last collect, then start over."""
        out: list[Metric] = []
        for metric, site, layer in self._order:
            if metric == "act_max":
                value = self._maxima.get((site, layer))  # type: ignore[arg-type]
                if value is not None:
                    out.append(("act_max", layer, site, value))
            else:
                sums = self._cosines.get(layer)  # type: ignore[arg-type]
                if sums is not None:
                    # A count of 0 (every sequence shorter than 2 real tokens) gives NaN: there
                    # was nothing to measure, and deciding that on the host would need a sync.
                    out.append(("token_cosine", layer, None, sums[0] / sums[1]))
        self._maxima = {}
        self._cosines = {}
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._armed = False

    # ----------------------------------------------------------------------------------------
    # Hooks.

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
                started = time.perf_counter()
                try:
                    with torch.no_grad():
                        self._fold_max(site, layer, activation)
                except Exception as e:  # noqa: BLE001 - a probe must never break the step
                    self.error = e
                self.elapsed += time.perf_counter() - started
            return None

        self._handles.append(module.register_forward_hook(hook))
        self._order.append(("act_max", site, layer))

    def _block_hook(self, layer: int, track_max: bool, track_cosine: bool) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if not self._live():
                return None
            hidden = _first_tensor(output)
            if hidden is None:
                return None
            started = time.perf_counter()
            try:
                with torch.no_grad():
                    if track_max:
                        self._fold_max("residual", layer, hidden)
                    if track_cosine and hidden.dim() == 3:
                        self._fold_cosine(layer, hidden)
            except Exception as e:  # noqa: BLE001 - a probe must never break the step
                self.error = e
            self.elapsed += time.perf_counter() - started
            return None

        return hook

    def _fold_max(self, site: str, layer: int | None, activation: torch.Tensor) -> None:
        activation = activation.detach()
        mask = self._mask_for(activation)
        if mask is not None:
            activation = torch.where(mask.unsqueeze(-1), activation, activation.new_zeros(()))
        value = torch.linalg.vector_norm(activation, ord=float("inf")).float()
        key = (site, layer)
        previous = self._maxima.get(key)
        self._maxima[key] = value if previous is None else torch.maximum(previous, value)

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
        total, count = per_sequence.sum(), valid.sum(dtype=torch.float32)
        previous = self._cosines.get(layer)
        self._cosines[layer] = (total, count) if previous is None else (previous[0] + total, previous[1] + count)
