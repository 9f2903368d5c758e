"""The shared server trunk: one model, one optimizer, one lock.

SplitFed with a shared trunk applies an update for every batch that arrives, in
arrival order. Each step holds the lock from forward to optimizer step, so
concurrent clients never interleave a half-applied update, and a client that
vanishes between steps leaves the trunk in a consistent state.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass

import torch
from torch import nn

from splitlearn.models import SplittableModel


@dataclass(frozen=True)
class TrunkStep:
    """Result of one trunk step.

    Parameters
    ----------
    grad : torch.Tensor | None
        Gradient of the mean loss w.r.t. the activations at the cut.
    loss : float
        Mean cross-entropy over the batch.
    correct : int
        Correctly classified samples in the batch.
    """

    grad: torch.Tensor | None
    loss: float
    correct: int
    #: Per-sample losses and hits, so a step over several clients' batches can
    #: report each client its own numbers.
    losses: torch.Tensor | None = None
    hits: torch.Tensor | None = None


class Trunk:
    """Server-side stages of a splittable model, trained as batches arrive.

    Parameters
    ----------
    model : SplittableModel
        The server's copy of the whole model; a session with cut ``k`` runs and
        trains ``model.stages[k:]``. Stages below the cut are never touched here.
    lr : float
        SGD learning rate.
    momentum : float
        SGD momentum.
    weight_decay : float
        SGD weight decay.
    """

    def __init__(
        self,
        model: SplittableModel,
        *,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        self.model = model
        self.hyper = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        # Shapes never change; probing them per frame would run the model (in
        # eval mode) under concurrent training steps.
        self._cut_shapes = {cut: model.cut_shape(cut) for cut in model.valid_cuts}
        # SGD skips parameters whose grad is None, so stages below every cut in
        # use keep their values (and momentum buffers stay empty for them).
        self.optimizer = torch.optim.SGD(
            model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay
        )
        self._lock = threading.Lock()
        self.steps = 0
        self.samples = 0
        #: Seconds spent inside training steps (the virtual clock adds them per round).
        self.busy_s = 0.0

    def cut_shape(self, cut: int) -> tuple[int, ...]:
        """Per-sample shape of the activation at ``cut`` (ValueError if invalid)."""
        return self._cut_shapes[self.model.check_cut(cut)]

    def _forward(self, cut: int, activations: torch.Tensor) -> torch.Tensor:
        out = activations
        for stage in self.model.stages[cut:]:
            out = stage(out)
        return out

    def train_step(self, cut: int, activations: torch.Tensor, labels: torch.Tensor) -> TrunkStep:
        """Forward, backward and update the stages above ``cut``; return the cut gradient."""
        acts = activations.detach().requires_grad_(True)
        with self._lock:
            started = time.perf_counter()
            self.model.train()
            logits = self._forward(cut, acts)
            losses = nn.functional.cross_entropy(logits, labels, reduction="none")
            loss = losses.mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
            self.steps += 1
            self.samples += len(labels)
            self.busy_s += time.perf_counter() - started
        hits = logits.argmax(dim=1) == labels
        return TrunkStep(acts.grad, float(loss.detach()), int(hits.sum()), losses.detach(), hits)

    @torch.no_grad()
    def evaluate_batch(
        self, cut: int, activations: torch.Tensor, labels: torch.Tensor
    ) -> TrunkStep:
        """Loss and correct count for one batch, in eval mode, without an update."""
        with self._lock:
            self.model.eval()
            logits = self._forward(cut, activations)
        loss = nn.functional.cross_entropy(logits, labels)
        correct = int((logits.argmax(dim=1) == labels).sum())
        return TrunkStep(None, float(loss), correct)

    def fork(self) -> Trunk:
        """Return an independent trunk on a copy of the model, with a fresh optimiser."""
        return Trunk(self.snapshot(), **self.hyper)

    def snapshot(self) -> SplittableModel:
        """Return an independent copy of the whole server model."""
        with self._lock:
            return copy.deepcopy(self.model)
