"""The Hugging Face and Lightning callbacks, each on a real (tiny) training run on CPU."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest
import requests
import torch

from conftest import Collector

if TYPE_CHECKING:
    from torch.utils.data import Dataset


def _runs(collector: Collector) -> dict[str, dict[str, Any]]:
    return {r["run"]: r for r in requests.get(f"{collector.url}/api/v1/runs", timeout=10).json()["runs"]}


def test_hugging_face_trainer_callback(collector: Collector, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from rankwatch.integrations.transformers import RankwatchCallback

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)
    data = [{"input_ids": torch.randint(0, 64, (12,)), "labels": torch.randint(0, 64, (12,))} for _ in range(16)]
    for row in data[::2]:
        row["labels"][:4] = -100  # ignored tokens must not count
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=1e-3,
    )
    callback = RankwatchCallback(run="hf-trainer", collector=collector.url, spool_dir=tmp_path / "spool", every={"spectral": 2, "activations": 2})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    assert callback.run is not None and callback.run._finished

    logged = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    rows = {r["step"]: r["value"] for r in collector.sql("SELECT step, value FROM samples WHERE run = 'hf-trainer' AND metric = 'loss'")}
    assert sorted(rows) == [1, 2, 3, 4]
    for step, value in logged.items():
        # Trainer rounds its logged loss to 4 decimals; ours is the exact per-rank value.
        assert math.isclose(rows[step], value, abs_tol=1e-3), (step, rows[step], value)
    tokens = collector.sql("SELECT sum(value) AS n FROM samples WHERE run = 'hf-trainer' AND metric = 'tokens'")[0]["n"]
    # One epoch of 16 rows, causal LM: 11 predicted positions per row, and 8 rows ignore 3.
    assert tokens == 16 * 11 - 8 * 3
    ratios = collector.sql("SELECT DISTINCT layer FROM samples WHERE run = 'hf-trainer' AND metric = 'spectral.ratio' ORDER BY layer")
    assert [r["layer"] for r in ratios] == [0, 1]
    info = _runs(collector)["hf-trainer"]
    assert (info["family"], info["layers"]) == ("llama", 2)


def test_lightning_callback(collector: Collector, tmp_path: Path) -> None:
    if TYPE_CHECKING:  # a module mypy can take base classes from
        import lightning.pytorch as L
    else:
        L = pytest.importorskip("lightning.pytorch")
    from rankwatch.integrations.lightning import RankwatchCallback
    from rankwatch_testkit.models import NanoGPT, NanoGPTConfig

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = NanoGPT(NanoGPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
            self.seen: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            _, loss = self.model(batch, torch.roll(batch, -1, 1))
            self.seen.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    # A tensor is a map-style dataset (__getitem__, __len__), which torch's types do not say.
    loader = torch.utils.data.DataLoader(cast("Dataset[torch.Tensor]", torch.randint(0, 40, (32, 16))), batch_size=4)
    module = Module()
    callback = RankwatchCallback(run="pl-fit", collector=collector.url, spool_dir=tmp_path / "spool", every={"spectral": 2})
    trainer = L.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(module, loader)
    rows = {r["step"]: r["value"] for r in collector.sql("SELECT step, value FROM samples WHERE run = 'pl-fit' AND metric = 'loss'")}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert [rows[s] for s in sorted(rows)] == pytest.approx(module.seen, rel=1e-6)
    grad = collector.sql("SELECT count(*) AS n FROM samples WHERE run = 'pl-fit' AND metric = 'grad_norm'")[0]["n"]
    assert grad == 5, "the optimizer hook measured ‖g‖ at every step"
    assert _runs(collector)["pl-fit"]["family"] == "nanogpt"


def test_a_model_the_probes_cannot_watch_is_a_warning_inside_a_trainer(tmp_path: Path) -> None:
    """Integrations run inside the job: an unknown layout must not stop `fit`, and turns off only
    the layer probes: the loss and the gradient statistics are still reported."""
    if TYPE_CHECKING:  # a module mypy can take base classes from
        import lightning.pytorch as L
    else:
        L = pytest.importorskip("lightning.pytorch")
    import rankwatch
    from rankwatch.integrations.lightning import RankwatchCallback

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    callback = RankwatchCallback(run="plain", mode="offline", spool_dir=tmp_path / "spool")
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with pytest.warns(rankwatch.RankwatchWarning, match=r"layer probes off \(spectral, activations\)"):
        trainer.fit(Plain(), torch.utils.data.DataLoader(cast("Dataset[torch.Tensor]", torch.randn(12, 4)), batch_size=4))
    assert trainer.global_step == 3
    assert callback.run is not None and callback.run.finished
    assert ("loss", None, None, False) in callback.run.last_values
    assert ("grad_norm", None, None, False) in callback.run.last_values, "the gradient probe needs no layer map"
