"""The U-shaped step (Vepakomma et al. 2018): head, tail and loss on the device.

The device keeps the head (stages ``[0, cut)``), the tail (``[tail_cut, n)``) and
the loss, so labels never leave it. Per batch, two exchanges: send the head's
(released) activations and get the trunk's features; run the tail and the loss,
send d loss / d features and get the gradient at the cut; step head and tail.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from clients.cut_gradient import GradientRoot
from clients.steps.base import ClientStep, hits
from splitlearn.calibration import client_train_memory_bytes, tail_train_memory_bytes
from splitlearn.config import CompressionConfig, RunSpec
from splitlearn.dataplane import TrunkChannel
from splitlearn.models import SplittableModel
from splitlearn.privacy import GaussianActivationMechanism, secret_generator
from splitlearn.stages import resolve_tail_cut, split_u, ushaped_state


class UShapedStep(ClientStep):
    """Head and tail trained on the device; the trunk runs the stages between."""

    exchanges_per_batch = 2
    frees_sent_output = True

    def __init__(
        self, model: SplittableModel, spec: RunSpec, *, cut: int, recompute: bool = False
    ) -> None:
        super().__init__(model, spec, cut=cut, recompute=recompute)
        self.tail_cut = resolve_tail_cut(model, self.cut, spec.strategy.tail_cut)  # type: ignore[attr-defined]
        self.head, _, self.tail = split_u(model, self.cut, self.tail_cut)
        self._parts = nn.ModuleList([self.head, self.tail])
        settings = spec.privacy
        #: Noise on the gradient returned at the features (privacy.gradient_noise_multiplier).
        self.gradient_release = GaussianActivationMechanism(
            clip_norm=settings.gradient_clip_norm,
            noise_multiplier=settings.gradient_noise_multiplier,
            generator=secret_generator(),
        ) if settings.gradient_noise_multiplier else None

    def returned_gradient(self, grad: Tensor) -> Tensor:
        """Return what is sent for d (mean loss) / d features: each example's row, noised.

        Rows are scaled to per-example gradients first (times the batch size), so the clip
        bound does not depend on the batch size, then clipped, noised and scaled back.
        """
        if self.gradient_release is None:
            return grad
        rows = len(grad)
        return self.gradient_release(grad * rows) / rows

    def trained(self) -> nn.Module:
        """Head and tail."""
        return self._parts

    def state(self) -> dict[str, Tensor]:
        """Head and tail stages (keys ``"<stage index>.…"``)."""
        return ushaped_state(self.model, self.cut, self.tail_cut)

    def kept_bytes(self, examples: int, compression: CompressionConfig) -> int:
        """Return the base step's rows, and with a lossy downlink a row of features per example.

        (The references of the trunk's features.)
        """
        features = 4 * examples * torch.Size(self.model.cut_shape(self.tail_cut)).numel()
        return super().kept_bytes(examples, compression) + (
            features if compression.downlink_feedback else 0)

    def memory_bytes(self, batch_size: int) -> int:
        """Estimate the head's memory plus the tail's saved activations and parameter state."""
        tail_bytes = tail_train_memory_bytes(self.model, self.tail_cut, batch_size=batch_size)
        return tail_bytes + client_train_memory_bytes(
            self.model, self.cut, batch_size=batch_size, recompute=self.recompute,
            frees_output=self.frees_sent_output,
        )

    def _train_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[float, int]:
        """Head, features from the trunk, tail and loss, gradient back, step."""
        assert channel is not None
        activations = self.release(self.run_stages(self.head, inputs))
        features = channel.forward_features(
            activations.detach(), example_ids=self.batch_ids).requires_grad_(True)
        root = GradientRoot(activations)
        del activations  # sent: its memory goes now unless autograd saved it
        logits = self.tail(features)
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the tail's gradients, and d loss / d features for the trunk
        assert features.grad is not None
        root.backward(channel.backward(self.returned_gradient(features.grad)))
        optimizer.step()
        return float(loss.detach()), hits(logits, labels)

    @torch.no_grad()
    def evaluate_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None
    ) -> tuple[float, int]:
        """Head, the trunk's features, tail and loss, all without an update."""
        assert channel is not None
        logits = self.tail(channel.evaluate_features(self.release(self.head(inputs))))
        return float(nn.functional.cross_entropy(logits, labels)), hits(logits, labels)
