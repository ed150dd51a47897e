"""One rank of tests/test_hf_trainer.py, launched by torchrun: a tiny Llama trained by the
Hugging Face Trainer (DDP through Accelerate, gloo on CPU) with gradient accumulation 2 and the
rankwatch callback, after the same training without it (the twin). Writes whether the twins
ended with identical parameters, what the callback reported at every step and the Trainer's
own log.

argv: out_dir, "items" (the model gets `num_items_in_batch`, labels partly ignored) or "mean"
(the Trainer's older per-micro-batch mean loss).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import cast

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rankwatch.integrations.transformers import RankwatchCallback  # noqa: E402


class Recording(RankwatchCallback):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.steps: dict[int, dict[str, float]] = {}

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        super().on_step_end(args, state, control, **kwargs)
        assert self.run is not None
        self.steps[state.global_step] = {k[0]: v for k, v in self.run.last_values.items() if k[1] is None and k[2] is None}
        self.run.last_values.clear()


def tiny_llama(ragged: bool) -> tuple[transformers.LlamaConfig, list[dict[str, torch.Tensor]]]:
    """A 2-layer Llama config and 64 rows of 12 random tokens; `ragged`: a third of the rows
    have their first labels ignored, so rows differ in token count and weighting matters."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    gen = torch.Generator().manual_seed(7)
    data = []
    for i in range(64):
        ids = torch.randint(0, 64, (12,), generator=gen)
        labels = ids.clone()
        if ragged and i % 3 == 0:
            labels[: 2 + i % 5] = -100
        data.append({"input_ids": ids, "labels": labels})
    return config, data


def main() -> None:
    out, variant = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    config, data = tiny_llama(ragged=variant == "items")
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"), max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=1e-3,
        ddp_backend="gloo", dataloader_drop_last=True,
    )

    def train(callbacks: list[transformers.TrainerCallback]) -> transformers.Trainer:
        torch.manual_seed(0)
        trainer = transformers.Trainer(model=transformers.LlamaForCausalLM(config), args=args, train_dataset=data, callbacks=callbacks)
        if variant == "mean":
            trainer.model_accepts_loss_kwargs = False
        trainer.train()
        return trainer

    plain = {k: v.detach().clone() for k, v in cast(torch.nn.Module, train([]).model).state_dict().items()}
    callback = Recording(run=f"hf-{variant}", mode="offline", spool_dir=out / "spool", every={"grad": 1, "sketch": 1, "dot": 1, "spectral": 1, "activations": 1})
    trainer = train([callback])
    equal = all(torch.equal(plain[k], v) for k, v in cast(torch.nn.Module, trainer.model).state_dict().items())
    assert callback.run is not None
    logged = {h["step"]: {"loss": h["loss"], "grad_norm": h["grad_norm"]} for h in trainer.state.log_history if "loss" in h}
    (out / f"rank-{rank}.json").write_text(json.dumps({"equal": equal, "steps": callback.steps, "trainer": logged, "world": callback.run.world_size, "run": callback.run.id}))


if __name__ == "__main__":
    main()
