"""A Hugging Face `TrainerCallback` that attaches rankwatch to `Trainer`.

    trainer = Trainer(model=model, args=args, ..., callbacks=[RankwatchCallback(run="ft-7")])

The callback calls `rankwatch.init` on every process when training begins and `watch`es the
model the Trainer trains. The Trainer hands callbacks the unwrapped model; the gradient probe
finds the DistributedDataParallel wrapper Accelerate made around it on the first backward, so
under DDP each rank reports its own gradient before the all-reduce, the averaged gradient and
the exact cosine between them. With fp16 the Accelerate optimizer's `GradScaler` is passed on,
so gradient norms are unscaled and overflow steps are reported as `amp_skipped`.

The loss it logs is this rank's own token-weighted loss over every micro-batch of the optimizer
step, captured from the model's forward output — not the Trainer's logged loss, which is
averaged over ranks and would hide exactly what rankwatch is for. The model's loss is a mean
over its micro-batch's tokens, or, when the Trainer passes `num_items_in_batch` (gradient
accumulation done right), a sum over them divided by that number: either way the callback
recovers the sum of token losses and divides by the tokens this rank saw. Trainer's own logs
(learning rate, ...) are added as user scalars.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from ..losses import TokenLoss
from ..run import Run
from ..settings import init


class RankwatchCallback(TrainerCallback):
    def __init__(self, **init_kwargs: Any) -> None:
        self.init_kwargs = init_kwargs
        self.run: Run | None = None
        self._loss = TokenLoss()
        self._step_loss: tuple[torch.Tensor, torch.Tensor] | None = None
        self._hook: Any = None
        self._pending_logs: dict[str, float] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        if self.run is None or self.run.finished:  # a second train() gets a run of its own
            self.run = init(**self.init_kwargs)
        if model is not None:
            self._hook = model.register_forward_hook(self._loss.capture, with_kwargs=True)
            # An Accelerate optimizer: watch unwraps it and takes its loss scaler (fp16).
            self.run.watch_or_warn(model, optimizer if isinstance(optimizer, torch.optim.Optimizer) else None)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The micro-batches of this optimizer step are all in: close the step's loss.
        self._step_loss = self._loss.take()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.run is None:
            return
        scalars: dict[str, Any] = dict(self._pending_logs)
        self._pending_logs.clear()
        if self._step_loss is not None:
            scalars["loss"], scalars["tokens"] = self._step_loss
        self._step_loss = None
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
