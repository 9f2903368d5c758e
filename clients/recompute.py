"""Activation recomputation for the device's stages (PyTorch's "activation checkpointing").

Not to be confused with a run's checkpoints (:mod:`server.checkpoint`), which save the
weights after every round.

With recomputation, each stage runs under
:func:`torch.utils.checkpoint.checkpoint` (non-reentrant): the forward keeps only
the stage's input, and the stage is run again during backward to rebuild what
its backward needs. The last stage, whose output is the smashed data, is
recomputed too when the step lets go of that output once it is sent
(``recompute_output``; the split steps do, see
:class:`clients.steps.split.SplitStep`): then the device holds the
stage inputs and the output until the exchange, and afterwards the inputs plus
one stage's saved tensors at a time. Otherwise the last stage runs plain: its
backward comes first, while every boundary and the output are still held, so
rebuilding it could not lower the peak. The step puts a
:class:`splitlearn.models.lean.MaskReLU` at the cut, so that the last stage's
rebuild keeps a one-byte mask, not a second copy of the output
(:func:`splitlearn.calibration.client_train_memory_bytes` models the bytes).

Running a stage twice would update BatchNorm running statistics twice (and count
the batch twice in ``num_batches_tracked``). PyTorch lets the caller give
a context for the recomputation; the one here snapshots the stage's buffers
before it and copies them back after, so buffers end up exactly as after one
plain forward. Dropout masks match because PyTorch restores the RNG state
for the recomputation (``preserve_rng_state``, on by default).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

#: Makes a context entered around each recomputation (e.g. a meter's ``observing``).
RecomputeContext = Callable[[], AbstractContextManager[None]]


def run_stages(
    stages: Iterable[nn.Module],
    x: Tensor,
    *,
    recompute: bool,
    recompute_output: bool = False,
    recompute_context: RecomputeContext = nullcontext,
) -> Tensor:
    """Run ``stages`` in order, each recomputed in backward when asked and grad is on.

    Parameters
    ----------
    stages : Iterable[nn.Module]
        Consecutive stages, e.g. the device's ``model.stages[:cut]``.
    x : Tensor
        The first stage's input.
    recompute : bool
        Recompute every stage but the last. Ignored when gradients are off
        (evaluation), where nothing is saved anyway.
    recompute_output : bool, optional
        With ``recompute``, recompute the last stage too: for a caller that
        drops the output once it is sent, before the backward.
    recompute_context : RecomputeContext, optional
        Called at each stage's forward; the context it returns is entered
        around that stage's recomputation, inside PyTorch's own hooks.

    Returns
    -------
    Tensor
        The last stage's output.
    """
    recompute = recompute and torch.is_grad_enabled()
    stages = list(stages)
    recomputed = len(stages) if recompute_output else len(stages) - 1
    for index, stage in enumerate(stages):
        # Unless the caller frees the output before the backward, the last stage runs
        # plain: its backward comes first, while every boundary is still held, so
        # rebuilding it would only add recomputation without lowering the peak.
        if recompute and index < recomputed:
            contexts = partial(_contexts, stage, recompute_context)
            x = torch_checkpoint(stage, x, use_reentrant=False, context_fn=contexts)
        else:
            x = stage(x)
    return x


def _contexts(
    stage: nn.Module, recompute_context: RecomputeContext
) -> tuple[AbstractContextManager[None], AbstractContextManager[None]]:
    """PyTorch's ``context_fn``: nothing around the forward, buffers kept around the rerun."""
    return nullcontext(), _recomputing(stage, recompute_context())


@contextmanager
def _recomputing(stage: nn.Module, inner: AbstractContextManager[None]) -> Iterator[None]:
    """Leave ``stage``'s buffers as the forward left them, whatever the rerun does."""
    buffers = list(stage.buffers())
    before = [b.detach().clone() for b in buffers]
    try:
        with inner:
            yield
    finally:
        # Also on early stop: PyTorch ends the rerun with an exception
        # once it has every tensor it needs.
        with torch.no_grad():
            for buffer, value in zip(buffers, before, strict=True):
                buffer.copy_(value)
