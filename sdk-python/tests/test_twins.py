"""Watching never changes training, and what it reports is the truth.

Each layout runs as 4 gloo processes (`twins_worker.py`): the same job unwatched and watched,
every probe on (the replica fingerprint included). The twins must end with bit-identical parameters — the probes only read
gradients and weights, issue no collective and draw no random numbers, so nothing may differ,
not even in the last bit. The reported per-rank gradient statistics must equal a brute-force
recomputation (local gradients of a hook-free copy, gathered over the data-parallel group in
float64): relative 1e-5 in float32 training (the all-reduce sums float32 in gloo's order), 1e-3
under bf16/fp16 autocast (the reference's unscaled low-precision backward rounds differently);
‖ḡ‖ must also equal, to 1e-5, the norm of the averaged gradient DDP actually produced, which a
bf16 compression hook rounds (there the float64 reference is only good to 1e-2).
A hang is a failure: every process has a deadline.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import run_ranks

WORLD = 4
DEADLINE_S = 240
LAYOUTS = ["world", "subgroups", "comm_hook", "accumulation", "amp", "bf16", "unwatch", "checkpoint"]


def run_layout(layout: str, out: Path) -> list[dict[str, Any]]:
    worker = Path(__file__).with_name("twins_worker.py")
    run_ranks([sys.executable, str(worker), layout, str(out)], WORLD, DEADLINE_S)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_watched_and_unwatched_twins_end_identical_and_reports_are_true(layout: str, tmp_path: Path) -> None:
    ranks = run_layout(layout, tmp_path)
    rtol = 1e-3 if layout in ("amp", "bf16") else 1e-5
    for rank, result in enumerate(ranks):
        unequal = [name for name, same in result["equal"].items() if not same]
        assert not unequal, f"{layout} rank {rank}: watching changed {unequal} (max |Δ| {result['max_diff']})"
        reported = {r["step"]: r["values"] for r in result["reported"]}
        if layout == "unwatch":
            assert sorted(reported) == [0, 1, 2], "nothing is reported after finish()"
        for want in result["expected"]:
            got = reported.get(want["step"])
            if got is None:
                continue
            assert got["nonfinite/None/None"] == 0 or layout == "amp"
            if want.get("amp_skipped"):
                assert got["amp_skipped/None/None"] == 1.0, f"rank {rank} step {want['step']}: the scaler skipped it"
                assert got["nonfinite/None/None"] == 0, "an overflow step is not a non-finite alarm"
                continue
            if layout == "amp":
                assert got["amp_skipped/None/None"] == 0.0
            # ‖ḡ‖ is the norm of the gradient the optimizer really gets, compressed or not.
            assert math.isclose(got["grad_norm_mean/None/None"], want["reduced_norm"], rel_tol=rtol)
            # The exact cosine has its own cadence: every 5th step in "world" (logged 0, 3, 6).
            dot_due = layout != "world" or want["step"] in (0, 6)
            assert ("cos_to_mean/None/None" in got) == dot_due, f"{layout} step {want['step']}: cos_to_mean due {dot_due}"
            for name in ("grad_norm", "grad_norm_mean", "cos_to_mean") if dot_due else ("grad_norm", "grad_norm_mean"):
                value = got[f"{name}/None/None"]
                # bf16 compression rounds the averaged gradient (2^-8 per coordinate).
                tolerance = 1e-2 if layout == "comm_hook" and name != "grad_norm" else rtol
                assert math.isclose(value, want[name], rel_tol=tolerance), f"{layout} rank {rank} step {want['step']} {name}: {value} != {want[name]}"
    # The replica fingerprint ran too (every probe on), and the replicas of each group agree.
    groups: dict[tuple[int, ...], list[dict[int, Any]]] = {}
    for result in ranks:
        groups.setdefault(tuple(result["dp_ranks"]), []).append({r["step"]: r["values"] for r in result["reported"]})
    for members in groups.values():
        digests = {step: [m[step].get("param_fingerprint/None/None") for m in members] for step in members[0]}
        fingerprinted = [step for step, values in digests.items() if values[0] is not None]
        assert fingerprinted, f"{layout}: no replica fingerprint reported"
        for step in fingerprinted:
            assert len(set(digests[step])) == 1, f"{layout} step {step}: replicas' digests differ {digests[step]}"
    steps = {r["step"] for r in ranks[0]["reported"]}
    if layout == "accumulation":
        # One record per optimizer step, logged every other step: each describes its own step.
        assert steps == {0, 2, 4, 6}
    if layout == "world":
        assert steps == {0, 3, 6}
        by_step = {r["step"]: r["values"] for r in ranks[0]["reported"]}
        for step, due in ((0, True), (3, False), (6, True)):
            has_acts = any(k.startswith("act_max/") for k in by_step[step])
            has_spectral = any(k.startswith("spectral.ratio/") for k in by_step[step])
            assert has_acts == due and has_spectral == due, f"step {step}: activations {has_acts}, spectral {has_spectral}"
    if layout == "amp":
        skipped = [w["step"] for w in ranks[0]["expected"] if w.get("amp_skipped")]
        assert skipped, "the too-high initial scale makes the scaler skip steps"
    if layout == "subgroups":
        assert [r["dp_ranks"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
        # ‖ḡ‖ is the group's: equal within a group, different across the two groups.
        means = [r["reported"][0]["values"]["grad_norm_mean/None/None"] for r in ranks]
        assert math.isclose(means[0], means[1], rel_tol=1e-6) and math.isclose(means[2], means[3], rel_tol=1e-6)
        assert not math.isclose(means[0], means[2], rel_tol=1e-3)
        runs = sorted(p.name for p in (tmp_path / "spool").iterdir())
        assert runs == ["twins-subgroups.dp0", "twins-subgroups.dp2"], "each replica group is a run of its own"
