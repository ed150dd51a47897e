"""One rank of test_attach.py's framework checks, launched by torchrun: the same training run
twice in one process, once with rankwatch's callback and once watched by the zero-code agent
(`rankwatch.auto.agent`, what `rankwatch run` starts), and what each reported at every step.

argv: out_dir, "hf" (a tiny Llama under the Hugging Face Trainer, DDP through Accelerate,
gradient accumulation 2, `num_items_in_batch`) or "lightning" (a LightningModule under the
DDP strategy, accumulate_grad_batches 2).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rankwatch.auto import agent as auto  # noqa: E402

EVERY = {"grad": 1, "sketch": 1, "dot": 1, "spectral": 1, "activations": 1}
TOP_LEVEL = ("loss", "tokens", "grad_norm", "grad_norm_mean", "cos_to_mean", "nonfinite")


def _scalars(run: Any) -> dict[str, float]:
    values = {k[0]: v for k, v in run.last_values.items() if k[1] is None and k[2] is None and k[0] in TOP_LEVEL}
    run.last_values.clear()
    return values


def twice(out: Path, callback_class: Any, train: Any, record: Any, steps: dict[str, dict[int, dict[str, float]]]) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """`train` with rankwatch's callback (the recorder after it: it logs in the same hook), then
    again under the zero-code agent; what each reported per step."""
    callback = callback_class(run="fw-callback", mode="offline", spool_dir=out / "spool", every=EVERY)
    train([callback, record("callback", lambda: callback.run)])
    agent = auto.start(auto.Settings(run="fw-auto", mode="offline", spool_dir=str(out / "spool"), every=EVERY))
    train([record("auto", lambda: agent.run)])
    agent.uninstall()
    return steps["callback"], steps["auto"]


def hf(out: Path) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    import transformers

    from rankwatch.integrations.transformers import RankwatchCallback

    from hf_trainer_worker import tiny_llama

    config, data = tiny_llama(ragged=True)
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"), max_steps=5, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=1e-3,
        ddp_backend="gloo", dataloader_drop_last=True,
    )  # fmt: skip
    steps: dict[str, dict[int, dict[str, float]]] = {"callback": {}, "auto": {}}

    class Record(transformers.TrainerCallback):
        def __init__(self, key: str, run_of: Any) -> None:
            self.key, self.run_of = key, run_of

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            run = self.run_of()
            values = _scalars(run) if run is not None else None
            if values:
                steps[self.key][state.global_step] = values

    def train(callbacks: list[transformers.TrainerCallback]) -> None:
        torch.manual_seed(0)
        trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()

    return twice(out, RankwatchCallback, train, Record, steps)


def lightning(out: Path) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    import lightning.pytorch as pl

    from rankwatch.integrations.lightning import RankwatchCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            import transformers

            config = transformers.GPT2Config(vocab_size=64, bos_token_id=0, eos_token_id=0, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            self.model = transformers.GPT2LMHeadModel(config)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(3)
    data = [torch.randint(0, 64, (12,), generator=gen) for _ in range(64)]
    steps: dict[str, dict[int, dict[str, float]]] = {"callback": {}, "auto": {}}

    class Record(pl.Callback):
        def __init__(self, key: str, run_of: Any) -> None:
            self.key, self.run_of = key, run_of

        def on_train_batch_end(self, trainer, module, outputs, batch, index):  # type: ignore[no-untyped-def]
            run = self.run_of()
            if run is None or trainer.fit_loop.epoch_loop._should_accumulate():
                return
            values = _scalars(run)
            if values:
                steps[self.key][trainer.global_step] = values

    def train(callbacks: list[pl.Callback]) -> None:
        torch.manual_seed(0)
        trainer = pl.Trainer(
            max_steps=5, accumulate_grad_batches=2, accelerator="cpu", devices=2, strategy="ddp", callbacks=callbacks,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(Module(), torch.utils.data.DataLoader(cast("Dataset[torch.Tensor]", data), batch_size=2))

    return twice(out, RankwatchCallback, train, Record, steps)


def main() -> None:
    out, framework = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    with_callback, with_agent = {"hf": hf, "lightning": lightning}[framework](out)
    rank = os.environ["RANK"]
    (out / f"rank-{rank}.json").write_text(json.dumps({"callback": with_callback, "auto": with_agent}))


if __name__ == "__main__":
    main()
