"""What every protocol's client step provides to the one client loop (:mod:`clients.loop`).

A step owns the modules the device trains for its protocol (a bottom, a head and a
tail, a bottom and an auxiliary head, the whole model) and does one batch with
them: forward, exchange with the trunk over a channel when the protocol has one,
backward, optimiser step. Everything else a round needs (data, declines, privacy,
dropout, device emulation, byte and time accounting) is the loop's, written once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import ClassVar

import torch
from torch import Tensor, nn

from splitlearn.calibration import client_train_memory_bytes
from splitlearn.config import RunSpec
from splitlearn.dataplane import TrunkChannel
from splitlearn.models import SplittableModel
from splitlearn.split import bottom_state, load_bottom_state, split


class ClientStep:
    """A protocol's work on the device; this base is the split bottom without an exchange.

    Parameters
    ----------
    model : SplittableModel
        The network; the step's modules are views of its stages (no copies).
    spec : RunSpec
        The run's settings (protocol options in ``spec.strategy``).
    cut : int
        This client's cut: stages ``[0, cut)`` are the device's.
    """

    #: Data-plane round trips per training batch (the virtual clock charges an RTT each).
    exchanges_per_batch: ClassVar[int] = 1
    #: Whether the device sends activations (activation privacy applies).
    sends_activations: ClassVar[bool] = True
    #: Whether the step talks to the trunk over a data-plane channel.
    needs_channel: ClassVar[bool] = True

    def __init__(self, model: SplittableModel, spec: RunSpec, *, cut: int) -> None:
        self.model = model
        self.spec = spec
        self.cut = model.check_cut(cut)
        self.bottom, _ = split(model, self.cut)
        #: What the device sends instead of raw activations (privacy sets it).
        self.release: Callable[[Tensor], Tensor] = _as_is
        #: Bytes this round moved outside the data plane (e.g. in the Flower reply).
        self.extra_bytes_up = 0
        self.extra_bytes_down = 0

    def trained(self) -> nn.Module:
        """Return the modules the device trains (their parameters go to the optimiser)."""
        return self.bottom

    def state(self) -> dict[str, Tensor]:
        """Return the client-side arrays sent back (keys ``"<stage index>.…"``)."""
        return bottom_state(self.model, self.cut)

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Load the arrays the server sent (validated before anything is copied)."""
        load_bottom_state(self.model, state)

    def memory_bytes(self, batch_size: int) -> int:
        """Estimated training memory of the device's modules for one batch."""
        return client_train_memory_bytes(self.model, self.cut, batch_size=batch_size)

    def train_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[float, int]:
        """Train on one batch; return its mean loss and correctly classified rows."""
        raise NotImplementedError

    @torch.no_grad()
    def evaluate_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None
    ) -> tuple[float, int]:
        """Evaluate one batch without an update; return its mean loss and hits."""
        raise NotImplementedError

    def finish(self, channel: TrunkChannel | None) -> None:
        """End of the round's training (e.g. wait for acks)."""

    def extra_exchanges(self) -> int:
        """Round trips besides ``exchanges_per_batch`` per batch (e.g. a final flush)."""
        return 0

    def reply_arrays(self) -> dict[str, dict[str, Tensor]]:
        """Further ArrayRecords for the reply, by key (bulk smashed data)."""
        return {}


def _as_is(activations: Tensor) -> Tensor:
    return activations


def hits(logits: Tensor, labels: Tensor) -> int:
    """Rows whose arg-max is the label."""
    return int((logits.detach().argmax(dim=1) == labels).sum())
