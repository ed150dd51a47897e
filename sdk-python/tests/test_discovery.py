"""Layer discovery against the models' own computation.

Every family is built from a tiny config (no downloads). For each block, each discovered matrix
W must reproduce what the model computes: feeding a random x through the real projection (or
through the fused projection, sliced exactly as the model's forward slices it) must equal
x @ W.T. Biases are cancelled by subtracting the projection of zero. Gated MLPs and experts are
checked end to end: the module's own forward must equal down(act(gate x) * up x) rebuilt from
the discovered matrices, which pins down which half of a fused gate/up is the gate.

Tolerance: both sides are the same float32 GEMMs with different summation order or fusion, so
they agree to a few ulps of the result; rtol=1e-5, atol=1e-5 leaves an order of magnitude of
room while a wrong slice or orientation is off by O(1).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Any, Protocol, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

from rankwatch.discovery import AttentionShape, Block, DiscoveryError, Layout, discover  # noqa: E402
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig  # noqa: E402
from torchtitan_llama_reference import Transformer, TransformerBlock, TransformerModelArgs  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    **TOKEN_IDS,
)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


class Projection(Protocol):
    """x -> its projection (a Callable[[Tensor], Tensor] that a lambda with defaults also is)."""

    def __call__(self, x: torch.Tensor, /) -> torch.Tensor: ...


def check_linear(weight: torch.Tensor, projection: Projection) -> None:
    """x @ W.T must equal projection(x) - projection(0) for random x."""
    assert weight.dim() == 2
    x = torch.randn(5, weight.shape[1])
    close(x @ weight.T, projection(x) - projection(torch.zeros_like(x)))


def shares_storage(view: torch.Tensor, parameter: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == parameter.untyped_storage().data_ptr()


def class_or_skip(name: str) -> type:
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return cls


def build(config_name: str, model_name: str, **overrides: object) -> Any:  # the class is chosen by name
    torch.manual_seed(0)
    config = class_or_skip(config_name)(**overrides)
    return class_or_skip(model_name)(config).eval()


def check_common(layout: Layout, family: str, n_layers: int) -> None:
    assert layout.family == family
    assert len(layout.blocks) == n_layers
    assert [b.index for b in layout.blocks] == list(range(n_layers))
    info = layout.to_info()
    json.dumps(info)  # must be plain JSON
    assert info["family"] == family
    assert [layer["index"] for layer in info["layers"]] == list(range(n_layers))
    for block, layer in zip(layout.blocks, info["layers"]):
        order = ["q", "k", "v", "o", "up", "gate", "down"]
        assert layer["sites"] == [s for s in order if s in block.matrices]
        if block.attention is None:
            assert "attention" not in layer
        else:
            assert layer["attention"] == {
                "n_heads": block.attention.n_heads,
                "n_kv_heads": block.attention.n_kv_heads,
                "head_dim": block.attention.head_dim,
            }
        assert layer.get("experts") == block.experts


def check_gated_mlp(block: Block, mlp_forward: Callable[[torch.Tensor], torch.Tensor], act: Callable[[torch.Tensor], torch.Tensor]) -> None:
    w = {s: block.matrices[s]() for s in ("up", "gate", "down")}
    x = torch.randn(5, w["up"].shape[1])
    rebuilt = (act(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
    close(mlp_forward(x), rebuilt)


# ---------------------------------------------------------------------------------------------
# Llama-like decoders: separate q/k/v/o_proj and gate/up/down_proj.

LLAMA_LIKE = [
    ("llama", "LlamaConfig", "LlamaForCausalLM", {}),
    ("mistral", "MistralConfig", "MistralForCausalLM", {}),
    ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {}),
    # Qwen3 and Gemma decouple head_dim from hidden/heads: use one that differs.
    ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    ("gemma", "GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
]


@pytest.mark.parametrize("family,config_name,model_name,extra", LLAMA_LIKE, ids=[f[0] for f in LLAMA_LIKE])
def test_llama_like_families(family: str, config_name: str, model_name: str, extra: dict[str, int]) -> None:
    model = build(config_name, model_name, **DECODER, **extra)
    layout = discover(model)
    check_common(layout, family, model.config.num_hidden_layers)
    head_dim = extra.get("head_dim", DECODER["hidden_size"] // DECODER["num_attention_heads"])
    assert layout.embed is model.model.embed_tokens
    assert layout.final_norm is model.model.norm
    for block, layer in zip(layout.blocks, model.model.layers):
        assert block.module is layer
        assert block.attention == AttentionShape(4, 2, head_dim)
        attn: Any = layer.self_attn  # the family's own classes, known here by name only
        mlp: Any = layer.mlp
        for site, proj in [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj), ("o", attn.o_proj),
                           ("up", mlp.up_proj), ("gate", mlp.gate_proj), ("down", mlp.down_proj)]:
            weight = block.matrices[site]()
            check_linear(weight, proj)
            assert weight.data_ptr() == proj.weight.data_ptr()  # zero-copy
        # mypy narrows mlp, through `is`, to Block.mlp_module's `Module | None`: it is the layer's MLP.
        assert block.attn_module is attn and block.mlp_module is mlp and block.gate_module is mlp.gate_proj  # type: ignore[union-attr]
        assert mlp is not None
        check_gated_mlp(block, mlp, cast(nn.Module, mlp.act_fn))


def test_gpt2_conv1d_transposed_and_fused_c_attn() -> None:
    model = build("GPT2Config", "GPT2LMHeadModel", vocab_size=64, n_embd=32, n_layer=3, n_head=4, n_positions=64)
    layout = discover(model)
    check_common(layout, "gpt2", 3)
    base = model.transformer
    assert layout.embed is base.wte and layout.final_norm is base.ln_f
    for block, layer in zip(layout.blocks, base.h):
        assert block.attention == AttentionShape(4, 4, 8)
        for index, site in enumerate(("q", "k", "v")):
            # GPT2Attention.forward: c_attn(x).split(split_size, dim=2)
            check_linear(block.matrices[site](), lambda x, i=index: layer.attn.c_attn(x).split(32, dim=-1)[i])
            assert shares_storage(block.matrices[site](), layer.attn.c_attn.weight)
        check_linear(block.matrices["o"](), layer.attn.c_proj)
        check_linear(block.matrices["up"](), layer.mlp.c_fc)
        check_linear(block.matrices["down"](), layer.mlp.c_proj)
        # Conv1D stores (in, out): the discovered (out, in) matrix is the transposed view.
        assert torch.equal(block.matrices["up"](), layer.mlp.c_fc.weight.T)
        assert block.matrices["up"]().shape == (128, 32)
        assert "gate" not in block.matrices and block.gate_module is None


def test_gpt_neox_per_head_interleaved_qkv() -> None:
    model = build(
        "GPTNeoXConfig", "GPTNeoXForCausalLM",
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, **TOKEN_IDS,
    )
    layout = discover(model)
    check_common(layout, "gpt_neox", 3)
    base = model.gpt_neox
    assert layout.embed is base.embed_in and layout.final_norm is base.final_layer_norm
    for block, layer in zip(layout.blocks, base.layers):
        attn = layer.attention
        assert block.attention == AttentionShape(4, 4, 8)

        def split(x: torch.Tensor, which: int) -> torch.Tensor:
            # GPTNeoXAttention.forward: view(..., -1, 3 * head_size), then chunk(3, dim=-1).
            qkv = attn.query_key_value(x).view(x.shape[0], -1, 3 * 8)
            return qkv.chunk(3, dim=-1)[which].reshape(x.shape[0], -1)

        for which, site in enumerate(("q", "k", "v")):
            check_linear(block.matrices[site](), lambda x, w=which: split(x, w))
        check_linear(block.matrices["o"](), attn.dense)
        check_linear(block.matrices["up"](), layer.mlp.dense_h_to_4h)
        check_linear(block.matrices["down"](), layer.mlp.dense_4h_to_h)
        # The layout really is interleaved: naive contiguous thirds would be wrong.
        naive_q = attn.query_key_value.weight[:32]
        assert not torch.allclose(naive_q, block.matrices["q"]())


def test_phi3_fused_qkv_gqa_and_gate_up_order() -> None:
    model = build("Phi3Config", "Phi3ForCausalLM", **DECODER)
    layout = discover(model)
    check_common(layout, "phi3", 3)
    for block, layer in zip(layout.blocks, model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert block.attention == AttentionShape(4, 2, 8)
        bounds = {"q": (0, 32), "k": (32, 48), "v": (48, 64)}  # Phi3Attention: query_pos = n_heads*hd
        for site, (lo, hi) in bounds.items():
            check_linear(block.matrices[site](), lambda x, lo=lo, hi=hi: attn.qkv_proj(x)[..., lo:hi])
            assert shares_storage(block.matrices[site](), attn.qkv_proj.weight)
        check_linear(block.matrices["o"](), attn.o_proj)
        # Phi3MLP: gate, up = gate_up_proj(x).chunk(2): the module's forward decides the order.
        check_gated_mlp(block, mlp, mlp.activation_fn)
        assert block.gate_module is None  # fused: no module outputs the gate alone


def check_experts(block: Block, experts: nn.Module, n_experts: int, hidden: int, intermediate: int) -> None:
    assert block.experts == n_experts
    assert block.matrices["up"]().shape == (n_experts, intermediate, hidden)
    assert block.matrices["gate"]().shape == (n_experts, intermediate, hidden)
    assert block.matrices["down"]().shape == (n_experts, hidden, intermediate)
    x = torch.randn(6, hidden)
    for expert in (0, n_experts - 1):
        # Route every token to one expert with weight 1: the experts module computes exactly
        # that expert's down(act(gate x) * up x).
        routed = experts(x, torch.full((6, 1), expert), torch.ones(6, 1))
        w = {s: block.matrices[s]()[expert] for s in ("up", "gate", "down")}
        close(routed, (cast(nn.Module, experts.act_fn)(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T)


def test_mixtral_3d_experts() -> None:
    model = build("MixtralConfig", "MixtralForCausalLM", **DECODER, num_local_experts=4, num_experts_per_tok=2)
    layout = discover(model)
    check_common(layout, "mixtral", 3)
    for block, layer in zip(layout.blocks, model.model.layers):
        assert block.attention == AttentionShape(4, 2, 8)
        check_linear(block.matrices["q"](), layer.self_attn.q_proj)
        check_linear(block.matrices["o"](), layer.self_attn.o_proj)
        experts = layer.mlp.experts
        check_experts(block, experts, 4, 32, 48)
        if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
            assert shares_storage(block.matrices["gate"](), experts.gate_up_proj)


class LegacyMixtralExpert(nn.Module):
    """MixtralBlockSparseTop2MLP as in transformers < 5 (experts were a ModuleList of these)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


def test_legacy_modulelist_experts_and_block_sparse_moe_name() -> None:
    model = build("MixtralConfig", "MixtralForCausalLM", **DECODER, num_local_experts=4, num_experts_per_tok=2)
    qwen_mlp = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeMLP
    qwen_config = transformers.Qwen2MoeConfig(**DECODER)
    for index, layer in enumerate(model.model.layers):
        sparse = layer.mlp
        if index == 0:  # old Mixtral: `block_sparse_moe` holding w1/w2/w3 experts
            sparse.experts = nn.ModuleList([LegacyMixtralExpert(32, 48) for _ in range(4)])
            del layer.mlp
            layer.block_sparse_moe = sparse
        else:  # old Qwen-MoE: a ModuleList of gate/up/down_proj MLPs
            sparse.experts = nn.ModuleList([qwen_mlp(qwen_config, intermediate_size=24) for _ in range(4)])
    layout = discover(model)
    check_common(layout, "mixtral", 3)
    for index, block in enumerate(layout.blocks):
        sparse = model.model.layers[index].block_sparse_moe if index == 0 else model.model.layers[index].mlp
        assert block.mlp_module is sparse and block.experts == 4
        assert sparse is not None  # for mypy: the `is` above narrowed it to Block.mlp_module's `Module | None`
        width = 48 if index == 0 else 24
        assert block.matrices["up"]().shape == (4, width, 32)
        for expert in (0, 3):
            module = cast(nn.ModuleList, sparse.experts)[expert]
            act = cast(nn.Module, module.act_fn)
            rebuilt = {s: block.matrices[s]()[expert] for s in ("up", "gate", "down")}
            x = torch.randn(5, 32)
            close(module(x), (act(x @ rebuilt["gate"].T) * (x @ rebuilt["up"].T)) @ rebuilt["down"].T)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe"])
def test_qwen_moe_experts_and_dense_layers(family: str) -> None:
    names: dict[str, tuple[str, str]] = {"qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
    extra: dict[str, object] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1])
    if family == "qwen2_moe":
        extra["shared_expert_intermediate_size"] = 40
    # mypy does not count *names[family] as filling both named parameters before the **dicts.
    model = build(*names[family], **DECODER, **extra)  # type: ignore[misc, arg-type]
    layout = discover(model)
    check_common(layout, family, 3)
    for index, (block, layer) in enumerate(zip(layout.blocks, model.model.layers)):
        check_linear(block.matrices["k"](), layer.self_attn.k_proj)
        check_linear(block.matrices["v"](), layer.self_attn.v_proj)
        if index == 1:  # mlp_only_layers: a dense gated MLP
            assert block.experts is None
            check_gated_mlp(block, layer.mlp, layer.mlp.act_fn)
        else:
            check_experts(block, layer.mlp.experts, 4, 32, 24)
    assert "experts" not in layout.to_info()["layers"][1]
    assert layout.to_info()["layers"][0]["experts"] == 4


def test_bert_minilm_layout() -> None:
    model = build(
        "BertConfig", "BertModel", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4,
    )
    layout = discover(model)
    check_common(layout, "bert", 3)
    assert layout.embed is model.embeddings and layout.final_norm is None
    for block, layer in zip(layout.blocks, model.encoder.layer):
        self_attn = layer.attention.self
        for site, proj in [("q", self_attn.query), ("k", self_attn.key), ("v", self_attn.value),
                           ("o", layer.attention.output.dense), ("up", layer.intermediate.dense),
                           ("down", layer.output.dense)]:
            check_linear(block.matrices[site](), proj)
        assert block.attention == AttentionShape(4, 4, 8)


def test_nanogpt() -> None:
    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(n_layer=3, n_head=4, n_embd=32, vocab_size=64, block_size=16))
    layout = discover(model)
    check_common(layout, "nanogpt", 3)
    assert layout.embed is model.transformer.wte and layout.final_norm is model.transformer.ln_f
    for block, layer in zip(layout.blocks, model.transformer.h):
        for index, site in enumerate(("q", "k", "v")):
            # CausalSelfAttention.forward: c_attn(x).split(n_embd, dim=2)
            check_linear(block.matrices[site](), lambda x, i=index: layer.attn.c_attn(x).split(32, dim=-1)[i])
        check_linear(block.matrices["o"](), layer.attn.c_proj)
        check_linear(block.matrices["up"](), layer.mlp.c_fc)
        check_linear(block.matrices["down"](), layer.mlp.c_proj)
        assert block.attention == AttentionShape(4, 4, 8)


def test_torchtitan_llama_w1_is_gate() -> None:
    torch.manual_seed(0)
    model = Transformer(TransformerModelArgs(dim=64, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=64))
    layout = discover(model)
    check_common(layout, "torchtitan_llama", 3)
    assert layout.embed is model.tok_embeddings and layout.final_norm is model.norm
    for block, layer in zip(layout.blocks, cast("Iterable[TransformerBlock]", model.layers.values())):
        attn, ffn = layer.attention, layer.feed_forward
        assert block.attention == AttentionShape(8, 2, 8)
        for site, proj in [("q", attn.wq), ("k", attn.wk), ("v", attn.wv), ("o", attn.wo)]:
            check_linear(block.matrices[site](), proj)
        assert block.matrices["gate"]().data_ptr() == ffn.w1.weight.data_ptr()
        check_gated_mlp(block, ffn, F.silu)  # forward is w2(silu(w1 x) * w3 x)
        assert block.gate_module is ffn.w1


def test_torchtitan_layers_ordered_numerically() -> None:
    model = Transformer(TransformerModelArgs(dim=16, n_layers=12, n_heads=2, n_kv_heads=1, vocab_size=16))
    layout = discover(model)
    assert [b.module for b in layout.blocks] == [model.layers[str(i)] for i in range(12)]


# ---------------------------------------------------------------------------------------------
# Wrappers and containers.


def test_unwraps_compile_dataparallel_and_containers() -> None:
    model = build("LlamaConfig", "LlamaForCausalLM", **DECODER)
    compiled = cast(nn.Module, torch.compile(model))  # lazy: nothing is traced until the first call
    assert hasattr(compiled, "_orig_mod")
    # torch.compile of a module is a module (OptimizedModule); its stub says only Callable.
    for wrapped in (compiled, nn.DataParallel(model), cast(nn.Module, torch.compile(nn.DataParallel(model)))):
        layout = discover(wrapped)
        assert layout.family == "llama"
        assert layout.blocks[0].module is model.model.layers[0]

    class TrainingModule(nn.Module):  # the shape of a LightningModule holding an HF model
        def __init__(self) -> None:
            super().__init__()
            self.loss_fn = nn.CrossEntropyLoss()
            self.model = model

    assert discover(TrainingModule()).blocks[2].module is model.model.layers[2]


def test_unwraps_distributed_data_parallel() -> None:
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable or already initialised by another test")
    model = build("LlamaConfig", "LlamaForCausalLM", **DECODER)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            ddp = nn.parallel.DistributedDataParallel(model)
            layout = discover(ddp)
            assert layout.family == "llama"
            assert layout.blocks[1].module is model.model.layers[1]
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Generic fallback, mapping, errors.


def test_generic_fallback_on_torch_transformer_encoder() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    layout = discover(model)
    check_common(layout, "generic", 2)
    for block, encoder_layer in zip(layout.blocks, model.layers):
        mha = encoder_layer.self_attn
        assert block.attention == AttentionShape(4, 4, 8)
        # Rebuild multi-head attention from the discovered q/k/v/o and compare with the module.
        x = torch.randn(2, 5, 32)
        w = {s: block.matrices[s]() for s in ("q", "k", "v", "o")}
        bq, bk, bv = mha.in_proj_bias.chunk(3)
        heads: Callable[[torch.Tensor], torch.Tensor] = lambda t: t.view(2, 5, 4, 8).transpose(1, 2)  # noqa: E731
        q, k, v = heads(x @ w["q"].T + bq), heads(x @ w["k"].T + bk), heads(x @ w["v"].T + bv)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 32)
        close(attended @ w["o"].T + mha.out_proj.bias, mha(x, x, x, need_weights=False)[0])
        check_linear(block.matrices["up"](), encoder_layer.linear1)
        check_linear(block.matrices["down"](), encoder_layer.linear2)


def test_unknown_model_raises_clear_error() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(DiscoveryError) as error:
        discover(model)
    message = str(error.value)
    assert "Sequential" in message and "mapping=" in message


class CustomBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.ModuleDict({"query": nn.Linear(width, width), "val": nn.Linear(width, width), "out": nn.Linear(width, width)})
        # Stored (in, out), like a Conv1D: needs "transposed".
        self.w_in = nn.Parameter(torch.randn(width, 2 * width))
        self.w_out = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix["out"](self.mix["val"](x) * torch.sigmoid(self.mix["query"](x)))
        return x + self.w_out(torch.relu(x @ self.w_in))


class CustomModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.trunk = nn.ModuleDict({"stack": nn.ModuleList([CustomBlock(16) for _ in range(3)])})
        self.last = nn.LayerNorm(16)


def test_mapping_on_custom_model() -> None:
    torch.manual_seed(0)
    model = CustomModel()
    mapping = {
        "blocks": "trunk.stack", "q": "mix.query", "v": "mix.val", "o": "mix.out",
        "up": "w_in", "down": "w_out", "transposed": ["up"],
        "attention": {"n_heads": 2, "n_kv_heads": 2, "head_dim": 8},
        "embed": "emb", "final_norm": "last", "mlp": "w_out",
    }
    layout = discover(model, mapping=mapping)
    check_common(layout, "mapping", 3)
    assert layout.embed is model.emb and layout.final_norm is model.last
    for block, custom in zip(layout.blocks, cast("Iterable[CustomBlock]", model.trunk["stack"])):
        assert block.sites() == ["q", "v", "o", "up", "down"]
        check_linear(block.matrices["q"](), custom.mix["query"])
        check_linear(block.matrices["up"](), lambda x, c=custom: x @ c.w_in)
        check_linear(block.matrices["down"](), custom.w_out)
        assert block.attention == AttentionShape(2, 2, 8)
        assert block.mlp_module is custom.w_out


def test_mapping_typo_names_the_path() -> None:
    with pytest.raises(DiscoveryError, match=r"mix\.qurey"):
        discover(CustomModel(), mapping={"blocks": "trunk.stack", "q": "mix.qurey"})
    with pytest.raises(DiscoveryError, match=r"trunk\.stak"):
        discover(CustomModel(), mapping={"blocks": "trunk.stak"})
    with pytest.raises(DiscoveryError, match="unknown keys"):
        discover(CustomModel(), mapping={"blocks": "trunk.stack", "query": "mix.query"})


def test_mapping_resolves_through_task_head() -> None:
    model = build("LlamaConfig", "LlamaForCausalLM", **DECODER)
    for blocks in ("layers", "model.layers"):  # relative to the base model or to the head
        layout = discover(model, mapping={"blocks": blocks, "q": "self_attn.q_proj"})
        assert layout.blocks[0].module is model.model.layers[0]
