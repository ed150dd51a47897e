"""Structural discovery: blocks no family table or name pattern knows, read off their data flow.

Every layout of the zoo (`rankwatch_testkit.zoo`: renamed nanoGPT, Megatron-core, OLMo, MPT,
GQA with rotary, complex rotary, hand-written attention, a parallel block, a mixture of experts)
is discovered bare and `torch.compile`d, and each site's matrix is compared, exactly, with the
rows the layout's own definition says it uses; the spectral probe over the found layout is
checked against float64 `torch.linalg.matrix_norm(ord=2)` of those weights (relative 1e-3, the
spectral suite's tolerance, after 100 cold iterations). Tracing touches nothing: parameters,
gradients, the random streams, hooks and training flags are the same before and after. What
cannot be read exactly is refused with a message that names why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from rankwatch_testkit.zoo import LAYOUTS, ZooConfig, ZooModel
from torch import nn

from rankwatch.discovery import AttentionShape, DiscoveryError, discover
from rankwatch.spectral import SpectralProbe
from rankwatch.structure import BlockCall, NeedsCall, capture_call

REL_TOL = 1e-3


def zoo(layout: str, seed: int = 0) -> ZooModel:
    torch.manual_seed(seed)
    return ZooModel(ZooConfig(layout=layout))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_site_of_every_zoo_layout_is_found_exactly(layout: str, compiled: bool) -> None:
    model = zoo(layout)
    found = model.layout(cast(nn.Module, torch.compile(model)) if compiled else model)  # an OptimizedModule; the stub says Callable
    assert found.family == "structural"
    assert found.blocks_path == "trunk" and len(found.blocks) == model.config.layers
    assert found.embed is model.embedding and found.final_norm is model.final
    n_heads, n_kv, head_dim = model.attention_shape()
    for index, block in enumerate(found.blocks):
        assert block.module is model.trunk[index]
        expected = model.expected(index)
        assert set(block.matrices) == set(expected), f"{layout}: found {sorted(block.matrices)}, expected {sorted(expected)}"
        for site, want in expected.items():
            got = block.matrices[site]()
            assert got.shape == want.shape, f"{layout} block {index} {site}: {tuple(got.shape)} != {tuple(want.shape)}"
            assert torch.equal(got, want.detach()), f"{layout} block {index} {site}: other rows than the layout uses"
        assert block.attention == AttentionShape(n_heads, n_kv, head_dim)
        assert block.experts == (model.config.experts if layout == "moe" else None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_spectral_ratio_of_a_zoo_layout_matches_float64_matrix_norms(layout: str) -> None:
    model = zoo(layout, seed=1)
    layout_found = model.layout()
    got = {(m, l): v.item() for m, l, s, v in SpectralProbe(layout_found, cold_iters=100).compute() if s is None}
    for index in range(model.config.layers):
        w = {site: t.detach().double() for site, t in model.expected(index).items()}
        if w["down"].dim() == 3:  # experts: the largest of each expert's product
            mlp = max(float(torch.linalg.matrix_norm(w["down"][e] @ w["up"][e], ord=2)) for e in range(w["down"].shape[0]))
        else:
            mlp = float(torch.linalg.matrix_norm(w["down"] @ w["up"], ord=2))
        attn = float(torch.linalg.matrix_norm(w["o"], ord=2))
        for metric, want in (("spectral.mlp", mlp), ("spectral.attn", attn), ("spectral.ratio", mlp / attn)):
            value = got[(metric, index)]
            assert math.isclose(value, want, rel_tol=REL_TOL), f"{layout} layer {index} {metric}: {value} != {want}"


def _state(model: nn.Module) -> tuple[list[torch.Tensor], list[bool], torch.Tensor, int, list[bool], list[bool]]:
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return (
        [p.detach().clone() for p in model.parameters()],
        [p.grad is None for p in model.parameters()],
        torch.get_rng_state(),
        hooks,
        [m.training for m in model.modules()],
        [p.requires_grad for p in model.parameters()],
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tracing_a_block_touches_nothing(layout: str) -> None:
    model = zoo(layout).train()
    call = model.first_block_call() if getattr(model.trunk[0], "takes_tables", False) else None
    before = _state(model)
    discover(model, call=call)
    after = _state(model)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0], strict=True)), "a parameter changed"
    assert before[1] == after[1], "a gradient appeared"
    assert torch.equal(before[2], after[2]), "the CPU random stream moved"
    assert before[3:] == after[3:], "hooks, training flags or requires_grad changed"


# ---------------------------------------------------------------------------------------------
# Refusals: exact or nothing.


class _Attention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 4, how: str = "plain") -> None:
        super().__init__()
        self.heads, self.how = heads, how
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.d = nn.Linear(width, width)
        self.e = nn.Linear(width, 2 * width)
        self.f = nn.Linear(2 * width, width)
        self.cache: dict[int, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        heads: Callable[..., torch.Tensor] = lambda z, n=self.heads: z.view(b, t, n, -1).transpose(1, 2)  # noqa: E731
        q = self.a(x)
        if self.how == "mixed_q":
            q = q * self.b(x)  # bilinear: no one matrix is the query's
        q, k, v = heads(q), heads(self.b(x)), heads(self.c(x))
        if self.how == "tiled_gqa":
            k, v = heads(self.b(x)[..., : c // 2], 2), heads(self.c(x)[..., : c // 2], 2)
            k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)  # query head h uses kv head h % 2
        if self.how == "index_gqa":
            # kv heads picked by an index tensor: where it points is in its values, which a
            # meta tensor does not have.
            idx = torch.arange(self.heads, device=x.device) // 2
            k, v = heads(self.b(x)[..., : c // 2], 2)[:, idx], heads(self.c(x)[..., : c // 2], 2)[:, idx]
        if self.how == "sum_of_slices":
            wide = self.e(x)
            q = heads(wide[..., :c] + wide[..., c:])  # two slices of one map: no one rows are q
        if self.how == "two_keys":
            scores = q @ k.transpose(-2, -1) + q @ heads(self.d(x)).transpose(-2, -1)
            y = (F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
            x = x + self.d(y)
            return x + self.f(F.gelu(self.e(x)))
        if self.how == "lazy_cache":
            self.cache.setdefault(t, x.new_zeros(t))  # a cache the forward fills on first use
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        if self.how == "two_attentions":
            y = y + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, c)
        x = x + self.d(y)
        return x + self.f(F.gelu(self.e(x)))


class _Model(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Attention(how=how) for _ in range(2)])


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("mixed_q", r"query mixes two linear maps"),
        ("tiled_gqa", r"repeated in an order other than repeat_interleave's"),
        ("two_attentions", r"2 attentions"),
        ("index_gqa", r"key is not a linear map"),
        ("sum_of_slices", r"query mixes two linear maps"),
        ("two_keys", r"a softmax over more than one product"),
    ],
)
def test_what_cannot_be_read_exactly_is_refused_with_the_reason(how: str, reason: str) -> None:
    with pytest.raises(DiscoveryError, match=reason) as error:
        discover(_Model(how))
    message = str(error.value)
    assert "_Model" in message and "mapping=" in message and "blocks" in message


def test_the_plain_variant_of_the_refused_blocks_is_read() -> None:
    model = _Model("plain")
    found = discover(model)
    assert found.family == "structural"
    block = found.blocks[0]
    assert torch.equal(block.matrices["q"](), cast(_Attention, model.blocks[0]).a.weight)
    assert torch.equal(block.matrices["o"](), cast(_Attention, model.blocks[0]).d.weight)
    assert torch.equal(block.matrices["up"](), cast(_Attention, model.blocks[0]).e.weight)
    assert "gate" not in block.matrices


def test_a_partial_name_match_is_replaced_by_the_data_flow() -> None:
    """MPT's names match o, up and down in the generic table but not `Wqkv`: before, a map
    without q, k and v was returned silently."""
    model = zoo("mpt")
    found = discover(model)
    assert found.family == "structural" and found.blocks[0].sites() == ["q", "k", "v", "o", "up", "down"]


def test_a_block_that_wants_its_own_arguments_asks_for_its_first_call() -> None:
    model = zoo("rotary_args")
    with pytest.raises(NeedsCall, match=r"missing 3 required positional arguments") as error:
        discover(model)
    assert error.value.block is model.trunk[0]
    call = model.first_block_call()
    # Batch cut to 1 and the 12 tokens to 3, in every tensor and every dimension of that length.
    assert [tuple(t.shape) for t in call.args] == [(1, 3, 32), (3, 8), (3, 8), (3, 3)]
    assert all(t.device.type == "meta" for t in call.args)


def test_a_sequence_as_long_as_a_head_is_traced_uncut() -> None:
    """8 tokens, heads 8 wide: cutting every dimension of 8 would cut the rotary tables' width
    too, so the cut call fails and the trace runs on the call with only its batch cut."""
    model = zoo("rotary_args")
    calls: list[BlockCall] = []
    handle = model.trunk[0].register_forward_pre_hook(lambda _m, a, k: calls.append(capture_call(a, k)), with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (2, 8)))
    handle.remove()
    assert [tuple(t.shape) for t in calls[0].args] == [(1, 3, 32), (3, 3), (3, 3), (3, 3)]
    assert calls[0].uncut is not None and [tuple(t.shape) for t in calls[0].uncut[0]] == [(1, 8, 32), (8, 8), (8, 8), (8, 8)]
    found = discover(model, call=calls[0])
    for site, want in model.expected(0).items():
        assert torch.equal(found.blocks[0].matrices[site](), want)


def test_a_call_with_an_object_structural_discovery_would_call_into_is_refused() -> None:
    class Cache:
        pass

    with pytest.raises(DiscoveryError, match=r"takes Cache, which structural discovery does not call into"):
        capture_call((torch.zeros(2, 5, 8), Cache()), {})


def test_under_fsdp2_blocks_are_read_and_scattered_rows_of_a_sharded_weight_are_refused(tmp_path: Path) -> None:
    """FSDP2 gives each block a class of its own whose __new__ runs __init__ again: the meta copy
    must not go through it. A fused weight whose used rows form one range is measured shard by
    shard (a RowSlice); rows scattered over the shards (Megatron's per-group qkv) would need the
    whole weight gathered, so they are refused, not gathered."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rankwatch.layout import RowSlice

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        models = {}
        for layout in ("olmo", "megatron"):
            model = models[layout] = zoo(layout)
            for block in model.trunk:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        found = discover(models["olmo"])
        assert found.family == "structural" and found.blocks[0].sites() == ["q", "k", "v", "o", "up", "gate", "down"]
        q = found.blocks[0].matrices["q"]()
        assert isinstance(q, RowSlice) and (q.start, q.stop) == (0, 32)
        with pytest.raises(DiscoveryError, match=r"linear_qkv\.weight this model uses are not one range, and the weight is sharded"):
            discover(models["megatron"])
    finally:
        dist.destroy_process_group()


def test_a_cache_the_forward_fills_is_filled_in_the_copy_not_in_the_model() -> None:
    model = _Model("lazy_cache")
    found = discover(model)
    assert found.family == "structural"
    assert model.blocks[0].cache == {} and model.blocks[1].cache == {}, "the trace wrote into the model's own cache"
    model.blocks[0](torch.randn(1, 3, 16))  # and the model still runs on real tensors
