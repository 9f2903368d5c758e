"""Centralised evaluation of a whole model on held-out data."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


@torch.no_grad()
def evaluate_model(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
    channels_last: bool = False, device: torch.device | None = None,
) -> tuple[float, float, int]:
    """Evaluate a whole model (centralised evaluation).

    Parameters
    ----------
    model : nn.Module
        The model; for ``channels_last``, with its weights already channels-last
        (``model.to(memory_format=torch.channels_last)``), or the inputs' layout
        gains nothing.
    batches : Iterable[tuple[torch.Tensor, torch.Tensor]]
        Inputs and labels.
    channels_last : bool, optional
        Give the model 4-D inputs channels-last (the same numbers in another
        memory order, which oneDNN's convolutions run faster on).
    device : torch.device, optional
        Evaluate there (the model is moved, each batch is copied); None: where the
        model is, with the batches as they come.

    Returns
    -------
    tuple[float, float, int]
        Mean cross-entropy, accuracy and number of examples.
    """
    model.eval()
    if device is not None:
        model.to(device)
    examples = correct = 0
    loss_sum = 0.0
    for inputs, labels in batches:
        if device is not None:
            inputs = inputs.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
        if channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        logits = model(inputs)
        loss_sum += float(nn.functional.cross_entropy(logits, labels, reduction="sum"))
        correct += int((logits.argmax(dim=1) == labels).sum())
        examples += len(labels)
    return loss_sum / max(examples, 1), correct / max(examples, 1), examples


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS keeps one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the block on ``count`` intra-op threads, then restore the process's setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
