"""ActivationProbe against a hook-free recomputation.

The reference walks the model by hand — embedding, then for each block the attention sublayer,
the residual add, the MLP sublayer (and the gate projection), then the final norm — calling the
same submodules with no probe installed, and checks that this walk reproduces the model's own
output (so the reference is the model's computation, not our reading of it). Maxima are then
taken by brute force over real tokens in float64, and token cosine from the explicit T×T cosine
matrix of each sequence in float64.

Padding is right padding with a pad token whose embedding row is scaled to ~1e4: padded
positions carry huge values through the residual stream, real tokens never see them (causal
attention), and a probe that let one through would be off by orders of magnitude.

Tolerances: act_max selects one float32 activation, so probe and reference differ only by the
float32 error of the forward itself (the model's masked attention kernel vs the reference's
plain causal one): rtol 1e-5. token_cosine is a float32 sum of T unit vectors against a float64
pairwise mean; its error is ~T·ε_f32 ≈ 1e-6 for these lengths: atol 1e-5.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from rankwatch.activations import ActivationProbe  # noqa: E402
from rankwatch.discovery import discover  # noqa: E402
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig  # noqa: E402

ACT_RTOL = 1e-5
COSINE_ATOL = 1e-5
PAD = 0
LENGTHS = (7, 4, 1, 5)  # one sequence with a single real token: no pairs, left out of the cosine

Key = tuple[str, int | None, str | None]

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def padded_batch(vocab: int, seq: int = 7, lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (len(lengths), seq), generator=generator)
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return ids.masked_fill(mask == 0, PAD), mask


def make_pad_huge(embedding: nn.Embedding) -> None:
    with torch.no_grad():
        embedding.weight[PAD] = torch.randn(embedding.weight.shape[1]) * 1e4


def masked_max(activation: torch.Tensor, mask: torch.Tensor) -> float:
    return activation.double()[mask.bool()].abs().max().item()


def pairwise_cosine_mean(hidden: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Per sequence with ≥ 2 real tokens: mean off-diagonal cosine, explicit T×T in float64."""
    means = []
    for states, row in zip(hidden.double(), mask.bool()):
        real = states[row]
        count = real.shape[0]
        if count < 2:
            continue
        units = real / real.norm(dim=-1, keepdim=True)
        cosines = units @ units.T
        means.append(((cosines.sum() - cosines.diagonal().sum()) / (count * (count - 1))).item())
    return means


class Reference:
    """Brute-force expected metrics, accumulated over several forward calls."""

    def __init__(self) -> None:
        self.maxima: dict[Key, float] = {}
        self.cosines: dict[int, list[float]] = {}

    def act(self, site: str, layer: int | None, activation: torch.Tensor, mask: torch.Tensor) -> None:
        key = ("act_max", layer, site)
        self.maxima[key] = max(self.maxima.get(key, 0.0), masked_max(activation, mask))

    def block_output(self, layer: int, hidden: torch.Tensor, mask: torch.Tensor) -> None:
        self.act("residual", layer, hidden, mask)
        self.cosines.setdefault(layer, []).extend(pairwise_cosine_mean(hidden, mask))

    def expected(self) -> dict[Key, float]:
        out = dict(self.maxima)
        for layer, values in self.cosines.items():
            out[("token_cosine", layer, None)] = sum(values) / len(values)
        return out


def as_dict(results: list[tuple[str, int | None, str | None, torch.Tensor]]) -> dict[Key, float]:
    for _, _, _, value in results:
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float32
    return {(m, l, s): v.item() for m, l, s, v in results}


def assert_matches(got: dict[Key, float], expected: dict[Key, float]) -> None:
    assert set(got) == set(expected)
    for key, value in expected.items():
        if key[0] == "token_cosine":
            assert got[key] == pytest.approx(value, abs=COSINE_ATOL), key
        else:
            assert got[key] == pytest.approx(value, rel=ACT_RTOL), key


# ---------------------------------------------------------------------------------------------
# Hugging Face Llama.


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    make_pad_huge(model.model.embed_tokens)
    return model


@torch.no_grad()
def llama_reference(model: LlamaForCausalLM, ids: torch.Tensor, mask: torch.Tensor, reference: Reference) -> None:
    base = model.model
    seq = ids.shape[1]
    hidden = base.embed_tokens(ids)
    reference.act("embed", None, hidden, mask)
    position_embeddings = base.rotary_emb(hidden, position_ids=torch.arange(seq)[None])
    causal = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    for index, layer in enumerate(cast("Iterable[LlamaDecoderLayer]", base.layers)):
        attn_out = layer.self_attn(
            layer.input_layernorm(hidden), position_embeddings=position_embeddings, attention_mask=causal
        )[0]
        middle = hidden + attn_out
        normed = layer.post_attention_layernorm(middle)
        mlp_out = layer.mlp(normed)
        hidden = middle + mlp_out
        reference.act("attn_out", index, attn_out, mask)
        reference.act("mlp_out", index, mlp_out, mask)
        reference.act("gate", index, layer.mlp.gate_proj(normed), mask)
        reference.block_output(index, hidden, mask)
    final = base.norm(hidden)
    reference.act("final_norm", None, final, mask)
    # The hand walk must be the model's computation on every real token.
    model_final = base(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(final[real], model_final[real], rtol=1e-5, atol=1e-5)
    # And the padding really is huge, so leaking it would show.
    assert hidden.abs().max() > 1e3 > reference.maxima[("act_max", 2, "residual")]


@pytest.mark.parametrize("mask_as", ["keyword", "positional", "set_mask"])
def test_llama_matches_hook_free_recomputation(mask_as: str) -> None:
    model = tiny_llama()
    ids, mask = padded_batch(64)
    reference = Reference()
    llama_reference(model, ids, mask, reference)  # before the probe exists: no hooks involved

    probe = ActivationProbe(model, discover(model), gate=True)
    probe.arm()
    with torch.no_grad():
        if mask_as == "keyword":
            model(input_ids=ids, attention_mask=mask)
        elif mask_as == "positional":
            model(ids, mask)  # LlamaForCausalLM.forward(input_ids, attention_mask, ...)
        else:
            probe.set_mask(mask)
            model(input_ids=ids)
    assert_matches(as_dict(probe.collect()), reference.expected())


def test_llama_without_any_mask_sees_the_padding() -> None:
    """Control: the same batch with no mask reports the huge padded values."""
    model = tiny_llama()
    ids, _ = padded_batch(64)
    probe = ActivationProbe(model, discover(model))
    probe.arm()
    with torch.no_grad():
        model(input_ids=ids)
    got = as_dict(probe.collect())
    assert got[("act_max", None, "embed")] > 1e3 and got[("act_max", 0, "residual")] > 1e3


def test_mixtral_moe_block_output_is_measured() -> None:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    )
    model = transformers.MixtralForCausalLM(config).eval()
    ids, mask = padded_batch(64)
    layer = model.model.layers[1]
    captured: dict[str, torch.Tensor] = {}
    handle = layer.mlp.register_forward_hook(lambda m, a, out: captured.setdefault("mlp", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    probe = ActivationProbe(model, discover(model))
    probe.arm()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    got = as_dict(probe.collect())
    assert got[("act_max", 1, "mlp_out")] == pytest.approx(masked_max(captured["mlp"], mask), rel=ACT_RTOL)


# ---------------------------------------------------------------------------------------------
# nanoGPT: gradient accumulation, arming, removal.


def tiny_nanogpt() -> NanoGPT:
    torch.manual_seed(0)
    model = NanoGPT(NanoGPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32)).eval()
    make_pad_huge(model.transformer.wte)
    return model


@torch.no_grad()
def nanogpt_reference(model: NanoGPT, ids: torch.Tensor, mask: torch.Tensor, reference: Reference) -> None:
    transformer = model.transformer
    tokens = transformer.wte(ids)
    reference.act("embed", None, tokens, mask)
    hidden = transformer.drop(tokens + transformer.wpe(torch.arange(ids.shape[1])))
    for index, block in enumerate(transformer.h):
        attn_out = block.attn(block.ln_1(hidden))
        hidden = hidden + attn_out
        mlp_out = block.mlp(block.ln_2(hidden))
        hidden = hidden + mlp_out
        reference.act("attn_out", index, attn_out, mask)
        reference.act("mlp_out", index, mlp_out, mask)
        reference.block_output(index, hidden, mask)
    final = transformer.ln_f(hidden)
    reference.act("final_norm", None, final, mask)
    logits, _ = model(ids)
    real = mask.bool()
    torch.testing.assert_close(model.lm_head(final)[real], logits[real], rtol=1e-5, atol=1e-5)


def test_nanogpt_accumulates_over_micro_batches() -> None:
    model = tiny_nanogpt()
    batches = [padded_batch(64, seed=1), padded_batch(64, seq=9, lengths=(9, 2, 6), seed=2)]
    reference = Reference()
    for ids, mask in batches:
        nanogpt_reference(model, ids, mask, reference)

    probe = ActivationProbe(model, discover(model))
    probe.arm()
    with torch.no_grad():
        for ids, mask in batches:  # two micro-batches of different shapes, one report
            model(ids, attention_mask=mask)
    assert_matches(as_dict(probe.collect()), reference.expected())
    assert probe.collect() == []  # collect resets


def test_a_new_optimizer_step_starts_the_fold_afresh_and_evaluation_is_left_out() -> None:
    """Armed over several steps, the probe reports the last optimizer step's forwards only; a
    run's probe (training_only) ignores forwards without autograd."""
    model = tiny_nanogpt()
    first, second = padded_batch(64, seed=1), padded_batch(64, seq=9, lengths=(9, 2, 6), seed=2)
    reference = Reference()
    nanogpt_reference(model, *second, reference)
    probe = ActivationProbe(model, discover(model), training_only=True)
    probe.arm()
    model(first[0], attention_mask=first[1])  # an earlier step's forward
    probe.new_step()
    with torch.no_grad():
        model(first[0], attention_mask=first[1])  # evaluation: not a training step
    model(second[0], attention_mask=second[1])
    assert_matches(as_dict(probe.collect()), reference.expected())


def test_unarmed_hooks_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_nanogpt()
    ids, mask = padded_batch(64)
    probe = ActivationProbe(model, discover(model))
    calls = 0
    real_norm = torch.linalg.vector_norm

    def counting_norm(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return real_norm(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", counting_norm)
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert calls == 0 and probe.collect() == []

    probe.arm()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    probe.disarm()
    assert calls > 0
    collected = probe.collect()
    assert len(collected) == 1 + 2 * 4 + 1  # embed, 2 × (residual, cosine, attn, mlp), final

    calls = 0
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert calls == 0 and probe.collect() == []


def hook_counts(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("build", [tiny_nanogpt, tiny_llama])
def test_remove_removes_every_hook(build: Callable[[], nn.Module]) -> None:
    model = build()
    before = hook_counts(model)
    probe = ActivationProbe(model, discover(model), gate=True)
    assert hook_counts(model) > before
    probe.remove()
    assert hook_counts(model) == before
    assert not model._forward_hooks and not model._forward_pre_hooks


def test_token_cosine_of_identical_tokens_is_one() -> None:
    """A collapsed residual stream (every token the same direction) must read 1."""
    model = nn.Sequential()
    block = nn.Identity()
    model.append(block)
    from rankwatch.discovery import Block, Layout

    layout = Layout("mapping", [Block(index=0, module=block, matrices={})])
    probe = ActivationProbe(model, layout)
    probe.arm()
    direction = torch.randn(1, 1, 16)
    scales = torch.rand(2, 6, 1) + 0.5  # same direction, different lengths
    model(direction * scales)
    got = as_dict(probe.collect())
    assert got[("token_cosine", 0, None)] == pytest.approx(1.0, abs=1e-6)


def test_no_host_sync_on_meta_tensors() -> None:
    """Meta tensors have no data: any .item(), float() or branch on a value would raise."""
    with torch.device("meta"):
        model = NanoGPT(NanoGPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=4, n_embd=32))
        ids = torch.zeros(3, 8, dtype=torch.long)
        mask = torch.ones(3, 8, dtype=torch.long)
    probe = ActivationProbe(model, discover(model))
    probe.arm()
    model(ids, attention_mask=mask)  # gradients enabled, as in training
    probe.set_mask(mask)
    model(ids)
    results = probe.collect()
    assert len(results) == 10
    assert all(v.device.type == "meta" and v.dim() == 0 and not v.requires_grad for *_, v in results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_on_cuda() -> None:
    model = tiny_nanogpt().cuda()
    ids, mask = padded_batch(64)
    ids, mask = ids.cuda(), mask.cuda()
    probe = ActivationProbe(model, discover(model))
    probe.arm()
    model(ids, attention_mask=mask)  # warm-up outside the check (kernel selection may sync)
    probe.collect()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(ids, attention_mask=mask)
        results = probe.collect()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(results) == 10 and all(v.is_cuda for *_, v in results)


def test_chunked_token_cosine_and_recompute_under_checkpointing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk budget of a few tokens gives the same values as one pass; under non-reentrant
    activation checkpointing the recompute inside the backward is not measured again."""
    model = tiny_nanogpt().train()
    ids, mask = padded_batch(64, seed=3)
    reference = Reference()
    nanogpt_reference(model.eval(), ids, mask, reference)
    model.train()
    model.transformer.drop.p = 0.0
    for block in model.transformer.h:
        block.attn.attn_dropout.p = block.attn.resid_dropout.p = block.mlp.dropout.p = 0.0
    folds = {"n": 0}
    original = ActivationProbe._fold_cosine

    def counting(self: ActivationProbe, layer: int, hidden: torch.Tensor) -> None:
        folds["n"] += 1
        original(self, layer, hidden)

    monkeypatch.setattr(ActivationProbe, "_fold_cosine", counting)
    # 3 tokens of width 32 per chunk, for a batch of 3: the 7-token sequences take 3 passes.
    probe = ActivationProbe(model, discover(model), training_only=True, chunk_bytes=3 * 3 * 32 * 4)
    probe.arm()
    from torch.utils.checkpoint import checkpoint

    for block in model.transformer.h:
        block.forward = (lambda forward: lambda x: checkpoint(forward, x, use_reentrant=False))(block.forward)  # type: ignore[method-assign]  # checkpointing the block, as a user does
    logits, _ = model(ids, attention_mask=mask)
    logits.float().sum().backward()
    assert folds["n"] == len(model.transformer.h), "the recompute in the backward is not measured again"
    assert_matches(as_dict(probe.collect()), reference.expected())
    assert probe.elapsed > 0
