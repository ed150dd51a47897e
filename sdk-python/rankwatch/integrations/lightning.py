"""A Lightning `Callback` that attaches rankwatch to `Trainer.fit`.

    trainer = L.Trainer(..., callbacks=[RankwatchCallback(run="pl-7")])

On `on_train_start` (after Lightning wrapped the module for its strategy) it initialises
rankwatch on every process, watches the wrapped model — under the DDP strategy that is the
`DistributedDataParallel` instance, so the gradient hook is installed before the first
backward — and logs, once per optimizer step, the mean of the losses `training_step` returned
on this rank over that step's micro-batches (`accumulate_grad_batches`). Under the `16-mixed`
precision plugin its `GradScaler` is handed to the gradient probe, so norms are unscaled and
overflow steps are reported as `amp_skipped`. Lightning's FSDP strategy is not watched yet (the
gradient and spectral probes would read shards as whole tensors): the callback warns and logs
the loss only.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError:  # the older package name
    import pytorch_lightning as pl  # type: ignore[no-redef]

from ..run import Run
from ..settings import init


class RankwatchCallback(pl.Callback):
    def __init__(self, module_attr: str | None = None, **init_kwargs: Any) -> None:
        """`module_attr` names the attribute of the LightningModule that holds the
        transformer (default: the module itself if rankwatch recognises it, else `.model`)."""
        self.module_attr = module_attr
        self.init_kwargs = init_kwargs
        self.run: Run | None = None
        self._loss_sum: Any = None
        self._batches = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.run is None or self.run.finished:  # a second fit() gets a run of its own
            kwargs = dict(self.init_kwargs)
            kwargs.setdefault("rank", trainer.global_rank)
            kwargs.setdefault("world_size", trainer.world_size)
            self.run = init(**kwargs)
        import torch

        from ..discovery import DiscoveryError, discover

        if self.module_attr is not None:
            target = getattr(pl_module, self.module_attr)
        else:
            # The common shape is a LightningModule holding the network as `.model`; a
            # recognised family there beats the generic fallback on the container.
            target = pl_module
            inner = getattr(pl_module, "model", None)
            if isinstance(inner, torch.nn.Module):
                try:
                    discover(inner)
                    target = inner
                except DiscoveryError:
                    pass
        wrapper = getattr(trainer.strategy, "model", None)
        ddp = wrapper if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel) else None
        optimizers = trainer.optimizers
        precision = getattr(trainer.strategy, "precision_plugin", None)
        scaler = getattr(precision, "scaler", None)
        self.run.watch_or_warn(target, optimizers[0] if optimizers else None, ddp=ddp, scaler=scaler)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.run is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        # Lightning hands on the loss divided by accumulate_grad_batches (what it backpropagates).
        loss = loss.detach() * getattr(trainer, "accumulate_grad_batches", 1)
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._batches += 1
        accumulating = getattr(trainer.fit_loop.epoch_loop, "_should_accumulate", None)
        if callable(accumulating) and accumulating():
            return  # more micro-batches of this optimizer step to come
        self.run.log(trainer.global_step, loss=self._loss_sum / self._batches)
        self._loss_sum, self._batches = None, 0

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.run is not None:
            self.run.finish()
