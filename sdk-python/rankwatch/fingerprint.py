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

What is sent, per fingerprinted step: `param_fingerprint` (the rank's whole replicated model)
and `layer_fingerprint` per block of the layout (the block's parameters), so that the alert
names the blocks that differ. Read with the other probe values: no host sync.

The optimizer state (Adam's moments: replicated as the weights are, since every replica feeds
its optimizer the same averaged gradient) gets the same digest, `optim_fingerprint`, at a tenth
of the cadence: its tensors on the parameters' device, in the optimizer's parameter order and
each state's keys sorted (CPU step counters, identical everywhere, are left out: moving them to
the device would wait for it).

What is compared (`ReplicaFingerprint`): under DDP every parameter of the wrapped module but
those DDP ignores (listed in the run's tags), once the ranks are known to be replicas. Sharded
parameters (FSDP2, tensor parallelism) have no replica in the run; the run leaves the probe off
there and says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .layout import Layout

MASK = (1 << 52) - 1

_SAME_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """S: the sum of `tensor`'s raw words (8-byte elements as two 32-bit words), wrapping in
    the word's width, as a 0-dim int64 on its device."""
    t = tensor.detach()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.element_size() == 8 or t.is_complex():
        t = t.contiguous().reshape(-1).view(torch.int32)  # 1-D: a 0-dim tensor has no last dim to split
    elif t.is_floating_point():
        t = t.view(_SAME_WIDTH[t.element_size()])
    return t.sum(dtype=t.dtype).to(torch.int64)


def digest(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """D of `tensors` (positions 0..n-1), a 0-dim float64 on `device`."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    sums = torch.stack([bit_sum(t) for t in tensors])
    weights = torch.arange(len(tensors), dtype=torch.int64, device=device) * 2 + 1
    return ((sums * weights).sum() & MASK).double()


def optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device, replicated: set[int] | None = None) -> list[torch.Tensor]:
    """The optimizer's state tensors on `device`, in its parameter order, each state's keys
    sorted; with `replicated`, only the state of those parameters (by id): a parameter DDP
    ignores has a state of its own on each rank."""
    tensors: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if replicated is not None and id(p) not in replicated:
                continue
            state = optimizer.state.get(p)
            if not state:
                continue
            for key in sorted(state, key=str):
                value = state[key]
                if isinstance(value, torch.Tensor) and value.device == device:
                    tensors.append(value)
    return tensors


class FingerprintProbe:
    """Digests of a fixed list of parameters: the whole list's and each block's."""

    def __init__(self, parameters: Sequence[torch.Tensor], block_of: Sequence[int | None], blocks: int) -> None:
        if len(parameters) != len(block_of):
            raise ValueError("fingerprint: one block index (or None) per parameter")
        self._parameters = list(parameters)
        self._block_of = list(block_of)
        self.ids = {id(p) for p in self._parameters}
        device = self._parameters[0].device if self._parameters else torch.device("cpu")
        n = len(self._parameters)
        self._weights = torch.arange(n, dtype=torch.int64, device=device) * 2 + 1
        in_block = [i for i, b in enumerate(block_of) if b is not None]
        self._in_block = torch.tensor(in_block, dtype=torch.int64, device=device)
        self._block_index = torch.tensor([block_of[i] for i in in_block], dtype=torch.int64, device=device)
        self.blocks = blocks

    def without(self, ids: set[int]) -> FingerprintProbe:
        """The same probe over its parameters but those in `ids`."""
        kept = [(p, b) for p, b in zip(self._parameters, self._block_of, strict=True) if id(p) not in ids]
        return FingerprintProbe([p for p, _ in kept], [b for _, b in kept], self.blocks)

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(model digest, per-block digests [blocks]) as float64 device tensors; no host sync."""
        device = self._weights.device
        if not self._parameters:
            return torch.zeros((), dtype=torch.float64, device=device), torch.zeros(self.blocks, dtype=torch.float64, device=device)
        # A parameter on another device (a model split over devices) joins by a copy of one number.
        sums = torch.stack([bit_sum(p).to(device) for p in self._parameters])
        terms = sums * self._weights  # wrapping int64 products: exact mod 2^64
        model = terms.sum() & MASK
        per_block = torch.zeros(self.blocks, dtype=torch.int64, device=device)
        if self._in_block.numel():
            per_block.index_add_(0, self._block_index, terms.index_select(0, self._in_block))
        return model.double(), (per_block & MASK).double()



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
        self, model: torch.nn.Module, layout: Layout | None, ddp: object | None, optimizer: torch.optim.Optimizer | None, world_size: int
    ) -> None:
        self.model = model
        self.ddp = ddp  # None until known
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
        params = [p for p in self.model.parameters() if id(p) not in self._excluded]
        return FingerprintProbe(params, [block_of.get(id(p)) for p in params], len(layout.blocks) if layout is not None else 0)

    def ready(self, find_ddp: Callable[[torch.nn.Module], object | None]) -> bool:
        """Whether the ranks are replicas to compare now. `find_ddp(model)` looks for the
        wrapper while it is unknown: the wrapper, None (not yet: try at the next report) or
        False (none)."""
        if self.off is not None:
            return False
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
        if excluded & self.probe.ids:
            self._excluded = excluded
            self.probe = self.probe.without(excluded)
            self.ignored = ",".join(sorted(ignored))
        return True

    def report(self, keys: list[tuple[str, int | None, str | None, bool]], values: list[torch.Tensor], *, optimizer: bool) -> None:
        """Appends the digests of the parameters (the whole model's, each block's) and, when
        `optimizer`, of the optimizer state: every value computed before any key is added, so
        a failure half way leaves no key without its value (a report pairs them by position)."""
        started = time.perf_counter()
        model, blocks = self.probe.compute()
        state = None
        if optimizer and self.optimizer is not None:
            state = digest(optimizer_state(self.optimizer, model.device, self.probe.ids), model.device)
        keys.append(("param_fingerprint", None, None, False))
        values.append(model)
        for index, value in enumerate(blocks.unbind()):
            keys.append(("layer_fingerprint", index, None, False))
            values.append(value)
        if state is not None:
            keys.append(("optim_fingerprint", None, None, False))
            values.append(state)
        self.elapsed += time.perf_counter() - started
