"""This rank's own loss for one optimizer step, captured without the training script's help.

Two sources, shared by the Hugging Face callback and the zero-code agent (`rankwatch run`,
`rankwatch attach`):

- `TokenLoss`, a forward hook on the model: the output's `.loss` (Hugging Face models), made
  token-weighted over the micro-batches of an optimizer step. A model's loss is a mean over its
  micro-batch's tokens, or, when the Trainer passes `num_items_in_batch` (gradient accumulation
  done right), a sum over them divided by that number: either way the hook recovers the sum of
  token losses and divides by the tokens this rank saw.
- `BackwardLoss`, for any other loop: the sum of the scalars `backward()` was called on since
  the last optimizer step. Scripts that accumulate divide each micro-batch's loss by the number
  of micro-batches (their gradients need it), so the sum is the step's mean loss; without
  accumulation it is the one loss. A `GradScaler`'s scaling is undone: the scalar handed to
  `scaler.scale` stands for the scaled one that is backpropagated.

Both only detach and add tensors on the device: nothing here reads a value on the host.
"""

from __future__ import annotations

from typing import Any

import torch


def predicted_tokens(module: Any, labels: torch.Tensor) -> torch.Tensor:
    # Causal LMs shift labels inside the model: position t predicts label t+1.
    if type(module).__name__.endswith("ForCausalLM"):
        labels = labels[..., 1:]
    return (labels != -100).sum()


class TokenLoss:
    """Forward hook (`register_forward_hook(capture, with_kwargs=True)`) summing token losses."""

    def __init__(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None
        self.seen = False  # whether any forward returned a `.loss`

    def capture(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not torch.is_grad_enabled():
            return
        self.seen = True
        labels = kwargs.get("labels")
        tokens = predicted_tokens(module, labels) if isinstance(labels, torch.Tensor) else torch.ones((), dtype=torch.int64, device=loss.device)
        items = kwargs.get("num_items_in_batch")
        loss = loss.detach().double().reshape(())
        if items is not None:
            # loss = Σ token losses / num_items_in_batch: undo the division.
            total = loss * (items.to(loss.device, torch.float64) if isinstance(items, torch.Tensor) else float(items))
        else:
            total = loss * tokens
        self._loss_sum = total if self._loss_sum is None else self._loss_sum + total
        self._tokens = tokens if self._tokens is None else self._tokens + tokens

    def take(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(mean token loss, tokens) over the forwards since the last take; None if none."""
        if self._loss_sum is None or self._tokens is None:
            return None
        step = (self._loss_sum / self._tokens.clamp_min(1), self._tokens)
        self._loss_sum = self._tokens = None
        return step


class BackwardLoss:
    """The sum of the scalars backpropagated since the last `take`, unscaled."""

    def __init__(self) -> None:
        self._sum: torch.Tensor | None = None
        self._scaled: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scaled, unscaled), this step

    def scaled(self, unscaled: Any, result: Any) -> None:
        """`GradScaler.scale(unscaled)` returned `result`."""
        if isinstance(unscaled, torch.Tensor) and isinstance(result, torch.Tensor) and unscaled.numel() == 1:
            self._scaled.append((result, unscaled.detach()))
            del self._scaled[:-4]  # only the latest few can still be backpropagated

    def backward(self, tensors: Any) -> None:
        """`torch.autograd.backward(tensors, ...)` is about to run."""
        if isinstance(tensors, (tuple, list)):
            if len(tensors) != 1:
                return
            tensors = tensors[0]
        if not isinstance(tensors, torch.Tensor) or tensors.numel() != 1 or not tensors.is_floating_point():
            return
        value = next((unscaled for scaled, unscaled in self._scaled if scaled is tensors), None)
        value = (tensors.detach() if value is None else value).double().reshape(())
        self._sum = value if self._sum is None else self._sum + value

    def take(self) -> torch.Tensor | None:
        total, self._sum = self._sum, None
        self._scaled = []
        return total
