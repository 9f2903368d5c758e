"""Centralised evaluation of a whole model on held-out data."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


@torch.no_grad()
def evaluate_model(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[float, float, int]:
    """Evaluate a whole model (centralised evaluation).

    Returns
    -------
    tuple[float, float, int]
        Mean cross-entropy, accuracy and number of examples.
    """
    model.eval()
    examples = correct = 0
    loss_sum = 0.0
    for inputs, labels in batches:
        logits = model(inputs)
        loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(dim=1) == labels).sum())
        examples += len(labels)
    return loss_sum / max(examples, 1), correct / max(examples, 1), examples
