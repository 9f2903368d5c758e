"""The FedAvg baseline's step: the whole model trained on the device, no trunk.

The device downloads every stage, trains locally and uploads every stage; its
bytes are the weights themselves (counted by the ClientApp, as for every protocol),
which is what split learning is compared against. With ``recompute=True`` every
stage but the last is recomputed in the backward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from clients.steps.base import ClientStep, hits
from splitlearn.calibration import client_train_memory_bytes, cross_entropy_memory_bytes
from splitlearn.config import RunSpec
from splitlearn.dataplane import TrunkChannel
from splitlearn.models import SplittableModel


class WholeModelStep(ClientStep):
    """Every stage on the device, trained on the local loss."""

    exchanges_per_batch = 0
    needs_channel = False

    def __init__(
        self, model: SplittableModel, spec: RunSpec, *, cut: int, recompute: bool = False
    ) -> None:
        super().__init__(model, spec, cut=cut, recompute=recompute)

    def trained(self) -> nn.Module:
        """Return the whole model."""
        return self.model

    def state(self) -> dict[str, Tensor]:
        """Every stage (keys ``"<stage index>.…"``)."""
        return {k: v.detach().clone() for k, v in self.model.stages.state_dict().items()}

    def memory_bytes(self, batch_size: int) -> int:
        """Estimate the whole model's training memory for one batch, the loss's included."""
        stages = client_train_memory_bytes(
            self.model, self.model.num_stages, batch_size=batch_size, recompute=self.recompute
        )
        return stages + cross_entropy_memory_bytes(self.model.num_classes, batch_size=batch_size)

    def _train_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[float, int]:
        """One local SGD step."""
        logits = self.run_stages(self.model.stages, inputs)
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return float(loss.detach()), hits(logits, labels)

    @torch.no_grad()
    def evaluate_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None
    ) -> tuple[float, int]:
        """Local evaluation of the whole model."""
        logits = self.model(inputs)
        return float(nn.functional.cross_entropy(logits, labels)), hits(logits, labels)

    def extra_exchanges(self) -> int:
        """One download and one upload of the weights: one round trip."""
        return 1
