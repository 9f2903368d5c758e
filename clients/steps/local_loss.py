"""The local-loss step (Han et al. 2021): the device never waits for the trunk.

Per batch the device scores its bottom's activations with a small auxiliary head
of its own, steps bottom and head on that local loss, and hands the (released)
activations and the labels to the trunk one way: streamed as ``smashed`` frames,
or kept for the Flower reply with ``strategy.bulk=true`` (for devices that reach
only the SuperLink). The head's weights travel with the bottom's (``"aux.…"``
keys) and are averaged with them; it is never part of the evaluated model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from clients.steps.base import ClientStep, hits
from splitlearn.aux_head import (
    aux_state,
    build_aux_head,
    keyed_heads,
    split_client_state,
    without_aux,
)
from splitlearn.calibration import client_train_memory_bytes
from splitlearn.config import CompressionConfig, RunSpec, StrategyConfig
from splitlearn.dataplane import TrunkChannel
from splitlearn.dataplane.channel import DEFAULT_WINDOW
from splitlearn.messages import SMASHED_RECORD_KEY
from splitlearn.models import SplittableModel
from splitlearn.stages import load_bottom_state


class LocalLossStep(ClientStep):
    """Bottom and auxiliary head trained on the local loss; smashed data sent one way."""

    exchanges_per_batch = 0
    receives_gradient = False

    def __init__(
        self, model: SplittableModel, spec: RunSpec, *, cut: int, recompute: bool = False
    ) -> None:
        super().__init__(model, spec, cut=cut, recompute=recompute)
        options = spec.strategy
        self.bulk: bool = options.bulk  # type: ignore[attr-defined]
        self.needs_channel = not self.bulk  # type: ignore[misc]
        self.aux = build_aux_head(
            model.cut_shape(self.cut), model.num_classes,
            hidden=options.aux_hidden, seed=spec.seed,  # type: ignore[attr-defined]
        )
        self._parts = nn.ModuleList([self.bottom, self.aux])
        self._kept: list[tuple[Tensor, Tensor]] = []

    @classmethod
    def initial_state(
        cls, model: SplittableModel, spec: RunSpec, *, cuts: Sequence[int]
    ) -> dict[str, Tensor]:
        """Stages of the deepest cut, and a head per cut (as each cut's clients seed it)."""
        stages = without_aux(cls(model, spec, cut=max(cuts)).state())
        heads = {cut: build_aux_head(
            model.cut_shape(cut), model.num_classes,
            hidden=spec.strategy.aux_hidden, seed=spec.seed,  # type: ignore[attr-defined]
        ).state_dict() for cut in cuts}
        return stages | keyed_heads(heads)

    @classmethod
    def kept_samples_cap(cls, options: StrategyConfig, compression: CompressionConfig) -> float:
        """Every batch in bulk mode, until the reply; the window's, streaming with feedback.

        With uplink error feedback each batch in flight is kept until its ack, to be sent
        again should the trunk refuse it as stale.
        """
        if options.bulk:  # type: ignore[attr-defined]
            return math.inf
        return DEFAULT_WINDOW * options.batch_size if compression.uplink_feedback else 0

    def trained(self) -> nn.Module:
        """Bottom and auxiliary head."""
        return self._parts

    def state(self) -> dict[str, Tensor]:
        """Bottom stages and ``"aux.…"`` head entries."""
        return super().state() | aux_state(self.aux)

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Load the bottom's stages and the head."""
        stages, aux = split_client_state(state)
        load_bottom_state(self.model, stages)
        self.aux.load_state_dict(aux, strict=True)

    def memory_bytes(self, batch_size: int) -> int:
        """Estimate the bottom's memory plus the head's parameters, gradients and momentum."""
        head = 3 * 4 * sum(p.numel() for p in self.aux.parameters())
        return head + client_train_memory_bytes(
            self.model, self.cut, batch_size=batch_size, recompute=self.recompute
        )

    def _train_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None,
        optimizer: torch.optim.Optimizer,
    ) -> tuple[float, int]:
        """Step on the local loss, then send the batch's released activations."""
        activations = self.run_stages(self.bottom, inputs)
        logits = self.aux(activations)
        loss = nn.functional.cross_entropy(logits, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            released = self.release(activations.detach())
        if channel is None:
            self._keep(released, labels)
        else:
            channel.send_smashed(released, labels, example_ids=self.batch_ids)
        return float(loss.detach()), hits(logits, labels)

    def _keep(self, activations: Tensor, labels: Tensor) -> None:
        self._kept.append((activations.contiguous(), labels.to(torch.int64)))
        self.extra_bytes_up += sum(t.numel() * t.element_size() for t in self._kept[-1])

    @torch.no_grad()
    def evaluate_batch(
        self, inputs: Tensor, labels: Tensor, channel: TrunkChannel | None
    ) -> tuple[float, int]:
        """Score the batch with bottom and auxiliary head (the trunk is not asked)."""
        logits = self.aux(self.bottom(inputs))
        return float(nn.functional.cross_entropy(logits, labels)), hits(logits, labels)

    def finish(self, channel: TrunkChannel | None) -> None:
        """Wait until the trunk acknowledged every frame (raises if one was refused)."""
        if channel is not None:
            channel.flush()

    def extra_exchanges(self) -> int:
        """Streaming pays the link's latency once, for the last ack; bulk rides the reply."""
        return 0 if self.bulk else 1

    def reply_arrays(self) -> dict[str, dict[str, Tensor]]:
        """Bulk mode: every kept batch, concatenated, with the batch sizes to split them."""
        if not self._kept:
            return {}
        return {SMASHED_RECORD_KEY: {
            "activations": torch.cat([a for a, _ in self._kept]),
            "labels": torch.cat([labels for _, labels in self._kept]),
            "batch-sizes": torch.tensor([len(lb) for _, lb in self._kept], dtype=torch.int64),
        }}

