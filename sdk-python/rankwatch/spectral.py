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

Beside them, from the weights alone, the block's effective rank: the participation ratio
(Σσᵢ²)²/Σσᵢ⁴ (the order-2 Rényi effective rank, between 1 and the width d) of the block's
linearised map L = (I + W_down·W_up)(I + W_o·R·W_v) — the residual stream through the attention's
value path with uniform mixing and through the MLP with its nonlinearity, gate and layer norms
left out, as σ_mlp leaves them out. It reads how many directions a block keeps: a block whose
products grow along a few directions (the weight-side picture of rank collapse in the "1:1
rule" argument) drives it towards 1 without any data. Σσ² = ‖L‖_F² and Σσ⁴ = ‖LᵀL‖_F² are traces
estimated with `erank_probes` fixed probe vectors u (‖L‖_F² ≈ (d/k)·Σ‖Lu‖², then ‖LᵀL‖_F² from
Lᵀ applied to the same images): exact when d ≤ `erank_probes` (the probes are then the
standard basis), otherwise Rademacher vectors drawn from a generator seeded by the probe's seed
and the width alone — the same on every rank, after a restart and whatever the order layers
are measured in — so a layer's series moves only with its weights. One call costs one pass of
L and one of Lᵀ over a block of k vectors: about one power iteration's weight traffic, but
k vectors of the widest dimension as buffers (k·4·d_ff bytes a layer; 7 MB at d_ff 28,672 and
k = 64). Those blocks run a few layers at a time, as many as fit in `chunk_bytes`, after the
other operators, so under sharding the vectors summed over the mesh per step stay within that
bound too. `erank_probes=0` turns the metric off. Not reported for experts (which expert's MLP
would the map use?).

How. Each of those is the norm of a linear operator A given as a chain of stages (matrices and
the head replication R). Power iteration on AᵀA only needs A·x and Aᵀ·y, which the chain
applies stage by stage, so a product is never materialised (for MLPs that is the difference
between two matrix-vector products and a d×d GEMM). The right-singular-vector estimate of every
operator persists on the weights' device between calls: the first call runs `cold_iters`
iterations from a seeded random start, later calls run `iters` warm iterations — weights move
little between probes, so one or two iterations keep the estimate converged (the σReparam
observation). σ is then ‖A v‖ for the unit vector v, which approaches σ from below.

Sharded weights (FSDP2, tensor parallelism, both). A DTensor weight is used where it lies: each
rank multiplies by its own block of the matrix and writes the result into a zero vector of the
full length; summing those vectors over the device mesh gives W·x (and Wᵀ·y the same way), so
per stage and iteration the ranks exchange one vector of the matrix's width — kilobytes — and
never gather a weight (the effective rank exchanges blocks of `erank_probes` such vectors,
grouped within `chunk_bytes`, below). Replicated mesh dimensions contribute only from their first coordinate,
so a replicated block is counted once. Every operator of a call is a generator that yields the
vectors it needs summed; the probe runs all of them in lockstep and sums everything one step
yields with one all-reduce per mesh dimension. Every rank has the same layers, operators and
shapes, so every rank issues the same collectives in the same order, and the number of
collectives per call is a few per iteration, whatever the number of layers. A layout whose
weights are plain tensors issues none.

Device discipline: `compute` never reads a value back to the host. Results are 0-dim float32
tensors on the weights' device; degenerate cases (a zero or non-finite iterate) are handled with
`torch.where`, not Python branches, and keep the previous estimate so one bad step does not
poison the state. Everything runs in float32, but a weight is never copied whole: bf16/fp16
weights are upcast `chunk_bytes` at a time (rows of the matrix), and the effective rank's
probe blocks run in groups within `chunk_bytes`, so the temporary memory of a call is bounded
by that budget plus one layer's probe block.

Mixture of experts: 3-D (experts, out, in) weights are batched with `bmm`, one singular vector
per expert. Per-matrix σ and σ_mlp report the MAX over experts (the expert closest to blowing
up); stable rank reports the MIN over experts (the most collapsed one). Both are the values an
alert on that layer should look at.

Which layers, where. `layers_per_call` spreads the layers round-robin over successive calls.
With `reporters` > 1 ranks the layers are also shared out: position p is reported by rank
p % reporters. Replicated weights are then measured only by the rank that reports them (each
data-parallel rank does 1/reporters of the work, so none is the straggler); sharded weights are
measured by every rank together, each doing its share of every product.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .layout import AttentionShape, Layout, RowSlice, is_dtensor
from .mapping import MATRIX_SITES

Metric = tuple[str, int | None, str | None, torch.Tensor]
# A step of lockstep work: yields partial vectors to be summed over the mesh, receives the sums.
Work = Generator[torch.Tensor, torch.Tensor, Any]

# A norm below this is treated as "no direction": the previous vector is kept instead.
_TINY = 1e-30
DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_ERANK_PROBES = 64


class ShardingError(ValueError):
    """A weight is distributed in a way the spectral probe cannot measure exactly."""


@dataclass(frozen=True)
class _Matrix:
    """A (batch, out, in) weight, of which this rank holds the block `local` at `offset`.

    For a plain tensor the block is the whole matrix. `owner` is False on ranks whose block is a
    replica of another rank's (it then contributes nothing to the sums); `collective` says that
    other ranks hold the rest, so results are partial sums to be completed over the mesh."""

    local: torch.Tensor
    shape: tuple[int, int, int]
    offset: tuple[int, int, int]
    owner: bool
    collective: bool
    chunk_rows: int

    def _rows(self) -> range:
        return range(0, self.local.shape[1], self.chunk_rows)

    def _chunk(self, start: int) -> torch.Tensor:
        # A float32 view when the weight is float32; otherwise a bounded temporary copy.
        return self.local[:, start : start + self.chunk_rows].float()

    def _local_forward(self, x: torch.Tensor) -> torch.Tensor:
        b0, _, c0 = self.offset
        b, _, c = self.local.shape
        xs = x[b0 : b0 + b, c0 : c0 + c]
        return torch.cat([torch.bmm(self._chunk(s), xs) for s in self._rows()], dim=1)

    def _local_adjoint(self, y: torch.Tensor) -> torch.Tensor:
        b0, r0, _ = self.offset
        b = self.local.shape[0]
        ys = y[b0 : b0 + b, r0 : r0 + self.local.shape[1]]
        total = None
        for s in self._rows():
            part = torch.bmm(self._chunk(s).transpose(1, 2), ys[:, s : s + self.chunk_rows])
            total = part if total is None else total + part
        assert total is not None
        return total

    def _complete(self, local: Callable[[torch.Tensor], torch.Tensor], v: torch.Tensor, length: int, start: int, count: int) -> Work:
        """`local(v)`, this rank's rows start:start+count of a result of `length`; completed by
        the other ranks' parts (a sum over the mesh) when the weight is sharded."""
        if not self.collective:
            return local(v)
        full = v.new_zeros(v.shape[0], length, v.shape[2])
        if self.owner:
            b0 = self.offset[0]
            full[b0 : b0 + self.local.shape[0], start : start + count] = local(v)
        return (yield full)

    def forward(self, x: torch.Tensor) -> Work:
        return (yield from self._complete(self._local_forward, x, self.shape[1], self.offset[1], self.local.shape[1]))

    def adjoint(self, y: torch.Tensor) -> Work:
        return (yield from self._complete(self._local_adjoint, y, self.shape[2], self.offset[2], self.local.shape[2]))

    def frobenius_sq(self) -> Work:
        """‖W‖_F² per batch entry, shape (batch,)."""
        b0 = self.offset[0]
        b = self.local.shape[0]
        local = sum((self._chunk(s).square().sum(dim=(1, 2)) for s in self._rows()), torch.zeros(b, device=self.local.device))
        if not self.collective:
            return local
        full = local.new_zeros(self.shape[0])
        if self.owner:
            full[b0 : b0 + b] = local
        return (yield full)


@dataclass(frozen=True)
class _ReplicateHeads:
    """R of grouped-query attention: (n_kv*hd) -> (n_kv*group*hd), kv head j feeds query heads
    j*group .. j*group+group-1. Its adjoint sums each group back."""

    n_kv_heads: int
    group: int
    head_dim: int

    def forward(self, x: torch.Tensor) -> Work:
        batch, columns = x.shape[0], x.shape[2]
        heads = x.reshape(batch, self.n_kv_heads, 1, self.head_dim, columns)
        return heads.expand(batch, self.n_kv_heads, self.group, self.head_dim, columns).reshape(batch, -1, columns)
        yield  # a generator that never needs the mesh

    def adjoint(self, y: torch.Tensor) -> Work:
        batch, columns = y.shape[0], y.shape[2]
        return y.reshape(batch, self.n_kv_heads, self.group, self.head_dim, columns).sum(2).reshape(batch, -1, columns)
        yield


@dataclass(frozen=True)
class _Residual:
    """I + A for a chain A that maps a width to itself (a residual branch, linearised)."""

    stages: tuple[_Stage, ...]

    def forward(self, x: torch.Tensor) -> Work:
        image = yield from _apply(self.stages, x)
        return x + image

    def adjoint(self, y: torch.Tensor) -> Work:
        image = yield from _apply_adjoint(self.stages, y)
        return y + image


_Stage = _Matrix | _ReplicateHeads | _Residual


def _apply(stages: Sequence[_Stage], x: torch.Tensor) -> Work:
    for stage in stages:
        x = yield from stage.forward(x)
    return x


def _apply_adjoint(stages: Sequence[_Stage], y: torch.Tensor) -> Work:
    for stage in reversed(stages):
        y = yield from stage.adjoint(y)
    return y


def _three(dims: Sequence[int]) -> tuple[int, int, int]:
    """A (batch, out, in) shape or offset; the weights here are 3-D or made so."""
    batch, out, inner = dims
    return batch, out, inner


def _batch_norm(x: torch.Tensor) -> torch.Tensor:
    norm: torch.Tensor = torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True)
    return norm


def run_lockstep(works: Sequence[Work], reduce: Callable[[torch.Tensor], None]) -> list[Any]:
    """Runs generators side by side: whatever they yield at one step is summed by one `reduce`
    of the concatenation (in place), and each gets its part back. Returns their results."""
    results: list[Any] = [None] * len(works)
    waiting: dict[int, torch.Tensor] = {}

    def advance(i: int, value: torch.Tensor | None) -> None:
        try:
            waiting[i] = works[i].send(value)  # type: ignore[arg-type]
        except StopIteration as done:
            results[i] = done.value
            waiting.pop(i, None)

    for i in range(len(works)):
        advance(i, None)
    while waiting:
        order = sorted(waiting)
        parts = [waiting[i] for i in order]
        flat = torch.cat([p.reshape(-1).float() for p in parts])
        reduce(flat)
        start = 0
        for i, part in zip(order, parts, strict=True):
            n = part.numel()
            advance(i, flat[start : start + n].reshape(part.shape).to(part.dtype))
            start += n
    return results


class _Mesh:
    """Sums a tensor over every rank of a DTensor device mesh (one all-reduce per dimension)."""

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self.size = int(mesh.size())

    def reduce(self, flat: torch.Tensor) -> None:
        import torch.distributed as dist

        for dim in range(self.mesh.ndim):
            dist.all_reduce(flat, group=self.mesh.get_group(dim))


def _as_matrix(weight: torch.Tensor | RowSlice, chunk_bytes: int, where: str) -> tuple[_Matrix, Any]:
    """The stage for `weight` (2-D or 3-D, plain or DTensor, or rows of a row-sharded DTensor)
    and its device mesh (or None)."""
    if isinstance(weight, RowSlice):
        whole, mesh = _as_matrix(weight.base, chunk_bytes, where)
        # This rank's rows of the whole weight, intersected with the slice's rows.
        first, count = whole.offset[1], whole.local.shape[1]
        lo, hi = max(first, weight.start), min(first + count, weight.stop)
        hi = max(hi, lo)
        local = whole.local[:, lo - first : hi - first]
        shape = (whole.shape[0], weight.stop - weight.start, whole.shape[2])
        offset = (whole.offset[0], lo - weight.start if hi > lo else 0, whole.offset[2])
        return _Matrix(local, shape, offset, whole.owner and hi > lo, True, whole.chunk_rows), mesh
    if not is_dtensor(weight):
        w = weight.detach()
        w3 = w if w.dim() == 3 else w.unsqueeze(0)
        rows = _chunk_rows(w3, chunk_bytes)
        return _Matrix(w3, _three(w3.shape), (0, 0, 0), True, False, rows), None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = weight.device_mesh, tuple(weight.placements)
    for placement in placements:
        if type(placement) not in (Replicate, Shard):
            raise ShardingError(f"{where}: a weight placed as {placement} (only Shard and Replicate blocks can be measured without gathering)")
    local = weight.to_local().detach()
    _, global_offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ShardingError(f"{where}: this rank is not part of the weight's device mesh")
    owner = all(c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate))
    if weight.dim() == 2:
        local, dims, at = local.unsqueeze(0), (1, *weight.shape), (0, *global_offset)
    else:
        dims, at = tuple(weight.shape), tuple(global_offset)
    rows = _chunk_rows(local, chunk_bytes)
    return _Matrix(local, _three(dims), _three(at), owner, True, rows), mesh


def _chunk_rows(w: torch.Tensor, chunk_bytes: int) -> int:
    """Rows per float32 temporary: all of them for float32 weights (views, no copy)."""
    rows = max(1, w.shape[1])
    if w.dtype == torch.float32:
        return rows
    per_row = max(1, w.shape[0] * w.shape[2] * 4)
    return max(1, min(rows, chunk_bytes // per_row))


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
        *,
        reporter: int = 0,
        reporters: int = 1,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        erank_probes: int = DEFAULT_ERANK_PROBES,
    ) -> None:
        if iters < 1 or cold_iters < 1:
            raise ValueError("iters and cold_iters must be at least 1")
        if layers_per_call is not None and layers_per_call < 1:
            raise ValueError("layers_per_call must be at least 1 (or None for all layers)")
        if reporters < 1 or not 0 <= reporter < reporters:
            raise ValueError(f"reporter {reporter} is not within {reporters} reporters")
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        if erank_probes < 0:
            raise ValueError(f"erank_probes (watch's effective_rank_probes) must be 0 (off) or more, got {erank_probes}")
        self.layout = layout
        self.iters = iters
        self.cold_iters = cold_iters
        self.seed = seed
        self.layers_per_call = layers_per_call
        self.reporter = reporter
        self.reporters = reporters
        self.chunk_bytes = chunk_bytes
        self.erank_probes = erank_probes
        self._probes: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._states: dict[tuple[int, str], _VectorState] = {}
        self._generators: dict[torch.device, torch.Generator] = {}
        self._cursor = 0
        self._mesh: _Mesh | None = None
        # Shape and placement checks happen once, here, so that compute() only ever branches on
        # structure; the mesh found here decides whether calls are collective.
        for block in layout.blocks:
            for site in block.sites():
                _, mesh = _as_matrix(block.matrices[site](), chunk_bytes, f"layer {block.index} {site}")
                if mesh is not None:
                    if self._mesh is not None and mesh != self._mesh.mesh:
                        raise ShardingError(f"layer {block.index} {site}: weights on more than one device mesh ({self._mesh.mesh} and {mesh})")
                    self._mesh = self._mesh or _Mesh(mesh)
            if "o" in block.matrices and "v" in block.matrices and block.attention is not None:
                self._check_attention(block.index, block.attention, block.matrices["v"](), block.matrices["o"]())

    @property
    def mesh_size(self) -> int:
        """Ranks taking part in each call (1 when no weight is sharded)."""
        return self._mesh.size if self._mesh is not None else 1

    @property
    def collective(self) -> bool:
        """Whether calls issue collectives (some weight is sharded): every rank of the mesh must
        then call `compute` at the same steps."""
        return self._mesh is not None

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

    def _sigma(self, key: tuple[int, str], stages: list[_Stage], batch: int, width: int, device: torch.device) -> Work:
        """σ per batch entry, shape (batch,), advancing the persistent vector estimate."""
        state = self._states.get(key)
        if state is None or state.vector.shape != (batch, width, 1) or state.vector.device != device:
            # The same seeded start on every rank: sharded operators need identical vectors.
            start = torch.randn(batch, width, 1, generator=self._generator(device), device=device)
            state = _VectorState(start / _batch_norm(start))
            self._states[key] = state
            steps = self.cold_iters
        else:
            steps = self.iters
        vector = state.vector
        for _ in range(steps):
            image = yield from _apply(stages, vector)
            image = yield from _apply_adjoint(stages, image)
            norm = _batch_norm(image)
            usable = torch.isfinite(norm) & (norm > _TINY)
            vector = torch.where(usable, image / norm.clamp_min(_TINY), vector)
        state.vector = vector
        final = yield from _apply(stages, vector)
        return _batch_norm(final).reshape(batch)

    def _erank_probes(self, width: int, device: torch.device) -> torch.Tensor:
        """The (1, width, k) probe block for this width, shared by the layers that have it."""
        probes = self._probes.get((width, device))
        if probes is None:
            if width <= self.erank_probes:
                # The standard basis: the traces are exact.
                probes = torch.eye(width, device=device).unsqueeze(0)
            else:
                # Signs from the seed and the width alone: identical on every rank (sharded
                # operators need identical vectors), after a restart, in any layer order.
                generator = None
                if device.type != "meta":
                    generator = torch.Generator(device=device)
                    generator.manual_seed(self.seed * 1_000_003 + width)
                signs = torch.randint(0, 2, (1, width, self.erank_probes), generator=generator, device=device)
                probes = (signs.float() * 2 - 1) / width**0.5
            self._probes[(width, device)] = probes
        return probes

    def _participation(self, stages: list[_Stage], width: int, device: torch.device) -> Work:
        """(Σσ²)²/Σσ⁴ of the chain (width → width), shape (1,), from fixed probe vectors."""
        probes = self._erank_probes(width, device)
        scale = width / probes.shape[2]  # unit probes: E[Σ‖Lu‖²] = (k/d)·‖L‖_F²
        image = yield from _apply(stages, probes)
        back = yield from _apply_adjoint(stages, image)
        sum_sq = image.square().sum(dim=(1, 2)) * scale
        sum_fourth = back.square().sum(dim=(1, 2)) * scale
        return sum_sq.square() / sum_fourth.clamp_min(_TINY)

    def _layers_this_call(self) -> list[int]:
        positions = list(range(len(self.layout.blocks)))
        if not self.collective:
            # Replicated weights: this rank measures only what it reports.
            positions = [p for p in positions if p % self.reporters == self.reporter]
        count = len(positions)
        if self.layers_per_call is None or self.layers_per_call >= count:
            return positions
        chosen = [positions[(self._cursor + i) % count] for i in range(self.layers_per_call)]
        self._cursor = (self._cursor + self.layers_per_call) % count
        return chosen

    @torch.no_grad()
    def compute(self) -> list[Metric]:
        """Metrics for this call's layers that this rank reports: (metric, layer, site, 0-dim
        float32 tensor)."""
        jobs: list[tuple[int, str, Work]] = []
        plans = []
        for position in self._layers_this_call():
            plan = _LayerPlan(self, position)
            plans.append(plan)
            jobs.extend((len(plans) - 1, name, work) for name, work in plan.works())
        reduce = self._mesh.reduce if self._mesh is not None else _no_reduce
        by_plan: list[dict[str, torch.Tensor]] = [{} for _ in plans]
        # Vectors first, all layers in lockstep; then the effective rank's k-vector blocks a
        # few layers at a time, so what one step holds (and sums over the mesh) stays within
        # chunk_bytes. Every rank has the same layers and shapes, so the same groups.
        for group in self._groups(jobs, plans):
            results = run_lockstep([w for _, _, w in group], reduce)
            for (index, name, _), value in zip(group, results, strict=True):
                by_plan[index][name] = value
        out: list[Metric] = []
        for plan, values in zip(plans, by_plan, strict=True):
            if plan.position % self.reporters == self.reporter:
                out.extend(plan.metrics(values))
        return out

    def _groups(self, jobs: list[tuple[int, str, Work]], plans: list[_LayerPlan]) -> list[list[tuple[int, str, Work]]]:
        groups: list[list[tuple[int, str, Work]]] = [[job for job in jobs if job[1] != "erank"]]
        size = 0
        for job in (job for job in jobs if job[1] == "erank"):
            cost = plans[job[0]].erank_bytes
            if len(groups) == 1 or (size + cost > self.chunk_bytes and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(job)
            size += cost
        return [group for group in groups if group]

    def reset(self) -> None:
        """Forget all singular-vector estimates (the next call cold-starts)."""
        self._states.clear()
        self._probes.clear()
        self._generators.clear()
        self._cursor = 0


def _no_reduce(flat: torch.Tensor) -> None:  # pragma: no cover - local stages never yield
    raise AssertionError("a local spectral operator asked for a collective")


class _LayerPlan:
    """The operators of one block for one call, and how their results become metrics."""

    def __init__(self, probe: SpectralProbe, position: int) -> None:
        block = probe.layout.blocks[position]
        self.probe = probe
        self.position = position
        self.layer = block.index
        self.attention = block.attention
        self.erank_bytes = 0
        # One stage per matrix per call (views of the parameters), shared by all operators.
        self.matrices = {site: _as_matrix(block.matrices[site](), probe.chunk_bytes, f"layer {block.index} {site}")[0] for site in MATRIX_SITES if site in block.matrices}

    def _device(self) -> torch.device:
        return next(iter(self.matrices.values())).local.device

    def works(self) -> list[tuple[str, Work]]:
        probe, out = self.probe, []
        device = self._device()
        for site, m in self.matrices.items():
            out.append((site, probe._sigma((self.layer, site), [m], m.shape[0], m.shape[2], device)))
            out.append((f"frob:{site}", m.frobenius_sq()))
        if "up" in self.matrices and "down" in self.matrices:
            up, down = self.matrices["up"], self.matrices["down"]
            out.append(("mlp", probe._sigma((self.layer, "mlp"), [up, down], up.shape[0], up.shape[2], device)))
        ov = self._ov_stages()
        if ov is not None:
            w_v = self.matrices["v"]
            out.append(("ov", probe._sigma((self.layer, "ov"), ov, w_v.shape[0], w_v.shape[2], device)))
        linear = self._linearised(ov) if probe.erank_probes > 0 else None
        if linear is not None:
            width = self.matrices["up"].shape[2]
            widest = max(max(m.shape[1], m.shape[2]) for m in self.matrices.values())
            self.erank_bytes = 4 * widest * min(width, probe.erank_probes)
            out.append(("erank", probe._participation(linear, width, device)))
        return out

    def _linearised(self, ov: list[_Stage] | None) -> list[_Stage] | None:
        """(I + W_down·W_up)(I + W_o·R·W_v) as stages, for a dense block whose branches map
        the residual width to itself; None otherwise (experts, a missing matrix)."""
        if ov is None or "up" not in self.matrices or "down" not in self.matrices:
            return None
        up, down = self.matrices["up"], self.matrices["down"]
        width = up.shape[2]
        if any(m.shape[0] != 1 for m in self.matrices.values()) or down.shape[1] != width:
            return None
        if self.matrices["v"].shape[2] != width or self.matrices["o"].shape[1] != width:
            return None
        return [_Residual(tuple(ov)), _Residual((up, down))]

    def _ov_stages(self) -> list[_Stage] | None:
        if "v" not in self.matrices or "o" not in self.matrices:
            return None
        w_v, w_o = self.matrices["v"], self.matrices["o"]
        stages: list[_Stage] = [w_v]
        shape = self.attention
        if shape is not None and shape.n_kv_heads != shape.n_heads:
            stages.append(_ReplicateHeads(shape.n_kv_heads, shape.n_heads // shape.n_kv_heads, shape.head_dim))
        elif w_v.shape[1] != w_o.shape[2]:
            # Without an attention shape the replication is unknown: report nothing rather than
            # guess. (Discovery supplies the shape for every known family.)
            return None
        stages.append(w_o)
        return stages

    def metrics(self, values: dict[str, torch.Tensor]) -> list[Metric]:
        out: list[Metric] = []
        layer = self.layer
        for site in self.matrices:
            per_batch = values[site]
            out.append(("spectral.sigma", layer, site, per_batch.max()))
            out.append(("stable_rank", layer, site, (values[f"frob:{site}"] / per_batch.square()).min()))
        attn = values["o"].max() if "o" in values else None
        if attn is not None:
            out.append(("spectral.attn", layer, None, attn))
        mlp = values["mlp"].max() if "mlp" in values else None
        if mlp is not None:
            out.append(("spectral.mlp", layer, None, mlp))
            if attn is not None:
                out.append(("spectral.ratio", layer, None, mlp / attn))
        if "ov" in values:
            ov = values["ov"].max()
            out.append(("spectral.ov", layer, None, ov))
            if mlp is not None:
                out.append(("spectral.ratio_ov", layer, None, mlp / ov))
        if "erank" in values:
            out.append(("effective_rank", layer, None, values["erank"].reshape(())))
        return out
