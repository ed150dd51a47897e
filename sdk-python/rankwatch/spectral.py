"""Spectral norms of a model's weights by warm-started power iteration, entirely on device.

For every block the probe reports σ (the largest singular value) of each weight matrix, the
stable rank ‖W‖_F²/σ², and three operator norms that are never formed explicitly:

* σ_mlp = ‖W_down · W_up‖₂ (the design's "1:1 rule" numerator; the gate is left out as in the
  published definition),
* σ_attn = ‖W_o‖₂,
* σ_OV = ‖W_o · R · W_v‖₂, where R copies each key/value head to the n_heads/n_kv_heads query
  heads that read it (grouped-query attention; `repeat_kv` in transformers: query head h uses
  kv head h // group). With n_kv_heads == n_heads, R is the identity.

and the ratios σ_mlp/σ_attn and σ_mlp/σ_OV.

How. Each of those is the norm of a linear operator A given as a chain of stages (matrices and
the head replication R). Power iteration on AᵀA only needs A·x and Aᵀ·y, which the chain
applies stage by stage, so a product is never materialised (for MLPs that is the difference
between two matrix-vector products and a d×d GEMM). The right-singular-vector estimate of every
operator persists on the weights' device between calls: the first call runs `cold_iters`
iterations from a seeded random start, later calls run `iters` warm iterations — weights move
little between probes, so one or two iterations keep the estimate converged (the σReparam
observation). σ is then ‖A v‖ for the unit vector v, which approaches σ from below.

Device discipline: `compute` never reads a value back to the host. Results are 0-dim float32
tensors on the weights' device; degenerate cases (a zero or non-finite iterate) are handled with
`torch.where`, not Python branches, and keep the previous estimate so one bad step does not
poison the state. Everything runs in float32: bf16/fp16 weights are upcast once per call per
matrix (a temporary copy, one layer at a time; the parameters themselves are never written).

Mixture of experts: 3-D (experts, out, in) weights are batched with `bmm`, one singular vector
per expert. Per-matrix σ and σ_mlp report the MAX over experts (the expert closest to blowing
up); stable rank reports the MIN over experts (the most collapsed one). Both are the values an
alert on that layer should look at.

Matrices are not stacked across layers: `torch.stack` would copy every weight on every call,
which costs more memory traffic than the kernel launches it saves for realistic widths. To bound
the cost per call, `layers_per_call` spreads the layers round-robin over successive calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .discovery import MATRIX_SITES, AttentionShape, Layout

Metric = tuple[str, int | None, str | None, torch.Tensor]

# A norm below this is treated as "no direction": the previous vector is kept instead.
_TINY = 1e-30


@dataclass(frozen=True)
class _Matrix:
    """A (batch, out, in) float32 weight (batch = experts, or 1 for an ordinary matrix)."""

    weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(self.weight, x)

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        return torch.bmm(self.weight.transpose(1, 2), y)


@dataclass(frozen=True)
class _ReplicateHeads:
    """R of grouped-query attention: (n_kv*hd) -> (n_kv*group*hd), kv head j feeds query heads
    j*group .. j*group+group-1. Its adjoint sums each group back."""

    n_kv_heads: int
    group: int
    head_dim: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        heads = x.reshape(batch, self.n_kv_heads, 1, self.head_dim)
        return heads.expand(batch, self.n_kv_heads, self.group, self.head_dim).reshape(batch, -1, 1)

    def adjoint(self, y: torch.Tensor) -> torch.Tensor:
        batch = y.shape[0]
        return y.reshape(batch, self.n_kv_heads, self.group, self.head_dim).sum(2).reshape(batch, -1, 1)


_Stage = _Matrix | _ReplicateHeads


def _apply(stages: list[_Stage], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage.forward(x)
    return x


def _apply_adjoint(stages: list[_Stage], y: torch.Tensor) -> torch.Tensor:
    for stage in reversed(stages):
        y = stage.adjoint(y)
    return y


def _batch_norm(x: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True)


@dataclass
class _VectorState:
    vector: torch.Tensor  # (batch, in, 1), unit norm per batch entry


class SpectralProbe:
    """Per-layer spectral norms of the matrices in `layout` (see the module docstring)."""

    def __init__(
        self,
        layout: Layout,
        iters: int = 2,
        cold_iters: int = 30,
        seed: int = 0,
        layers_per_call: int | None = None,
    ) -> None:
        if iters < 1 or cold_iters < 1:
            raise ValueError("iters and cold_iters must be at least 1")
        if layers_per_call is not None and layers_per_call < 1:
            raise ValueError("layers_per_call must be at least 1 (or None for all layers)")
        self.layout = layout
        self.iters = iters
        self.cold_iters = cold_iters
        self.seed = seed
        self.layers_per_call = layers_per_call
        self._states: dict[tuple[int, str], _VectorState] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._cursor = 0
        # Shape checks happen once, here, so that compute() only ever branches on structure.
        for block in layout.blocks:
            if "o" in block.matrices and "v" in block.matrices and block.attention is not None:
                self._check_attention(block.index, block.attention, block.matrices["v"](), block.matrices["o"]())

    @staticmethod
    def _check_attention(index: int, shape: AttentionShape, w_v: torch.Tensor, w_o: torch.Tensor) -> None:
        if shape.n_heads % shape.n_kv_heads:
            raise ValueError(f"layer {index}: n_heads {shape.n_heads} not a multiple of n_kv_heads {shape.n_kv_heads}")
        if w_v.shape[-2] != shape.n_kv_heads * shape.head_dim or w_o.shape[-1] != shape.n_heads * shape.head_dim:
            raise ValueError(
                f"layer {index}: W_v {tuple(w_v.shape)} / W_o {tuple(w_o.shape)} do not match "
                f"attention shape {shape}"
            )

    # ----------------------------------------------------------------------------------------

    def _generator(self, device: torch.device) -> torch.Generator | None:
        if device.type == "meta":
            # Meta tensors carry no data (tests run the probe on them to prove it never reads a
            # value back); there is nothing to seed.
            return None
        if device not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[device] = generator
        return self._generators[device]

    def _sigma(self, key: tuple[int, str], stages: list[_Stage], batch: int, width: int, device: torch.device) -> torch.Tensor:
        """σ per batch entry, shape (batch,), advancing the persistent vector estimate."""
        state = self._states.get(key)
        if state is None or state.vector.shape != (batch, width, 1) or state.vector.device != device:
            start = torch.randn(batch, width, 1, generator=self._generator(device), device=device)
            state = _VectorState(start / _batch_norm(start))
            self._states[key] = state
            steps = self.cold_iters
        else:
            steps = self.iters
        vector = state.vector
        for _ in range(steps):
            image = _apply_adjoint(stages, _apply(stages, vector))
            norm = _batch_norm(image)
            usable = torch.isfinite(norm) & (norm > _TINY)
            vector = torch.where(usable, image / norm.clamp_min(_TINY), vector)
        state.vector = vector
        return _batch_norm(_apply(stages, vector)).reshape(batch)

    def _layers_this_call(self) -> list[int]:
        count = len(self.layout.blocks)
        if self.layers_per_call is None or self.layers_per_call >= count:
            return list(range(count))
        chosen = [(self._cursor + i) % count for i in range(self.layers_per_call)]
        self._cursor = (self._cursor + self.layers_per_call) % count
        return chosen

    @torch.no_grad()
    def compute(self) -> list[Metric]:
        """Metrics for this call's layers: (metric, layer, site, 0-dim float32 tensor)."""
        out: list[Metric] = []
        for position in self._layers_this_call():
            block = self.layout.blocks[position]
            layer = block.index
            # One float32 (batch, out, in) copy-or-view per matrix per call, shared by all operators.
            weights: dict[str, torch.Tensor] = {}
            for site in MATRIX_SITES:
                if site in block.matrices:
                    w = block.matrices[site]()
                    weights[site] = (w if w.dim() == 3 else w.unsqueeze(0)).float()
            sigmas: dict[str, torch.Tensor] = {}
            for site, w in weights.items():
                per_batch = self._sigma((layer, site), [_Matrix(w)], w.shape[0], w.shape[2], w.device)
                sigmas[site] = per_batch.max()
                frobenius_sq = torch.linalg.vector_norm(w, dim=(1, 2)).square()
                out.append(("spectral.sigma", layer, site, sigmas[site]))
                out.append(("stable_rank", layer, site, (frobenius_sq / per_batch.square()).min()))
            attn = sigmas.get("o")
            if attn is not None:
                out.append(("spectral.attn", layer, None, attn))
            mlp = None
            if "up" in weights and "down" in weights:
                up, down = weights["up"], weights["down"]
                mlp = self._sigma((layer, "mlp"), [_Matrix(up), _Matrix(down)], up.shape[0], up.shape[2], up.device).max()
                out.append(("spectral.mlp", layer, None, mlp))
                if attn is not None:
                    out.append(("spectral.ratio", layer, None, mlp / attn))
            ov = self._ov(block.attention, weights, layer)
            if ov is not None:
                out.append(("spectral.ov", layer, None, ov))
                if mlp is not None:
                    out.append(("spectral.ratio_ov", layer, None, mlp / ov))
        return out

    def _ov(self, shape: AttentionShape | None, weights: dict[str, torch.Tensor], layer: int) -> torch.Tensor | None:
        if "v" not in weights or "o" not in weights:
            return None
        w_v, w_o = weights["v"], weights["o"]
        stages: list[_Stage] = [_Matrix(w_v)]
        if shape is not None and shape.n_kv_heads != shape.n_heads:
            stages.append(_ReplicateHeads(shape.n_kv_heads, shape.n_heads // shape.n_kv_heads, shape.head_dim))
        elif w_v.shape[1] != w_o.shape[2]:
            # Without an attention shape the replication is unknown: report nothing rather than
            # guess. (Discovery supplies the shape for every known family.)
            return None
        stages.append(_Matrix(w_o))
        return self._sigma((layer, "ov"), stages, w_v.shape[0], w_v.shape[2], w_v.device).max()

    def reset(self) -> None:
        """Forget all singular-vector estimates (the next call cold-starts)."""
        self._states.clear()
        self._generators.clear()
        self._cursor = 0
