"""The client's training step as an ExecuTorch program: what a device without Python PyTorch runs.

:func:`export_client_step` exports the stages ``[0, cut)`` as one training method of an
ExecuTorch program (the ``.pte`` bytes an Android or iOS app loads): given a batch and the
gradient the trunk returned for the activations at the cut, it returns those activations
and the gradients of the client's weights. The loss it differentiates is the surrogate
``<output, gradient>``, whose weight gradients are exactly the vector-Jacobian product the
split step needs; ExecuTorch's training export turns it into a joint forward-backward graph.

ExecuTorch 1.5.1's portable ``max_pool2d_with_indices_backward`` kernel accumulates into its
output without zeroing it first, and memory planning hands it a reused buffer: the stray
values in its result are the pooled maxima of the forward output it reuses, so a bottom with
``MaxPool2d`` got wrong gradients (the joint graph itself, run by PyTorch, is exact). The
program computes that op instead as zeros plus ``scatter_add`` of the gradient at the
indices, which the runtime gets right.

:class:`ExecuTorchClientStep` runs the program through ExecuTorch's runtime with ExecuTorch's
own SGD. The program has the batch's shape. Per batch it runs once with a zero gradient to
get the activations (nothing is stepped), then, with the trunk's gradient, again and steps:
one extra forward per batch, as activation recomputation costs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from splitlearn.models import SplittableModel
from splitlearn.split import split

#: The program's method.
METHOD = "forward"


class _SurrogateStep(nn.Module):
    """Forward to the cut; the loss ``<output, gradient>`` (its weight gradients: the VJP)."""

    def __init__(self, bottom: nn.Module) -> None:
        super().__init__()
        self.bottom = bottom

    def forward(self, x: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
        out = self.bottom(x)
        return (out * grad_out).sum(), out.detach()


def _max_pool_backward(grad: Tensor, x: Tensor, kernel: Any, stride: Any, padding: Any,
                       dilation: Any, ceil_mode: bool, indices: Tensor) -> Tensor:
    """``max_pool2d_with_indices_backward`` as zeros + scatter-add (indices index each plane)."""
    n, c = x.shape[:2]
    flat = torch.zeros(n, c, x.shape[-2] * x.shape[-1], dtype=grad.dtype)
    return flat.scatter_add(2, indices.reshape(n, c, -1), grad.reshape(n, c, -1)).reshape(x.shape)


@dataclass(frozen=True)
class ExportedStep:
    """An exported client step: the program and the shapes it was exported for."""

    program: bytes  # the ExecuTorch program (.pte)
    input_shape: tuple[int, ...]  # a batch of inputs
    output_shape: tuple[int, ...]  # the activations at the cut (and their gradient)


def export_client_step(model: SplittableModel, cut: int, *, batch_size: int) -> ExportedStep:
    """Export the stages ``[0, cut)`` of ``model`` (its current weights) as a training program.

    Parameters
    ----------
    model : SplittableModel
        The network; not modified.
    cut : int
        Stages ``[0, cut)`` are the device's.
    batch_size : int
        Rows per batch (the program's shapes are static).

    Returns
    -------
    ExportedStep
        The ExecuTorch program (``.pte`` bytes) and its shapes.
    """
    from executorch.exir import to_edge
    from torch.export.experimental import _export_forward_backward

    bottom, _ = split(copy.deepcopy(model), cut)
    x = torch.zeros(batch_size, *model.input_shape)
    grad_out = torch.zeros(batch_size, *model.cut_shape(cut))
    exported = torch.export.export(_SurrogateStep(bottom), (x, grad_out), strict=False)
    joint = _export_forward_backward(exported).run_decompositions(
        {torch.ops.aten.max_pool2d_with_indices_backward.default: _max_pool_backward})
    program = to_edge(joint).to_executorch().buffer
    return ExportedStep(program, tuple(x.shape), tuple(grad_out.shape))


class ExecuTorchClientStep:
    """The device's side of split training, run by ExecuTorch's runtime.

    Parameters
    ----------
    step : ExportedStep
        What :func:`export_client_step` returned.
    lr, momentum, weight_decay : float
        SGD settings (ExecuTorch's SGD, as the device's optimiser).
    """

    def __init__(self, step: ExportedStep, *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        from executorch.extension.training import (
            _load_for_executorch_for_training_from_buffer,
            get_sgd_optimizer,
        )

        self.step = step  # the module reads from its buffer: it must outlive the module
        self._module = _load_for_executorch_for_training_from_buffer(step.program)
        self._sgd = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        self._get_sgd_optimizer = get_sgd_optimizer
        self._optimizer: Any = None

    def activations(self, x: Tensor) -> Tensor:
        """Return the activations at the cut for batch ``x`` (the weights do not change)."""
        return self._run(x, None)

    def train(self, x: Tensor, grad_out: Tensor) -> Tensor:
        """Backpropagate the trunk's ``grad_out`` for batch ``x`` and take an SGD step."""
        out = self._run(x, grad_out)
        if self._optimizer is None:  # the parameters exist once the method has run
            self._optimizer = self._get_sgd_optimizer(self._module.named_parameters(),
                                                      **self._sgd)
        self._optimizer.step(self._module.named_gradients())
        return out

    def state_dict(self) -> dict[str, Tensor]:
        """Return a copy of the device's weights, keyed as the split model's stages are."""
        prefix = "bottom."
        return {name.removeprefix(prefix): value.detach().clone()
                for name, value in self._module.named_parameters().items()}

    def _run(self, x: Tensor, grad_out: Tensor | None) -> Tensor:
        if tuple(x.shape) != self.step.input_shape:
            raise ValueError(f"the program takes batches of shape {self.step.input_shape}, "
                             f"got {tuple(x.shape)}")
        if grad_out is None:
            grad_out = torch.zeros(self.step.output_shape)
        _, out = self._module.forward_backward(METHOD, (x.contiguous(), grad_out.contiguous()))
        return out
