"""The split step (SplitFed v1/v2, sequential SL): the trunk holds the loss.

Per batch: run the bottom, send the (released) activations and the labels, get the
gradient of the batch's mean loss at the cut back, finish the backward pass and
step the bottom.
"""

from __future__ import annotations

import torch
from torch import Tensor

from clients.cut_gradient import GradientRoot
from clients.steps.base import ClientStep
from splitlearn.attacks.dcor import distance_correlation_tensor
from splitlearn.dataplane import TrunkChannel


class SplitStep(ClientStep):
    """The device trains stages ``[0, cut)`` against the trunk's gradient."""

    frees_sent_output = True

    def _train_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[float, int]:
        """Forward, exchange, backward from the cut gradient, step."""
        assert channel is not None
        activations = self.release(self.run_stages(self.bottom, inputs))
        grad, loss, correct = channel.forward(activations.detach(), labels,
                                              example_ids=self.batch_ids)
        optimizer.zero_grad(set_to_none=True)
        weight = self.spec.privacy.nopeek_weight
        root = GradientRoot(activations)
        # NoPeek: also decorrelate what was sent from the inputs.
        penalty = weight * distance_correlation_tensor(inputs, activations) if weight else None
        del activations  # sent: its memory goes now unless autograd saved it
        root.backward(grad, plus=penalty)
        optimizer.step()
        return loss, correct

    @torch.no_grad()
    def evaluate_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None
    ) -> tuple[float, int]:
        """Let the trunk score the batch (the loss is computed there)."""
        assert channel is not None
        return channel.evaluate(self.release(self.bottom(inputs)), labels)
