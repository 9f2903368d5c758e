"""PyTorch's SGD update without building a ``torch.optim.Optimizer``.

The first ``torch.optim.Optimizer`` a process builds imports ``torch._dynamo``
(its methods are wrapped to keep the compiler out): 2.9 s in a fresh process on a
2-core host, against 0.5 ms for every later one. Flower's Deployment Engine starts
a fresh ClientApp process for every message, so a device paid it every round; the
server paid it once per run and once per trunk worker process. Both sides step with it.
:class:`LightSGD` keeps the momentum buffers itself and steps through
``torch.optim.sgd.sgd``, the function ``torch.optim.SGD.step`` calls, with the
same arguments: the same update, bit for bit (the unit tests compare them). Its
state dict has ``torch.optim.SGD``'s format, so either loads the other's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim.sgd import sgd


class LightSGD:
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

    def state_dict(self) -> dict[str, Any]:
        """Return the momentum and settings in ``torch.optim.SGD.state_dict()``'s format.

        Parameters are numbered in the order given; the buffers are this optimiser's
        own tensors (copy them to keep them), as torch's are.
        """
        index = {p: i for i, p in enumerate(self.params)}
        group = {"lr": self.lr, "momentum": self.momentum, "dampening": 0,
                 "weight_decay": self.weight_decay, "nesterov": False, "maximize": False,
                 "foreach": None, "differentiable": False, "fused": None,
                 "params": list(range(len(self.params)))}
        return {"state": {index[p]: dict(state) for p, state in self.state.items()},
                "param_groups": [group]}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` (or ``torch.optim.SGD.state_dict()``) returned.

        As torch does, the saved learning rate, momentum and weight decay replace the
        current ones and each buffer takes its parameter's dtype and device.

        Raises
        ------
        ValueError
            If the saved state is not one parameter group of as many parameters, or it
            uses an SGD variant this class does not step (dampening, Nesterov, maximise).
        """
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(
                f"the saved optimiser state has {len(groups)} parameter group(s) of "
                f"{[len(g['params']) for g in groups]} parameters; this one has one group "
                f"of {len(self.params)}")
        group = groups[0]
        if group.get("dampening", 0) or group.get("nesterov") or group.get("maximize"):
            raise ValueError("the saved optimiser uses dampening, Nesterov or maximize, "
                             "which LightSGD does not step")
        self.lr, self.momentum = group["lr"], group["momentum"]
        self.weight_decay = group["weight_decay"]
        by_saved_id = dict(zip(group["params"], self.params, strict=True))
        self.state = {
            by_saved_id[i]: {"momentum_buffer": saved["momentum_buffer"].to(
                device=by_saved_id[i].device, dtype=by_saved_id[i].dtype, copy=True)}
            for i, saved in state_dict["state"].items()
            if saved.get("momentum_buffer") is not None
        }
