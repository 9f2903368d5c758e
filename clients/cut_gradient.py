"""Backward from a gradient that came over the network (the trunk's, at the cut).

``torch.autograd.backward(output, gradient)`` checks the gradient's shape with
``torch.fx``'s symbolic shapes, whose first use imports sympy: 1.9 s of a device's
CPU on its first batch, and a SuperNode starts a fresh ClientApp process for every
message. A scalar root needs no such check, so the gradient enters the graph through
a node of its own instead, bit for bit the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class GradientRoot:
    """A root for the backward from ``output``, whose gradient arrives later.

    Made while ``output`` is at hand; the caller may then drop ``output`` (what was
    sent need not stay in memory) and call :meth:`backward` with the gradient.
    """

    def __init__(self, output: Tensor) -> None:
        self.shape = output.shape
        self.gradient: Tensor | None = None
        self._scalar = _Given.apply(output, self)

    def backward(self, gradient: Tensor, *, plus: Tensor | None = None) -> None:
        """Backpropagate ``gradient`` from the output (and ``plus``, a scalar loss)."""
        if gradient.shape != self.shape:
            raise ValueError(f"a gradient of shape {tuple(gradient.shape)} for an output of "
                             f"shape {tuple(self.shape)}")
        self.gradient = gradient
        (self._scalar if plus is None else self._scalar + plus).backward()
        self.gradient = None


class _Given(torch.autograd.Function):
    """A scalar whose gradient with respect to the output is its root's ``gradient``."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, root: GradientRoot) -> Tensor:  # noqa: D102
        ctx.root = root  # not the output: its memory may go before the backward
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> tuple[Tensor | None, None]:  # noqa: D102
        # A root's incoming gradient is 1 (also when added to a scalar loss): passed on
        # unscaled, the given tensor arrives bit for bit.
        return ctx.root.gradient, None
