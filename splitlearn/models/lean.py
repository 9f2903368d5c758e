"""A ReLU that keeps one byte per element for its backward, for the stage at the cut.

``nn.ReLU`` saves its output for backward. Inside a network that costs nothing
extra, because the next layer (a conv) saves the same tensor anyway; at the cut
there is no next layer on the device, and the saved output *is* the smashed
data, so the device cannot let go of it after sending it. :class:`MaskReLU`
computes the same function and the same gradient (``grad`` where the output is
positive, 0 elsewhere, as ``threshold_backward`` does) but saves the boolean
mask ``output > 0`` instead: a quarter of the bytes, and the float output is
free to go once it is on the wire.

:func:`mask_cut_relu` puts one in place of the ReLU whose output is a stage's
output, if there is one; :func:`lean_stage_costs` profiles every stage as if
its trailing ReLU were masked (what :mod:`splitlearn.calibration` needs for the
stage at the cut).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from splitlearn.models.base import SplittableModel, StageCost, _eval_mode


class _MaskReLUFunction(torch.autograd.Function):
    """``relu`` whose backward needs only the sign pattern of its output."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = x.clamp_min(0)
        ctx.save_for_backward(out > 0)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (mask,) = ctx.saved_tensors
        return grad * mask


class MaskReLU(nn.ReLU):
    """``nn.ReLU`` (not in place) that saves a bool mask for backward, not its output.

    Outputs and gradients are exactly those of ``nn.ReLU``; only what autograd
    keeps differs (1 byte per element instead of the output's 4).
    """

    def __init__(self) -> None:
        super().__init__(inplace=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply ReLU; with gradients on, save ``output > 0`` for backward."""
        if not torch.is_grad_enabled() or not x.requires_grad:
            return torch.relu(x)
        return _MaskReLUFunction.apply(x)


def mask_cut_relu(model: SplittableModel, cut: int) -> bool:
    """Replace the ReLU that produces stage ``cut - 1``'s output by a :class:`MaskReLU`.

    The stage is found by one probe forward (eval mode, no gradients): the
    ReLU module whose output tensor is the stage's output, if any. The swap
    keeps the state dict (ReLU has no parameters) and the function.

    Parameters
    ----------
    model : SplittableModel
        Modified in place.
    cut : int
        A valid cut, or ``model.num_stages`` for the last stage.

    Returns
    -------
    bool
        Whether a ReLU was replaced (False when the stage does not end in one,
        or it already is a :class:`MaskReLU`).
    """
    index = cut - 1
    if not 0 <= index < model.num_stages:
        raise ValueError(f"cut must be in 1..{model.num_stages}, got {cut!r}")
    x = model._probe_input()
    with torch.no_grad(), _eval_mode(model):
        for stage in model.stages[:index]:
            x = stage(x)
        relu = _trailing_relu(model.stages[index], x)
    if relu is None or isinstance(relu, MaskReLU):
        return False
    if relu is model.stages[index]:
        model.stages[index] = MaskReLU()
        return True
    return _replace(model.stages[index], relu, MaskReLU())


def lean_stage_costs(model: SplittableModel) -> list[StageCost]:
    """Stage costs with every stage's trailing ReLU masked (each stage as the cut's)."""
    lean = copy.deepcopy(model)
    for cut in range(1, lean.num_stages + 1):
        mask_cut_relu(lean, cut)
    return lean.stage_costs()


def _trailing_relu(stage: nn.Module, x: Tensor) -> nn.ReLU | None:
    """Find the non-in-place ReLU leaf whose output is ``stage(x)`` (None if none)."""
    # Keyed by the output's id; the tensors are kept alive so that no id is reused.
    outputs: dict[int, tuple[nn.ReLU, Tensor]] = {}

    def record(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        # An in-place ReLU returns its input's storage: its saved output is the
        # previous layer's, which a mask would not free.
        if isinstance(module, nn.ReLU) and not module.inplace and isinstance(out, Tensor):
            outputs[id(out)] = (module, out)

    relus = [m for m in stage.modules() if isinstance(m, nn.ReLU) and not list(m.children())]
    handles = [m.register_forward_hook(record) for m in relus]
    try:
        out = stage(x)
    finally:
        for handle in handles:
            handle.remove()
    found = outputs.get(id(out))
    return None if found is None else found[0]


def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> bool:
    """Put ``new`` wherever ``old`` is a child inside ``root`` (or is ``root``'s child)."""
    replaced = False
    for parent in root.modules():
        for name, child in list(parent.named_children()):
            if child is old:
                setattr(parent, name, new)
                replaced = True
    return replaced
