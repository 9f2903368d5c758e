"""PyTorch's SGD update for a device, without building a ``torch.optim.Optimizer``.

The first ``torch.optim.Optimizer`` a process builds imports ``torch._dynamo``
(its methods are wrapped to keep the compiler out): 2.9 s in a fresh process on a
2-core host, against 0.5 ms for every later one. Flower's Deployment Engine starts
a fresh ClientApp process for every message, so a device paid it every round.
:class:`DeviceSGD` keeps the momentum buffers itself and steps through
``torch.optim.sgd.sgd``, the function ``torch.optim.SGD.step`` calls, with the
same arguments: the same update, bit for bit (the unit tests compare them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.optim.sgd import sgd


class DeviceSGD:
    """SGD with momentum and weight decay over ``params`` (one parameter group).

    Parameters
    ----------
    params : Iterable[Tensor]
        The trained parameters.
    lr, momentum, weight_decay : float
        As for ``torch.optim.SGD`` (no dampening, no Nesterov).
    """

    def __init__(self, params: Iterable[Tensor], *, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        #: Per parameter, its ``momentum_buffer`` (as ``torch.optim.SGD.state``).
        self.state: dict[Tensor, dict[str, Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every parameter's gradient."""
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of the parameters that have a gradient."""
        params = [p for p in self.params if p.grad is not None]
        grads = [p.grad for p in params]
        buffers = [self.state.get(p, {}).get("momentum_buffer") for p in params]
        sgd(params, grads, buffers, weight_decay=self.weight_decay, momentum=self.momentum,
            lr=self.lr, dampening=0.0, nesterov=False, maximize=False,
            has_sparse_grad=any(g.is_sparse for g in grads))
        if self.momentum != 0:
            for p, buffer in zip(params, buffers, strict=True):
                self.state[p] = {"momentum_buffer": buffer}
