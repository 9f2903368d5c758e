"""U-shaped sessions: the trunk runs the middle stages, two exchanges per batch.

In the U-shaped configuration (Vepakomma et al. 2018, "Split learning for
health") the device keeps the first stages, the last stages *and* the loss, so
labels never leave it. Per batch:

1. ``forward`` (activations at the cut, nothing else) -> the trunk runs stages
   ``[cut, tail_cut)``, keeps the autograd graph for that session and answers
   ``features`` (its output at ``tail_cut``).
2. ``backward`` (d loss / d features) -> the trunk backpropagates through the
   pending graph, steps and answers ``gradient`` (the gradient at the cut).

``evaluate`` is forward-only (eval mode, no graph, no update). A session has at
most one pending graph: a second ``forward`` replaces it (the abandoned batch
never stepped the trunk; the reply says so), a ``backward`` without one is
refused. Pending graphs are dropped when their stream ends or is closed.

Concurrency: forward and step are two frames apart, and another session may step
the shared trunk in between. The pending graph then holds weights that changed
in place, so the step recomputes the forward on the current weights from the
kept activations (batch-norm statistics restored, so they move once per batch):
the usual bounded staleness of asynchronous split learning. With one session at
a time nothing changes in between and the kept graph is used as is: exactly
whole-model SGD.

With error feedback (``dataplane.compression.error_feedback``) the ``forward`` also
carries the rows' example ids. A lossy uplink's activations arrive as differences from
references (as in split sessions); a lossy downlink's features leave as differences from
references of their own, which the device keeps too, and what the gradient at the cut's
compression drops is added to the example's next gradient. Both sides' references absorb
a batch at its ``forward`` (one version for both).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from server.consistency import DeviceTails
from server.sessions.split import (
    SharedTrunk,
    admit,
    example_ids,
    prepare_feedback,
    round_trip,
)
from server.trunk import Trunk
from splitlearn.config import DataPlaneConfig, StrategyConfig
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import (
    AnyReply,
    AnyRequest,
    FrameError,
    Reason,
    check_activations,
    check_finite,
    check_gradient,
    encoder,
    magnitude,
    present,
    reply,
)
from splitlearn.dataplane.endpoint import Session
from splitlearn.dataplane.feedback import ClientFeedback, FeedbackBook
from splitlearn.merge import client_copy
from splitlearn.optim import base_lr


@dataclass
class Pending:
    """One session's batch between its ``forward`` and its ``backward``."""

    cut: int
    activations: Tensor  # leaf at the cut (requires grad)
    features: Tensor  # output at the tail cut, graph attached
    versions: tuple[int, ...]  # in-place versions of the stages' parameters after forward
    ids: Tensor | None = None  # with error feedback: the rows' examples
    memory: ClientFeedback | None = None  # ... and the client's feedback


def _versions(tensors: Iterable[Tensor]) -> tuple[int, ...]:
    # Autograd's own staleness test: an optimiser step bumps a parameter's _version.
    return tuple(t._version for t in tensors)


class UShapedSession:
    """Answers ``forward``/``evaluate`` with ``features`` and ``backward`` with ``gradient``.

    Parameters
    ----------
    pool : SharedTrunk
        The shared trunk.
    tail_cut : int
        The trunk runs stages ``[cut, tail_cut)``; the device keeps the rest.
    dataplane : DataPlaneConfig
        Batch size and value bounds.
    devices : StrategyConfig, optional
        The run's training settings: the devices' optimiser, which the consistency check
        replays (None: the trunk's own).
    """

    def __init__(self, pool: SharedTrunk, *, tail_cut: int, dataplane: DataPlaneConfig,
                 devices: StrategyConfig | None = None) -> None:
        self.pool = pool
        self.trunk: Trunk = pool.trunk
        self.tail_cut = tail_cut
        self.dataplane = dataplane
        self._encode = encoder(dataplane.compression, "downlink")  # features and gradients
        #: Each one's encoding and what the device will decode from it (error feedback).
        self._round_trips = {name: partial(round_trip, self._encode, name=name,
                                           max_bytes=dataplane.max_frame_bytes)
                             for name in ("features", "grad")}
        #: Every client's per-example error feedback, kept across rounds (None: not used).
        self.feedback = FeedbackBook.for_compression(dataplane.compression, features=True)
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()
        #: Forwards whose backward never came before the next forward.
        self.replaced = 0
        #: Steps that recomputed their forward because the trunk changed in between.
        self.recomputed = 0
        #: Each device's tail as its own steps leave it (the guard's consistency check).
        self.tails = DeviceTails(**_device_optimizer(devices, pool.trunk),
                                 lr_factor=lambda: pool.trunk.lr_factor)

    @property
    def pending_sessions(self) -> int:
        """Sessions holding a graph right now."""
        with self._lock:
            return len(self._pending)

    def _params(self, cut: int) -> list[Tensor]:
        return [p for s in self.trunk.model.stages[cut:self.tail_cut] for p in s.parameters()]

    def handle(self, session: Session, request: AnyRequest) -> AnyReply:
        """Answer one U-shaped request; nothing label-derived is ever accepted."""
        kind = request.WhichOneof("kind")
        cut = session.grant.cut
        if not cut < self.tail_cut:
            raise FrameError(Reason.BAD_TENSOR, f"cut {cut} leaves the trunk no stage "
                             f"below the tail cut {self.tail_cut}")
        if kind == "backward":
            pending, grad = self._step(session, request.backward)
            if pending.memory is None or pending.memory.downlink is None:
                return reply("gradient", grad=self._encode(grad))
            assert pending.ids is not None
            return reply("gradient", grad=pending.memory.downlink.compress(
                pending.ids, grad, self._round_trips["grad"]))
        if kind not in ("forward", "evaluate"):
            raise FrameError(Reason.UNEXPECTED_KIND, f"U-shaped sessions send 'forward', "
                             f"'backward' or 'evaluate', not {kind!r}")
        part = getattr(request, kind)
        if part.HasField("labels"):
            raise FrameError(Reason.BAD_TENSOR, "U-shaped sessions keep labels on the "
                             f"device: the {kind!r} frame carries labels")
        acts = check_activations(
            present(part, "activations"), cut_shape=self.trunk.cut_shape(cut),
            max_batch=self.dataplane.max_batch, max_bytes=self.dataplane.max_frame_bytes,
            max_abs=self.dataplane.max_abs_value,
        )
        if kind == "evaluate":
            with torch.no_grad(), self.trunk.forward_only(train=False):
                features = self.trunk.run(acts, cut, self.tail_cut)
            return reply("features", features=self._encode(features))
        ids = example_ids(part, len(acts), feedback=self.feedback,
                          max_bytes=self.dataplane.max_frame_bytes)
        if ids is not None:
            return self._forward_with_feedback(session, cut, acts, ids, part)
        admit(self.trunk, session.grant.client, session.grant.server_round, "activations", cut,
              acts)
        features, replaced = self._forward(session, cut, acts)
        return reply("features", features=self._encode(features), replaced_pending=replaced)

    def _forward_with_feedback(self, session: Session, cut: int, acts: Tensor, ids: Tensor,
                               part: pb.Forward) -> AnyReply:
        """Forward reference + the sent difference; send the features' difference from theirs."""
        assert self.feedback is not None
        client = session.grant.client
        memory = prepare_feedback(self.feedback, client, ids, tuple(acts.shape[1:]), part,
                                  feature_shape=tuple(self.trunk.cut_shape(self.tail_cut)))
        if memory.uplink is not None:
            acts = memory.uplink.reconstruct(ids, acts)
            check_finite(acts, name="activations", max_abs=self.dataplane.max_abs_value)
        admit(self.trunk, client, session.grant.server_round, "activations", cut, acts)
        features, replaced = self._forward(session, cut, acts, ids=ids, memory=memory)
        if memory.uplink is not None:
            memory.uplink.commit(ids, acts)
        frame: object
        if memory.features is None:
            frame = self._encode(features)
        else:
            frame, agreed = memory.features.encode(ids, features.float(),
                                                   self._round_trips["features"])
            memory.features.commit(ids, agreed)
        dropped = self.feedback.keep(client, memory)
        return reply("features", features=frame, replaced_pending=replaced,
                     feedback_dropped=dropped)

    def _forward(self, session: Session, cut: int, activations: Tensor, *,
                 ids: Tensor | None = None, memory: ClientFeedback | None = None
                 ) -> tuple[Tensor, bool]:
        acts = activations.detach().requires_grad_(True)
        with self.trunk.forward_only(train=True):
            features = self.trunk.run(acts, cut, self.tail_cut)
            versions = _versions(self._params(cut))
        with self._lock:
            replaced = self._pending.pop(session.token, None) is not None
            self._pending[session.token] = Pending(cut, acts, features, versions, ids, memory)
            self.replaced += replaced
        return features.detach(), replaced

    def _step(self, session: Session, backward: pb.Backward) -> tuple[Pending, Tensor]:
        with self._lock:
            pending = self._pending.get(session.token)
        if pending is None:
            raise FrameError(Reason.NO_PENDING_FORWARD,
                             "backward without a pending forward: send the batch's forward first")
        grad = check_gradient(
            present(backward, "grad"), shape=pending.features.shape,
            max_bytes=self.dataplane.max_frame_bytes, max_abs=self.dataplane.max_abs_value,
        )
        # The returned gradient steers the trunk as activations do: bounded the same way.
        admit(self.trunk, session.grant.client, session.grant.server_round, "gradient",
              self.tail_cut, grad)
        client, server_round = session.grant.client, session.grant.server_round
        found = None
        if self.trunk.guard is not None:  # ... and must be one some labelling explains
            tail = self.tails.tail(client, server_round,
                                   lambda: self.trunk.model.stages[self.tail_cut:])
            found = self.trunk.guard.check_returned(
                client, server_round, self.tail_cut, tail=tail, features=pending.features,
                grad=grad)
        with self._lock:
            if self._pending.pop(session.token, None) is not pending:
                raise FrameError(Reason.NO_PENDING_FORWARD,
                                 "the pending forward was replaced while this backward arrived")
        cut_grad = self._apply(pending, grad)
        if found is not None:  # the device steps its tail now: so does its replica
            self.tails.learn(client, pending.features, found.labels, found.probs)
        return pending, cut_grad

    def _apply(self, pending: Pending, grad: Tensor) -> Tensor:
        """Backpropagate ``grad`` through the pending forward, step, return the cut gradient."""
        cut, acts, features = pending.cut, pending.activations, pending.features
        stages = self.trunk.model.stages[cut:self.tail_cut]
        with self.trunk.step(samples=len(acts), from_stage=cut, to_stage=self.tail_cut
                             ) as backward:
            restore: list[tuple[Tensor, Tensor]] = []
            if _versions(self._params(cut)) != pending.versions:
                self.recomputed += 1
                restore = [(b, b.detach().clone()) for s in stages for b in s.buffers()]
                acts = acts.detach().requires_grad_(True)
                features = self.trunk.run(acts, cut, self.tail_cut)
            backward(features, grad.to(features.dtype))
            with torch.no_grad():
                for buffer, saved in restore:  # this batch's statistics count once
                    buffer.copy_(saved)
            assert acts.grad is not None
            if not math.isfinite(magnitude(acts.grad)):
                raise FrameError(Reason.STEP_NOT_FINITE, "the gradient at the cut is not finite")
        return acts.grad

    def attach(self, session: Session) -> None:
        """Nothing to set up."""

    def detach(self, session: Session) -> None:
        """Drop the session's pending graph (its backward will never come)."""
        with self._lock:
            self._pending.pop(session.token, None)

    def finish_round(self, finished: Iterable[str]) -> None:
        """Drop the devices' tail replicas: the next round starts from the merged tail."""
        self.tails.forget()

    def merge_round(
        self, updates: Sequence[tuple[Mapping[str, Tensor], int]], *, upto: int
    ) -> dict[str, Tensor]:
        """Merge heads and tails with the trunk's stages, per stage (clients' cuts may differ).

        Returns every stage the clients hold: ``[0, upto)`` and the tail.
        """
        return self.pool.merge_round([client_copy(s, n) for s, n in updates], upto=upto)


def ushaped_sessions(
    trunk: Trunk, options: StrategyConfig, dataplane: DataPlaneConfig
) -> UShapedSession:
    """U-shaped sessions on the shared trunk, up to the configured tail cut."""
    tail_cut = options.tail_cut or trunk.model.num_stages - 1  # type: ignore[attr-defined]
    return UShapedSession(SharedTrunk(trunk), tail_cut=tail_cut, dataplane=dataplane,
                          devices=options)


def _device_optimizer(options: StrategyConfig | None, trunk: Trunk) -> dict[str, Any]:
    """Return the devices' optimiser settings: the run's, else the trunk's own."""
    if options is None:
        return dict(trunk.hyper)
    return {"lr": base_lr(options, "device"), "momentum": options.momentum,
            "weight_decay": options.weight_decay, "optimizer": options.optimizer}
