"""A Hugging Face `TrainerCallback` that attaches rankwatch to `Trainer`.

    trainer = Trainer(model=model, args=args, ..., callbacks=[RankwatchCallback(run="ft-7")])

The callback calls `rankwatch.init` on every process when training begins, `watch`es the model
the Trainer actually trains (its DDP wrapper when distributed, so the gradient hook sees the
pre-reduction gradients), and logs at each optimizer step. The loss it logs is this rank's own
token-weighted loss, captured from the model's forward output (`outputs.loss`, weighted by the
tokens whose label is not -100) — not the Trainer's logged loss, which is already averaged over
ranks and would hide exactly what rankwatch is for. Trainer's own logs (learning rate, ...) are
added as user scalars.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from ..run import Run, init


class RankwatchCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self, **init_kwargs: Any) -> None:
        self.init_kwargs = init_kwargs
        self.run: Run | None = None
        self._loss_sum: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None
        self._hook: Any = None
        self._pending_logs: dict[str, float] = {}

    def _capture(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is None or not torch.is_grad_enabled():
            return
        labels = kwargs.get("labels")
        if isinstance(labels, torch.Tensor):
            # Causal LMs shift labels inside the model: position t predicts label t+1.
            if type(module).__name__.endswith("ForCausalLM"):
                labels = labels[..., 1:]
            tokens = (labels != -100).sum()
        else:
            tokens = torch.tensor(1, device=loss.device)
        weighted = loss.detach().double() * tokens
        self._loss_sum = weighted if self._loss_sum is None else self._loss_sum + weighted
        self._tokens = tokens if self._tokens is None else self._tokens + tokens

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.run is None:
            self.run = init(**self.init_kwargs)
        if model is not None:
            self._hook = model.register_forward_hook(self._capture, with_kwargs=True)
            self.run.watch(model)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        pass

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        scalars: dict[str, Any] = dict(self._pending_logs)
        self._pending_logs.clear()
        if self._loss_sum is not None and self._tokens is not None:
            scalars["loss"] = self._loss_sum / self._tokens.clamp_min(1)
            scalars["tokens"] = self._tokens
        self._loss_sum = self._tokens = None
        self.run.log(state.global_step, **scalars)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        for key, value in (logs or {}).items():
            if key != "loss" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._pending_logs[key.replace(" ", "_")] = float(value)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
        if self.run is not None:
            self.run.finish()
