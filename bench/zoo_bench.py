"""The block-layout zoo end to end: every layout of `rankwatch_testkit.zoo` trained under DDP (2
gloo ranks, CPU), eager and `torch.compile`d before DDP as nanoGPT does (watched after compiling,
as an attach is, or before, as the SDK's docs say), watched and unwatched.

    python bench/zoo_bench.py [--layouts megatron,olmo,...] [--modes eager,compiled] [--steps 40]

Per layout and mode it prints: the family discovery named and the sites it found; whether the
watched twin ended with the unwatched twin's parameters bit for bit; the largest relative error
of the probe's spectral ratio against float64 `matrix_norm(ord=2)` of the final weights (400
cold iterations, as the test suite's tolerance is stated); the median step time watched over
unwatched at the default cadence, steps after the first 5 (warm-up and compilation) — a ratio
measured on a shared 2-core machine, to be read with its spread (compiled twins' medians move
by a quarter between processes here, so it only bounds gross costs); the median time the
training thread spent inside the agent per step (hooks and `log`), as a share of the unwatched
step — on CPU every kernel runs on that thread, so this is the probes' cost, and it is steady
where the ratio is not (activation reductions traced into a compiled graph are not in it); and, compiled, the graphs
dynamo compiled for each twin, each from a fresh dynamo state (`torch._dynamo.utils.counters
["stats"]["unique_graphs"]`), and the watched twin's graph breaks. Watched after compiling, as
an attach is, the watched twin must compile no more than the unwatched one; watched first, the
activation hooks are traced in but add nothing unless opted in (`watch_compiled`: as many
graphs as the twin), and opted in (`watch_compiled_opt_in`) arming costs one graph more (armed
and disarmed). `--width/--layers/--batch/--seq` size the model and the batch (a larger step
shows the probes' fixed cost as a smaller share), `--autocast` trains in bf16 autocast. The test
suite runs the discovery of every layout and one layout end to end under attach; this script is
the rest of the matrix.

    python bench/zoo_bench.py --layouts olmo --modes compiled,watch_compiled_opt_in --width 256 --layers 4 --seq 128 --autocast
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sdk-python"))

from rankwatch_testkit.spawn import spawn_ranks  # noqa: E402
from rankwatch_testkit.zoo import LAYOUTS, ZooConfig, ZooModel  # noqa: E402

import rankwatch  # noqa: E402
from rankwatch.spectral import SpectralProbe  # noqa: E402

WARMUP = 5


def _job(rank: int, layout: str, mode: str, watched: bool, steps: int, out: Path, size: dict[str, Any]) -> dict[str, Any]:
    # Each twin compiles afresh: dynamo would otherwise reuse the first twin's graphs for the
    # second model (same code, parameters as inputs) and never trace its hooks.
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    torch.manual_seed(0)
    model = ZooModel(ZooConfig(layout=layout, width=size["width"], layers=size["layers"], block_size=max(32, size["seq"])))
    run = None
    if watched and mode.startswith("watch_compiled"):
        # The SDK's documented order: watch, then compile (hooks are traced into the graphs,
        # and measure there only when opted in).
        run = rankwatch.init(run=f"zoo-{layout}-{mode}", mode="offline", spool_dir=out / "spool")
        run.watch(model, compiled_activations=mode == "watch_compiled_opt_in")
    # torch.compile of a module is a module (OptimizedModule); its stub says only Callable.
    trained: torch.nn.Module = cast(torch.nn.Module, torch.compile(model)) if mode != "eager" else model
    ddp = torch.nn.parallel.DistributedDataParallel(trained)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1 + rank)
    if watched and run is None:
        # As `rankwatch attach` does: the job was compiled (or not) before rankwatch came.
        run = rankwatch.init(run=f"zoo-{layout}-{mode}", mode="offline", spool_dir=out / "spool")
        run.watch(ddp, optimizer)
    times: list[float] = []
    agent: list[float] = []
    graphs_before_watch = None
    for step in range(steps):
        started = time.perf_counter()
        x = torch.randint(0, model.config.vocab_size, (size["batch"], size["seq"]), generator=data)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=size["autocast"]):
            loss = ddp(x, torch.roll(x, -1, 1))[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if run is not None:
            # The agent's own time (hooks since the last log, then the log), as probe_costs.py
            # measures it: on CPU every kernel runs on this thread, so it is the probes' cost,
            # and far steadier than the difference of two twins' step times.
            inside = sum(p.elapsed for p in (run._gradients, run._activations) if p is not None)
            logged = time.perf_counter()
            run.log(step, loss=loss.detach())
            agent.append(inside + time.perf_counter() - logged)
        times.append(time.perf_counter() - started)
        if step == WARMUP - 1:
            graphs_before_watch = _graphs()
    family = run._layout.family if run is not None and run._layout is not None else None
    if run is not None:
        run.finish(timeout=5)
    breaks = sum(counters["graph_break"].values())
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "times": times, "agent": agent[WARMUP:], "graphs": _graphs(), "breaks": breaks, "graphs_at_warmup": graphs_before_watch, "family": family, "model": model}


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _rank(rank: int, layout: str, mode: str, steps: int, out: str, size: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    where = Path(out)
    plain = _job(rank, layout, mode, False, steps, where, size)
    graphs_plain = plain["graphs"]
    watched = _job(rank, layout, mode, True, steps, where, size)
    equal = all(torch.equal(plain["state"][k], watched["state"][k]) for k in plain["state"])
    model = watched["model"]
    ratio_error = 0.0
    sites: list[str] = []
    if rank == 0:
        layout_found = model.layout()
        sites = layout_found.blocks[0].sites()
        got = {(m, l): v.item() for m, l, s, v in SpectralProbe(layout_found, cold_iters=400).compute() if m == "spectral.ratio"}
        for index in range(model.config.layers):
            w = {s: t.detach().double() for s, t in model.expected(index).items()}
            if w["down"].dim() == 3:
                mlp = max(float(torch.linalg.matrix_norm(w["down"][e] @ w["up"][e], ord=2)) for e in range(w["down"].shape[0]))
            else:
                mlp = float(torch.linalg.matrix_norm(w["down"] @ w["up"], ord=2))
            want = mlp / float(torch.linalg.matrix_norm(w["o"], ord=2))
            ratio_error = max(ratio_error, abs(got[("spectral.ratio", index)] - want) / want)
    result = {
        "equal": equal,
        "family": watched["family"],
        "sites": sites,
        "ratio_error": ratio_error,
        "plain_times": plain["times"][WARMUP:],
        "watched_times": watched["times"][WARMUP:],
        "graphs_plain": graphs_plain,
        "graphs_watched": watched["graphs"],
        "agent_times": watched["agent"],
        "breaks": watched["breaks"],
    }
    (where / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument(
        "--modes",
        default="eager,compiled,watch_compiled,watch_compiled_opt_in",
        help="eager; compiled (compile, then watch: as an attach); watch_compiled (watch, then compile: activations off in the graphs); "
        "watch_compiled_opt_in (the same with compiled_activations=True)",
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--autocast", action="store_true", help="bf16 autocast on CPU")
    args = p.parse_args()
    size = {"width": args.width, "layers": args.layers, "batch": args.batch, "seq": args.seq, "autocast": args.autocast}
    print(
        f"torch {torch.__version__}, 2 gloo ranks on CPU, {args.steps} steps (first {WARMUP} not timed), default cadence; "
        f"width {args.width}, {args.layers} layers, {args.batch} × {args.seq} tokens a rank{', bf16 autocast' if args.autocast else ''}"
    )
    print(
        "| layout | mode | family | sites | twins bit-identical | spectral ratio rel. error | unwatched step (ms, median) | "
        "step watched / unwatched (median, [min, max] per rank) | inside the agent, share of the unwatched step (median, max per rank) | "
        "graphs compiled: unwatched → watched | graph breaks watched |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layout in args.layouts.split(","):
        for mode in args.modes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                spawn_ranks(_rank, 2, layout, mode, args.steps, tmp, size)
                ranks = [json.loads((Path(tmp) / f"rank-{r}.json").read_text()) for r in range(2)]
            ratios = [statistics.median(r["watched_times"]) / statistics.median(r["plain_times"]) for r in ranks]
            graphs = f"{ranks[0]['graphs_plain']} → {ranks[0]['graphs_watched']}" if mode != "eager" else "—"
            shares = [statistics.median(r["agent_times"]) / statistics.median(r["plain_times"]) for r in ranks]
            print(
                f"| {layout} | {mode} | {ranks[0]['family']} | {','.join(ranks[0]['sites'])} | {all(r['equal'] for r in ranks)} | "
                f"{ranks[0]['ratio_error']:.1e} | {1000 * statistics.median(ranks[0]['plain_times']):.1f} | {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] | {100 * statistics.median(shares):.1f} % ({100 * max(shares):.1f} %) | {graphs} | {ranks[0]['breaks'] if mode != 'eager' else '—'} |",
                flush=True,
            )
            assert math.isfinite(ranks[0]["ratio_error"])


if __name__ == "__main__":
    main()
