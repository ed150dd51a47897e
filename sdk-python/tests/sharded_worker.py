"""One rank of tests/test_sharded.py: a small GPT trained twice under a sharded layout,
unwatched and watched, plus brute-force references.

Layouts (argv[1]):
* fsdp2 — `fully_shard` on every block and the root, over all ranks;
* fsdp2_accumulation — the same with two micro-batches per step, the first without gradient
  sync (`set_requires_gradient_sync(False)`), and the position embedding frozen;
* hsdp — FSDP2 over a 2×2 mesh (replicate × shard);
* fsdp2_failure — fsdp2 where rank 1's gradient hooks start failing at step 2: training must go
  on without a hang, rank 1 stops reporting gradients, the others report ‖ḡ‖ as NaN (a sum
  missing a rank) rather than a wrong number;
* tp — the MLPs tensor-parallel over all ranks (c_fc column-wise, c_proj row-wise), every
  rank fed the same batch; the gradient probe is refused at watch, the rest watched;
* refusals — FSDP1 and DeepSpeed (its engine, by class name, and the module inside one): watch
  must raise with a message, and nothing else happens.

Next to the unwatched twin a shadow copy (plain modules, the full weights gathered before the
step, the same random state) recomputes each rank's local gradient; gathered over all ranks in
float64 it gives ‖g_k‖, ‖ḡ‖, the exact cos(g_k, ḡ), and the cosine of the two CountSketches the
probe estimates it by (same seed, same coordinates). After training, the watched twin's weights
are gathered and their spectral norms taken with torch.linalg.matrix_norm(ord=2): against them
go the run's last reported spectral values and a fresh high-iteration SpectralProbe call on the
sharded weights. The rank writes everything to JSON; the test compares.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import rankwatch  # noqa: E402
from rankwatch.discovery import discover  # noqa: E402
from rankwatch.countsketch import countsketch_coordinates
from rankwatch.sharding import shard_base, shard_indices  # noqa: E402
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig  # noqa: E402
from rankwatch.spectral import SpectralProbe  # noqa: E402

STEPS = 5
SKETCH_DIM = 4096
CONFIG = NanoGPTConfig(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, dropout=0.1, bias=True)


def shard(model: NanoGPT, layout: str, world: int) -> None:
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        for block in model.transformer.h:
            parallelize_module(block.mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
        return
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if layout == "hsdp" else init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in model.state_dict().items()}


def sketch(grads: list[torch.Tensor], seed: int) -> torch.Tensor:
    out = torch.zeros(SKETCH_DIM, dtype=torch.float64)
    for index, g in enumerate(grads):
        target, sign = countsketch_coordinates(seed, index, g.numel(), SKETCH_DIM, g.device)
        out.index_add_(0, target, g.reshape(-1).double() * sign.double())
    return out


def refusals(out_dir: Path) -> None:
    """watch() on layouts the probes would misread: each must raise, naming what is supported."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    messages: dict[str, str] = {}

    class DeepSpeedEngine(torch.nn.Module):  # what deepspeed.initialize returns, by name
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    torch.manual_seed(0)
    cases: dict[str, Callable[[], torch.nn.Module]] = {
        "fsdp1": lambda: FullyShardedDataParallel(NanoGPT(CONFIG), device_id=torch.device("cpu")),
        "deepspeed_engine": lambda: DeepSpeedEngine(NanoGPT(CONFIG)),
        "deepspeed_inner": lambda: DeepSpeedEngine(NanoGPT(CONFIG)).module,
    }
    keep = []
    for case, make in cases.items():
        model = make()
        keep.append(model)  # the engine must stay alive for its inner module to be recognised
        if case == "deepspeed_inner":
            engine = DeepSpeedEngine(torch.nn.Identity())
            engine.module = model
            keep.append(engine)
        run = rankwatch.init(run=f"refusal-{case}", mode="offline", spool_dir=out_dir / "spool")
        try:
            run.watch(model, torch.optim.SGD(model.parameters(), lr=0.1))
            messages[case] = ""
        except ValueError as e:
            messages[case] = str(e)
        run.finish(timeout=1)
    (out_dir / f"rank-{dist.get_rank()}.json").write_text(json.dumps({"refusals": messages}))


def main() -> None:
    layout, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if layout == "refusals":
        refusals(out_dir)
        dist.destroy_process_group()
        return
    micro = 2 if layout == "fsdp2_accumulation" else 1
    name = f"sharded-{layout}"
    result: dict[str, Any] = {"layout": layout}

    def job(watched: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]], list[dict[str, Any]], torch.nn.Module]:
        torch.manual_seed(0)
        model = NanoGPT(CONFIG)
        if layout == "fsdp2_accumulation":
            model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter among the sharded ones
        shard(model, layout, world)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        run = None
        if watched:
            grad = 0 if layout == "tp" else 1
            every = {"grad": grad, "sketch": 1, "activations": 1, "spectral": 1, "fingerprint": 1}
            run = rankwatch.init(run=name, mode="offline", spool_dir=out_dir / "spool", sketch_dim=SKETCH_DIM, every=every)
            if layout == "tp":
                probe = rankwatch.init(run=name + "-refused", mode="offline", spool_dir=out_dir / "spool")
                try:
                    probe.watch(model, optimizer)
                except ValueError as e:
                    result["refusal"] = str(e)
                probe.finish(timeout=1)
            run.watch(model, optimizer)
        torch.manual_seed(1000 + (0 if layout == "tp" else rank))
        data = torch.Generator().manual_seed(100 + (0 if layout == "tp" else rank))
        reported: list[dict[str, Any]] = []
        expected: list[dict[str, Any]] = []
        for step in range(STEPS):
            batches = [torch.randint(0, 50 if rank != 3 else 10, (4, 16), generator=data) for _ in range(micro)]
            before = None if watched else (full_state(model), torch.get_rng_state())
            optimizer.zero_grad(set_to_none=True)
            if layout == "fsdp2_failure" and run is not None and rank == 1 and step == 2:
                def broken(*_: object) -> None:
                    raise RuntimeError("a probe bug on rank 1")

                assert run._gradients is not None
                run._gradients._observe = broken  # type: ignore[method-assign, assignment]  # broken on purpose: from now on its hooks fail
            for i, x in enumerate(batches):
                if layout == "fsdp2_accumulation":
                    cast("FSDPModule", model).set_requires_gradient_sync(i == micro - 1)  # fully_shard made it one
                _, loss = model(x, torch.roll(x, -1, 1))
                loss.backward()
            optimizer.step()
            if run is not None:
                run.log(step, loss=loss.detach())
                reported.append({"step": step, "values": {f"{k[0]}/{k[1]}/{k[2]}": v for k, v in run.last_values.items()}})
                run.last_values.clear()
            if before is not None and layout not in ("tp", "fsdp2_failure"):
                expected.append({"step": step, **shadow(before, batches, world, zlib.crc32(name.encode()), frozen=layout == "fsdp2_accumulation")})
        if run is not None:
            result["tags"] = dict(run.tags)
            run.finish(timeout=5)
        return full_state(model), reported, expected, model

    plain, _, expected, _ = job(watched=False)
    watched, reported, _, model = job(watched=True)
    result["equal"] = {k: bool(torch.equal(plain[k], watched[k])) for k in plain}
    result["reported"], result["expected"] = reported, expected
    result["spectral"] = spectral_reference(model, watched)
    result["shard_bases"] = shard_bases(model)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    # About one process exit in sixty aborts in torch's own teardown here ("terminate called
    # without an active exception" after destroy_process_group, with device meshes over gloo);
    # it happens with rankwatch disabled too (measured: 1 of 16 four-rank runs either way), so
    # the worker leaves without the interpreter's teardown once its results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shard_bases(model: torch.nn.Module) -> dict[str, object]:
    """For each sharded parameter: whether its block is one contiguous range of the whole (the
    fused GPU sketch then hashes `base + i`), and whether that range is the block's coordinates."""
    out: dict[str, object] = {}
    for name, param in model.named_parameters():
        indices = shard_indices(param)
        if indices is None:
            continue
        base = shard_base(param)
        out[name] = "indices" if base is None else bool(torch.equal(indices, torch.arange(base, base + indices.numel())))
    return out


def shadow(before: tuple[dict[str, torch.Tensor], torch.Tensor], batches: list[torch.Tensor], world: int, seed: int, frozen: bool = False) -> dict[str, float]:
    """Brute force on a plain copy with the gathered weights and random state of the step."""
    weights, rng = before
    saved = torch.get_rng_state()  # before the copy's initialisation draws from it
    plain = NanoGPT(CONFIG)
    plain.load_state_dict(weights)
    if frozen:
        plain.transformer.wpe.weight.requires_grad_(False)
    torch.set_rng_state(rng)
    for x in batches:
        _, loss = plain(x, torch.roll(x, -1, 1))
        loss.backward()
    torch.set_rng_state(saved)
    grads = [cast(torch.Tensor, p.grad).double() for p in plain.parameters() if p.requires_grad]  # the probe's order
    g = torch.cat([t.reshape(-1) for t in grads])
    gathered = [torch.zeros_like(g) for _ in range(world)]
    dist.all_gather(gathered, g)
    g_bar = torch.stack(gathered).mean(0)
    sizes = [t.numel() for t in grads]
    bar_parts = [part.reshape(t.shape) for part, t in zip(torch.split(g_bar, sizes), grads)]
    s_own, s_bar = sketch(grads, seed), sketch(bar_parts, seed)
    return {
        "grad_norm": float(g.norm()),
        "grad_norm_mean": float(g_bar.norm()),
        "cos_to_mean": float(g @ g_bar / (g.norm() * g_bar.norm())),
        "sketch_cosine": float(s_own @ s_bar / (s_own.norm() * s_bar.norm())),
    }


def spectral_reference(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """σ of every matrix and σ_mlp from the gathered weights, and from a fresh probe call on
    the sharded ones (every rank takes part; each returns the layers it reports)."""
    plain = NanoGPT(CONFIG)
    plain.load_state_dict(full)
    reference: dict[str, float] = {}
    for block in discover(plain).blocks:
        for site, read in block.matrices.items():
            reference[f"spectral.sigma/{block.index}/{site}"] = float(torch.linalg.matrix_norm(read().double(), ord=2))
        up, down = block.matrices["up"]().double(), block.matrices["down"]().double()
        reference[f"spectral.mlp/{block.index}/None"] = float(torch.linalg.matrix_norm(down @ up, ord=2))
        # The effective rank of (I + W_down W_up)(I + W_o W_v) (n_kv = n_heads here): exact,
        # as the width is within the probe count, so the sharded k-column products are checked.
        v, o = block.matrices["v"]().double(), block.matrices["o"]().double()
        eye = torch.eye(up.shape[1], dtype=torch.float64)
        s = torch.linalg.svdvals((eye + down @ up) @ (eye + o @ v))
        reference[f"effective_rank/{block.index}/None"] = float(s.square().sum().square() / s.pow(4).sum())
    probe = SpectralProbe(discover(model), cold_iters=300, reporter=dist.get_rank(), reporters=dist.get_world_size())
    fresh = {f"{m}/{layer}/{site}": float(v) for m, layer, site, v in probe.compute()}
    # Fewer probes than the width: Rademacher signs, which every rank must draw alike. The
    # sharded estimate must equal the same estimate on the gathered weights.
    def estimates(layout: object, **kw: int) -> dict[str, float]:
        calls = SpectralProbe(layout, cold_iters=2, erank_probes=8, **kw).compute()  # type: ignore[arg-type]
        return {f"{m}/{layer}": float(v) for m, layer, _, v in calls if m == "effective_rank"}

    sharded_estimate = estimates(discover(model), reporter=dist.get_rank(), reporters=dist.get_world_size())
    plain_estimate = estimates(discover(plain))
    return {"reference": reference, "fresh": fresh, "collective": probe.collective, "estimate": sharded_estimate, "estimate_plain": plain_estimate}


if __name__ == "__main__":
    main()
