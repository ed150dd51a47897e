"""Replica fingerprints: an exact digest of the parameters each data-parallel replica holds.

DDP replicas apply the same averaged gradient to the same weights, so their parameters stay
equal bit for bit; a replica whose weights changed on their own (a bit flip in memory or in
arithmetic: silent data corruption), that skipped or repeated an optimizer step, or that
resumed from another checkpoint differs from then on, while the averaged loss looks fine. The
collector compares the digests of one step across the replicas (`replica_divergence`).

The digest. Each parameter's raw bits are read as integer words of the element's width w (8,
16 or 32 bits; 8-byte elements as two 32-bit words) and summed in that width, wrapping: S_i, a
signed w-bit integer. (Summing in the word's own width is what the hardware does at memory
speed: widening every element to int64 first made the sum 20× slower on CPU.) The digest of a
list of parameters is D = Σ_i S_i·(2i+1) mod 2^52, i the parameter's position in the model's
parameter order: an integer below 2^52, exact in the float64 it travels as. Wrapping integer
sums are associative, so D does not depend on the device, the kernel or the reduction order —
equal weights give equal digests on every replica, always. A single flipped bit b of a word
changes S_i by 2^b or, wrapping, by 2^b − 2^w: either way an odd multiple of 2^b (b < w ≤ 32),
so D changes by an odd multiple of 2^b too, never 0 mod 2^52: every single-bit flip changes
the digest. (Several changes can cancel only in contrived patterns, e.g. two elements of one
tensor changed by opposite amounts.)

The locator. Beside D each rank sends L = Σ_i S_i·(2i+1)² mod 2^52. Where two replicas differ
in one tensor j only, by δ = S_j − S_j', their differences are ΔD = δ·(2j+1) and ΔL =
δ·(2j+1)² (mod 2^52), so ΔL/ΔD = 2j+1: the collector names the tensor from two numbers a rank,
with no second round and no per-tensor values on the wire (a single-error-locating code, as a
Reed–Solomon syndrome locates an error). δ is an odd multiple of 2^b with b < 32, so after
dividing both by 2^b the quotient is known modulo 2^(52−b) ≥ 2^21: exact for models of up to a
million tensors. The collector checks the answer (δ = ΔD/(2j+1) must be a word-sized change and
δ·(2j+1)² must give ΔL back); differences spread over several tensors (a skipped step, another
checkpoint) fail that check but for a chance below 2^-19, and are named by block instead.

What is sent, per fingerprinted step: `param_fingerprint` (D) and `param_locator` (L) of the
rank's whole replicated model, and `layer_fingerprint` per block of the layout (the block's
parameters), so that an alert names the tensor that differs, or the blocks where several do.
The parameters' names, in the digest's order, go once into the run's tags
(`replica_fingerprint_tensors`, a JSON list). Read with the other probe values: no host sync.

The optimizer state (Adam's moments: replicated as the weights are, since every replica feeds
its optimizer the same averaged gradient) gets the same digest and locator, `optim_fingerprint`
and `optim_locator`, at a tenth of the cadence: its tensors on the parameters' device, the k-th
state tensor (keys sorted) of the parameter at position i at position 8i + k, so the locator
names the parameter whose state differs (CPU step counters, identical everywhere, are left out:
moving them to the device would wait for it).

What is compared (`ReplicaFingerprint`): under DDP every parameter of the wrapped module but
those DDP ignores (listed in the run's tags), once the ranks are known to be replicas. Under
HSDP (FSDP2 over a mesh with a replicate dimension) each rank digests its local shards, and the
ranks holding the same shards form a replica set: each sends `replica_set` (its shard's index)
and the collector compares the digests within each set. Sharded parameters with no replicate
dimension (plain FSDP2, tensor parallelism) have no replica in the run; the probe is off there
and the run says so.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .layout import is_dtensor

if TYPE_CHECKING:
    from .layout import Layout

MASK = (1 << 52) - 1

# Positions left for the state tensors of one parameter in the optimizer's digest: the k-th of
# parameter i sits at 8i + k, so its locator names the parameter (k beyond 7 shares slot 7).
STATE_SLOTS = 8

_SAME_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """S: the sum of `tensor`'s raw words (8-byte elements as two 32-bit words), wrapping in
    the word's width, as a 0-dim int64 on its device."""
    t = tensor.detach()
    if is_dtensor(t):
        t = t.to_local()  # this rank's shard: what its replicas hold too
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.element_size() == 8 or t.is_complex():
        t = t.contiguous().reshape(-1).view(torch.int32)  # 1-D: a 0-dim tensor has no last dim to split
    elif t.is_floating_point():
        t = t.view(_SAME_WIDTH[t.element_size()])
    return t.sum(dtype=t.dtype).to(torch.int64)


def _digest_and_locator(terms: torch.Tensor, odd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, L) from the terms S_i·(2i+1) and the weights 2i+1: int64 products wrap, exact
    modulo 2^64 and so modulo 2^52; 0-dim float64s."""
    return (terms.sum() & MASK).double(), ((terms * odd).sum() & MASK).double()


def digest(tensors: Sequence[torch.Tensor], positions: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(D, L) of `tensors` at `positions`, 0-dim float64s on `device`."""
    if not tensors:
        zero = torch.zeros((), dtype=torch.float64, device=device)
        return zero, zero.clone()
    sums = torch.stack([bit_sum(t).to(device) for t in tensors])
    odd = torch.tensor(positions, dtype=torch.int64, device=device) * 2 + 1
    return _digest_and_locator(sums * odd, odd)


def optimizer_state(
    optimizer: torch.optim.Optimizer, device: torch.device, positions: dict[int, int] | None = None
) -> tuple[list[torch.Tensor], list[int]]:
    """The optimizer's state tensors on `device` and their digest positions: the k-th (keys
    sorted) of the parameter at position i at STATE_SLOTS·i + k. `positions` maps a parameter's
    id to its position (the model digest's); without it, the optimizer's own order. Only the
    parameters in `positions`: one DDP ignores has a state of its own on each rank."""
    tensors: list[torch.Tensor] = []
    at: list[int] = []
    order = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            position = order if positions is None else positions.get(id(p))
            order += 1
            state = optimizer.state.get(p)
            if position is None or not state:
                continue
            k = 0
            for key in sorted(state, key=str):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.device == device:
                    tensors.append(value)
                    at.append(STATE_SLOTS * position + min(k, STATE_SLOTS - 1))
                    k += 1
    return tensors, at


class FingerprintProbe:
    """Digest and locator of a fixed list of parameters, and each block's digest."""

    def __init__(self, parameters: Sequence[torch.Tensor], block_of: Sequence[int | None], blocks: int, names: Sequence[str] | None = None) -> None:
        if len(parameters) != len(block_of):
            raise ValueError("fingerprint: one block index (or None) per parameter")
        self._parameters = list(parameters)
        self._block_of = list(block_of)
        self.names = list(names) if names is not None else [str(i) for i in range(len(self._parameters))]
        self.names_json = json.dumps(self.names)
        self.positions = {id(p): i for i, p in enumerate(self._parameters)}  # by id: the parameters compared
        device = self._parameters[0].device if self._parameters else torch.device("cpu")
        n = len(self._parameters)
        self._odd = torch.arange(n, dtype=torch.int64, device=device) * 2 + 1
        in_block = [i for i, b in enumerate(block_of) if b is not None]
        self._in_block = torch.tensor(in_block, dtype=torch.int64, device=device)
        self._block_index = torch.tensor([block_of[i] for i in in_block], dtype=torch.int64, device=device)
        self.blocks = blocks

    def without(self, ids: set[int]) -> FingerprintProbe:
        """The same probe over its parameters but those in `ids`."""
        kept = [(p, b, n) for p, b, n in zip(self._parameters, self._block_of, self.names, strict=True) if id(p) not in ids]
        return FingerprintProbe([p for p, _, _ in kept], [b for _, b, _ in kept], self.blocks, [n for _, _, n in kept])

    def compute(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(model digest, model locator, per-block digests [blocks]) as float64 device tensors;
        no host sync."""
        device = self._odd.device
        if not self._parameters:
            zero = torch.zeros((), dtype=torch.float64, device=device)
            return zero, zero.clone(), torch.zeros(self.blocks, dtype=torch.float64, device=device)
        # A parameter on another device (a model split over devices) joins by a copy of one number.
        sums = torch.stack([bit_sum(p).to(device) for p in self._parameters])
        terms = sums * self._odd  # wrapping int64 products: exact mod 2^64
        model, locator = _digest_and_locator(terms, self._odd)
        per_block = torch.zeros(self.blocks, dtype=torch.int64, device=device)
        if self._in_block.numel():
            per_block.index_add_(0, self._block_index, terms.index_select(0, self._in_block))
        return model, locator, (per_block & MASK).double()


class ReplicaFingerprint:
    """The fingerprint of one watched model's data-parallel replicas: which parameters (every
    one of the model but those its DDP wrapper ignores), by block where the layout is known, and
    whether the ranks are replicas at all. They are only once a DDP wrapper is known (ranks
    training models of their own, or a job using torch.distributed for something else, are
    not), its process group is the run's (a wrapper found after the run was named world-wide,
    over a pipeline stage's or a tensor-parallel shard's sub-group, would compare ranks that are
    not replicas), and no post-local SGD lets them drift between averagings. `off` says why
    not, `ignored` which parameters DDP leaves out, both for the run's tags."""

    def __init__(
        self,
        model: torch.nn.Module,
        layout: Layout | None,
        ddp: object | None,
        optimizer: torch.optim.Optimizer | None,
        world_size: int,
        replica_set: int | None = None,
    ) -> None:
        self.model = model
        self.ddp = ddp  # None until known
        # HSDP: this rank's replica set (the mesh says the ranks are replicas).
        self.replica_set = replica_set
        self._set_value: torch.Tensor | None = None
        # ZeRO shards the optimizer state over the ranks: no replica of it to compare.
        self.optimizer = None if type(optimizer).__name__ == "ZeroRedundancyOptimizer" else optimizer
        self._averaged_every_k = type(optimizer).__name__ == "PostLocalSGDOptimizer"
        self._world_size = world_size
        self.checked: object | None = None  # the wrapper whose group and ignored parameters were checked
        self._excluded: set[int] = set()
        self.ignored = ""
        self.off: str | None = None
        self.elapsed = 0.0  # seconds spent computing, since the run last read it
        self.probe = self._probe(layout)

    def set_layout(self, layout: Layout) -> None:
        """The blocks became known (read at their first forward): digests by block from now."""
        self.probe = self._probe(layout)

    def _probe(self, layout: Layout | None) -> FingerprintProbe:
        block_of: dict[int, int] = {}
        for block in layout.blocks if layout is not None else ():
            for p in block.module.parameters():
                block_of.setdefault(id(p), block.index)
        named = [(n, p) for n, p in self.model.named_parameters() if id(p) not in self._excluded]
        params = [p for _, p in named]
        return FingerprintProbe(params, [block_of.get(id(p)) for p in params], len(layout.blocks) if layout is not None else 0, [n for n, _ in named])

    def ready(self, find_ddp: Callable[[torch.nn.Module], object | None]) -> bool:
        """Whether the ranks are replicas to compare now. `find_ddp(model)` looks for the
        wrapper while it is unknown: the wrapper, None (not yet: try at the next report) or
        False (none)."""
        if self.off is not None:
            return False
        if self.replica_set is not None:
            return True
        if self.ddp is None:
            self.ddp = find_ddp(self.model)
            if self.ddp is False:
                self.off = "off: no DistributedDataParallel wrapper found (the ranks are not replicas)"
            if not self.ddp:
                return False
        if self.checked is not self.ddp and not self._fits(self.ddp):
            return False
        # Post-local SGD (a comm hook that stops averaging gradients, a model averager every k
        # steps): the replicas differ by design between averagings. Asked at each report: the
        # hook may come after watch().
        hooks = getattr(self.ddp, "_comm_hooks", ())
        if self._averaged_every_k or any(type(state).__name__ == "PostLocalSGDState" for _, state in hooks):
            self.off = "off: post-local SGD averages the replicas only every k steps (they differ in between)"
            return False
        return True

    def _fits(self, wrapper: Any) -> bool:
        """Once per wrapper: its group is the run's replicas, and what it ignores leaves the digests."""
        self.checked = wrapper
        import torch.distributed as dist

        group_size = dist.get_world_size(wrapper.process_group) if dist.is_available() and dist.is_initialized() else 1
        if group_size != self._world_size:
            self.off = (
                f"off: the DDP group has {group_size} ranks but the run {self._world_size}; "
                "call watch() with the DDP wrapper before the first log() so the run is its replica group"
            )
            return False
        ignored = set(getattr(wrapper, "parameters_to_ignore", ()) or ())
        excluded = {id(p) for name, p in wrapper.module.named_parameters() if name in ignored}
        if excluded & self.probe.positions.keys():
            self._excluded = excluded
            self.probe = self.probe.without(excluded)
            self.ignored = ",".join(sorted(ignored))
        return True

    @property
    def tensors(self) -> str:
        """The compared parameters' names in the digest's order, for the run's tags: the
        collector turns a located position into a name with it."""
        return self.probe.names_json

    def report(self, keys: list[tuple[str, int | None, str | None, bool]], values: list[torch.Tensor], *, optimizer: bool) -> None:
        """Appends the digests and locators of the parameters (the whole model's, each block's
        digest) and, when `optimizer`, of the optimizer state: every value computed before any
        key is added, so a failure half way leaves no key without its value (a report pairs
        them by position)."""
        started = time.perf_counter()
        model, locator, blocks = self.probe.compute()
        state = None
        if optimizer and self.optimizer is not None:
            tensors, positions = optimizer_state(self.optimizer, model.device, self.probe.positions)
            state = digest(tensors, positions, model.device)
        keys.append(("param_fingerprint", None, None, False))
        values.append(model)
        keys.append(("param_locator", None, None, False))
        values.append(locator)
        if self.replica_set is not None:
            keys.append(("replica_set", None, None, False))
            if self._set_value is None:  # made once: a copy to the device each report would wait for it
                self._set_value = torch.tensor(float(self.replica_set), dtype=torch.float64, device=model.device)
            values.append(self._set_value)
        for index, value in enumerate(blocks.unbind()):
            keys.append(("layer_fingerprint", index, None, False))
            values.append(value)
        if state is not None:
            keys.append(("optim_fingerprint", None, None, False))
            values.append(state[0])
            keys.append(("optim_locator", None, None, False))
            values.append(state[1])
        self.elapsed += time.perf_counter() - started
