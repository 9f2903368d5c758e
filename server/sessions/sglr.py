"""SGLR's trunk side: one step over the clients' batches, one averaged gradient back.

Pal et al. 2021 ("Server-Side Local Gradient Averaging and Learning Rate
Acceleration for Scalable Split Learning"). The batches that the attached
sessions send together (the barrier of :class:`BatchingSplitSession`) are
stepped as one: the trunk's loss is the sum of the clients' mean losses times
``server_lr_scale`` (0: the number of clients in the step), which with SGD is
the server-side learning rate accelerated by that factor while each client keeps
its own. Every client of the step then receives the *same* gradient at the cut:
the average of the clients' own gradients (of their own mean loss), so the client
sides move together as FedAvg would move them, with no traffic between clients.
Batches of another size (a last, partial batch) are averaged only with batches of
their own size.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from server.sessions.split import BatchingSplitSession, SharedTrunk, Slot, StepResult
from server.trunk import Trunk
from splitlearn.config import DataPlaneConfig, StrategyConfig
from splitlearn.dataplane.codec import FrameError, Reason, magnitude


class SGLRSession(BatchingSplitSession):
    """Split sessions stepped together, with server-side gradient averaging at the cut.

    Parameters
    ----------
    pool : SharedTrunk
        The shared trunk.
    dataplane : DataPlaneConfig
        Batch size and value bounds.
    timeout_s : float
        Longest a batch waits for the other attached sessions' batches.
    server_lr_scale : float
        Factor on the trunk's step (0: the number of clients in the step).
    """

    def __init__(
        self, pool: SharedTrunk, *, dataplane: DataPlaneConfig, timeout_s: float,
        server_lr_scale: float,
    ) -> None:
        super().__init__(pool, dataplane=dataplane, timeout_s=timeout_s)
        self.server_lr_scale = server_lr_scale

    def step_group(self, cut: int, group: list[Slot]) -> list[StepResult]:
        """Step once on ``group``'s batches; give each client its size group's mean gradient."""
        trunk = self.pool.trunk
        scale = self.server_lr_scale or float(len(group))
        leaves = [s.activations.detach().requires_grad_(True) for s in group]
        with trunk.step(samples=sum(len(s.labels) for s in group), from_stage=cut) as backward:
            logits = [trunk.run(leaf, cut) for leaf in leaves]
            losses = [nn.functional.cross_entropy(out, s.labels, reduction="none")
                      for out, s in zip(logits, group, strict=True)]
            # One device's batch alone is checked as such (its labels beside it); a group's
            # summed loss is no device's and is not checked (Trunk.step).
            backward(scale * sum(loss.mean() for loss in losses),
                     labels=group[0].labels if len(group) == 1 else None)
            own = [leaf.grad / scale for leaf in leaves]  # d(client's mean loss)/d(its rows)
            if not all(math.isfinite(magnitude(g)) for g in own):
                raise FrameError(Reason.STEP_NOT_FINITE, "the gradient at the cut is not finite")
        results = []
        for grad, loss, out, slot in zip(own, losses, logits, group, strict=True):
            same_size = [g for g in own if g.shape == grad.shape]
            results.append(StepResult(
                torch.stack(same_size).mean(dim=0), loss.detach(),
                out.argmax(dim=1) == slot.labels,
            ))
        return results


def sglr_sessions(trunk: Trunk, options: StrategyConfig, dataplane: DataPlaneConfig) -> SGLRSession:
    """SGLR sessions on the shared trunk."""
    return SGLRSession(
        SharedTrunk(trunk), dataplane=dataplane,
        timeout_s=options.barrier_timeout_s,  # type: ignore[attr-defined]
        server_lr_scale=options.server_lr_scale,  # type: ignore[attr-defined]
    )
