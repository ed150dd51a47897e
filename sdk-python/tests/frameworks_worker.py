"""One rank of tests/test_frameworks.py, launched by torchrun (2 gloo ranks, CPU).

accelerate: Accelerate's own loop (`accelerator.prepare`, `accelerator.accumulate` with 2
micro-batches, `accelerator.backward`), trained twice: unwatched, with a read-only optimizer
pre-hook recording the norm of the averaged gradient each optimizer step sees, and watched with
every probe on. lightning: `Trainer(strategy="ddp")` with `accumulate_grad_batches=2` and the
rankwatch callback; the module records the averaged gradient's norm in
`on_before_optimizer_step` and the losses `training_step` returned; an unwatched fit first is
its twin.
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

import rankwatch  # noqa: E402
from rankwatch_testkit.models import NanoGPT, NanoGPTConfig  # noqa: E402

CONFIG = NanoGPTConfig(block_size=16, vocab_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0)


def grad_norm(params: Any) -> float:
    return float(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).double().norm())


def accelerate_job(out: Path, watched: bool) -> dict[str, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = NanoGPT(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.3)
    data = torch.utils.data.DataLoader(cast("Dataset[torch.Tensor]", torch.randint(0, 40, (64, 16), generator=torch.Generator().manual_seed(3))), batch_size=4)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    seen: list[float] = []
    run = None
    if watched:
        run = rankwatch.init(run="accelerate-loop", mode="offline", spool_dir=out / "spool", every={"grad": 1, "sketch": 1, "dot": 1, "activations": 1, "spectral": 1})
        run.watch(model, optimizer)
    else:
        optimizer.optimizer.register_step_pre_hook(lambda opt, *_: seen.append(grad_norm(p for g in opt.param_groups for p in g["params"])))
    reported: list[dict[str, float]] = []
    step = 0
    for x in data:
        with accelerator.accumulate(model):
            _, loss = model(x, torch.roll(x, -1, 1))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            if run is not None:
                run.log(step, loss=loss.detach())
                reported.append({k[0]: v for k, v in run.last_values.items() if k[1] is None and k[2] is None})
                run.last_values.clear()
            step += 1
    if run is not None:
        run.finish(timeout=5)
    params = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    return {"params": params, "seen": seen, "reported": reported}


def lightning_job(out: Path, watched: bool = True) -> dict[str, Any]:
    import lightning.pytorch as L

    from rankwatch.integrations.lightning import RankwatchCallback

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = NanoGPT(CONFIG)
            self.losses: list[float] = []
            self.averaged: list[float] = []

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            _, loss = self.model(batch, torch.roll(batch, -1, 1))
            self.losses.append(float(loss))
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.averaged.append(grad_norm(self.parameters()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(cast("Dataset[torch.Tensor]", torch.randint(0, 40, (32, 16), generator=torch.Generator().manual_seed(3))), batch_size=4)
    module = Module()
    if not watched:
        plain = L.Trainer(
            max_steps=3, accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        plain.fit(module, data)
        return {"params": {k: v.detach().clone() for k, v in module.state_dict().items()}}
    callback = RankwatchCallback(run="pl-ddp", mode="offline", spool_dir=out / "spool", every={"spectral": 2, "dot": 1})
    recorded: list[dict[str, float]] = []
    original = callback.run

    class Recorder(L.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            run = callback.run
            if run is not None and run.last_values:
                recorded.append({"step": trainer.global_step, **{k[0]: v for k, v in run.last_values.items() if k[1] is None and k[2] is None}})
                run.last_values.clear()

    assert original is None
    trainer = L.Trainer(
        max_steps=3, accelerator="cpu", devices=2, strategy="ddp", accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[callback, Recorder()],
    )
    trainer.fit(module, data)
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return {"reported": recorded, "losses": module.losses, "averaged": module.averaged, "run": callback.run.id if callback.run else None, "params": params}


def main() -> None:
    kind, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    if kind == "accelerate":
        plain = accelerate_job(out, watched=False)
        watched = accelerate_job(out, watched=True)
        equal = all(torch.equal(plain["params"][k], watched["params"][k]) for k in plain["params"])
        result = {"equal": equal, "seen": plain["seen"], "reported": watched["reported"]}
    else:
        plain = lightning_job(out, watched=False)["params"]
        result = lightning_job(out)
        watched = result.pop("params")
        result["equal"] = all(torch.equal(plain[k], watched[k]) for k in plain)
    (out / f"{kind}-{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
