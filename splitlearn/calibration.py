"""Measure this host's training speed, so the virtual clock can rescale it.

The clock turns measured client compute seconds into device seconds with the
ratio ``host_flops_per_s / device.flops_per_s``. The host figure is measured on
the workload clients actually run (the client-side stages at the configured
cut and batch size), with the same thread count, not taken from a datasheet.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from splitlearn.models import SplittableModel
from splitlearn.split import split

#: Backward costs about twice the forward (gradients w.r.t. inputs and weights).
TRAIN_TO_FORWARD_FLOPS = 3


def client_train_flops_per_sample(model: SplittableModel, cut: int) -> int:
    """Training FLOPs per sample of the client-side stages (forward + backward)."""
    forward = sum(c.flops_per_sample for c in model.stage_costs()[:cut])
    return TRAIN_TO_FORWARD_FLOPS * forward


def client_train_memory_bytes(model: SplittableModel, cut: int, *, batch_size: int) -> int:
    """Estimated training memory of the client side for one batch, in bytes.

    Saved activations for the batch plus parameters, their gradients and one
    SGD momentum buffer (float32).
    """
    costs = model.stage_costs()[:cut]
    activations = sum(c.train_memory_bytes_per_sample for c in costs) * batch_size
    return activations + 3 * 4 * sum(c.params for c in costs)


def measure_host_flops_per_s(
    model: SplittableModel,
    cut: int,
    *,
    batch_size: int,
    threads: int = 1,
    min_seconds: float = 0.3,
) -> float:
    """Sustained training FLOP/s of this host on the client-side stages.

    Parameters
    ----------
    model : SplittableModel
        The model (not modified: a copy of its bottom is trained on noise).
    cut : int
        Client-side stages ``[0, cut)``.
    batch_size : int
        Batch size clients use.
    threads : int
        Intra-op threads, as the clients use.
    min_seconds : float
        Measure at least this long (after one warm-up step).
    """
    import copy

    bottom, _ = split(copy.deepcopy(model), cut)
    inputs = torch.rand(batch_size, *model.input_shape)
    flops_per_step = client_train_flops_per_sample(model, cut) * batch_size
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _train_step(bottom, inputs)  # warm-up: allocator, kernels
        steps, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < min_seconds:
            _train_step(bottom, inputs)
            steps += 1
    finally:
        torch.set_num_threads(previous)
    return flops_per_step * steps / elapsed


def _train_step(bottom: nn.Module, inputs: torch.Tensor) -> None:
    out = bottom(inputs)
    out.backward(torch.ones_like(out))
    bottom.zero_grad(set_to_none=True)
