"""Split sessions: the client sends activations and labels, the trunk returns the gradient.

Served to every protocol whose trunk holds the loss (SplitFed v1 and v2,
sequential SL). Which trunk a client trains is the pool's choice:

* :class:`SharedTrunk` (SplitFed v2, sequential): one trunk, a step per batch
  in arrival order.
* :class:`TrunkPerClient` (SplitFed v1): each client trains its own copy during
  a round; at round end the copies of the clients that *finished* are merged,
  stage by stage and weighted by samples, into the global trunk, the rest
  dropped. Copies exist only while their client trains.

Either pool merges the round per stage with the clients' copies
(:mod:`splitlearn.merge`), so clients may hold different cuts.

:class:`BatchingSplitSession` (SplitFed v2 with ``batch_concurrent``) steps once
over the batches of every attached session. Its barrier counts the sessions
actually attached (the Simulation Engine runs only as many clients at once as it
has resources) and has a timeout, so a slow or vanished client never blocks the
others.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn

from server.trunk import Trunk
from splitlearn.config import DataPlaneConfig, StrategyConfig
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import (
    AnyReply,
    AnyRequest,
    FrameError,
    Reason,
    TensorMessage,
    build,
    check_activations,
    check_example_ids,
    check_finite,
    check_labels,
    decode_tensor,
    encoder,
    magnitude,
    present,
    reply,
)
from splitlearn.dataplane.endpoint import Session
from splitlearn.dataplane.feedback import (
    ClientFeedback,
    FeedbackBook,
    FeedbackFull,
    StaleFeedback,
)
from splitlearn.merge import (
    StageCopy,
    client_copy,
    client_stages,
    merge_stages,
    stage_of,
    trunk_copy,
)


class SharedTrunk:
    """Every client trains the one trunk."""

    def __init__(self, trunk: Trunk) -> None:
        self.trunk = trunk

    def trunk_for(self, client: str) -> Trunk:
        """Return the shared trunk."""
        return self.trunk

    def finish_round(self, finished: Iterable[str]) -> None:
        """Nothing to settle: updates were applied as batches arrived."""

    def take_turn(self, client: Mapping[str, Tensor], *, upto: int) -> dict[str, Tensor]:
        """Sequential learning: a finished turn's stages replace the trunk's copies.

        Turns train one after another, so each stage's latest copy wins (nothing
        is averaged): the client's for the stages it sent, the trunk's own for
        the rest. The trunk's momentum of the client's stages is dropped (its
        direction predates the turn). Returns stages ``[0, upto)``, what the
        next turn's client is sent from.
        """
        self.trunk.load_stages(client)
        self.trunk.forget_optimizer_state({stage_of(k) for k in client})
        return {k: v for k, v in self.trunk.stage_state().items() if stage_of(k) < upto}

    def merge_round(self, clients: Sequence[StageCopy], *, upto: int) -> dict[str, Tensor]:
        """Merge the clients' copies with the trunk's, per stage; return the clients' stages.

        Those are stages ``[0, upto)`` and any the clients hold above (a U-shaped
        tail). The merged stages are loaded into the trunk too, so that both sides
        hold the same weights for every stage when cuts move next round; the trunk's
        momentum of the stages it did not train this round is dropped.
        """
        state, books = self.trunk.stage_state(), self.trunk.take_stage_samples()
        merged = merge_stages([*clients, trunk_copy(state, books)])
        self.trunk.load_stages(merged)
        # Momentum is kept only where the trunk trained this round: a stage every client
        # held itself was averaged on the devices, and the trunk's old direction is stale.
        self.trunk.forget_optimizer_state(i for i, n in enumerate(books) if n == 0)
        return client_stages(merged, state, clients, upto=upto)


class TrunkPerClient:
    """One trunk copy per client and round, merged over the clients that finished."""

    def __init__(self, trunk: Trunk) -> None:
        self.trunk = trunk
        self._copies: dict[str, Trunk] = {}
        # This round's finished clients in the order given, each with its copy (None:
        # it sent the trunk nothing), so that the merge can pair it with the client's.
        self._finished: list[Trunk | None] = []
        self._lock = threading.Lock()

    def trunk_for(self, client: str) -> Trunk:
        """Return ``client``'s copy, forking the global trunk on first use."""
        with self._lock:
            if client not in self._copies:
                self._copies[client] = self.trunk.fork()
            return self._copies[client]

    def finish_round(self, finished: Iterable[str]) -> None:
        """Keep the finished clients' copies for the merge; drop the others."""
        with self._lock:
            copies, self._copies = self._copies, {}
        self._finished = [t if (t := copies.get(c)) is not None and t.samples > 0 else None
                          for c in finished]

    def merge_round(self, clients: Sequence[StageCopy], *, upto: int) -> dict[str, Tensor]:
        """Merge client copies and the finished trunk copies per stage into the global trunk.

        ``clients`` are the copies of the clients :meth:`finish_round` was given, in
        the same order. Returns the clients' stages of the merged model, as
        :meth:`SharedTrunk.merge_round`.
        """
        finished, self._finished = self._finished, []
        kept = [t for t in finished if t is not None]
        merged = merge_stages(paired_copies(clients, finished))
        self.trunk.load_stages(merged)
        self.trunk.add_books(steps=sum(t.steps for t in kept),
                        samples=sum(t.samples for t in kept), busy_s=sum(t.busy_s for t in kept))
        return client_stages(merged, self.trunk.stage_state(), clients, upto=upto)


def paired_copies(clients: Sequence[StageCopy], trunks: Sequence[Trunk | None]) -> list[StageCopy]:
    """Return each client's copy followed by its trunk copy, client by client.

    Every stage then adds up its copies in client order, whichever side trained it,
    as FedAvg adds up whole models: the same sums to the bit whatever the cuts
    (float addition depends on its order; all client copies first, then all trunk
    copies, measured 1.7e-3 from FedAvg after 3 rounds of moving cuts). Lists that do
    not pair up (a caller that merges other clients than it finished) are merged
    clients first.
    """
    copies = [trunk_copy(t.stage_state(), t.take_stage_samples()) if t is not None else None
              for t in trunks]
    if len(clients) != len(copies):
        return [*clients, *(c for c in copies if c is not None)]
    return [c for pair in zip(clients, copies, strict=True) for c in pair if c is not None]


@dataclass(frozen=True)
class StepResult:
    """One batch through the trunk: the cut gradient, per-row losses and hits."""

    grad: Tensor
    losses: Tensor
    hits: Tensor


def train_on_batch(trunk: Trunk, cut: int, activations: Tensor, labels: Tensor) -> StepResult:
    """Forward, backward and update the stages above ``cut``; refuse a non-finite step."""
    acts = activations.detach().requires_grad_(True)
    with trunk.step(samples=len(labels), from_stage=cut) as backward:
        logits = trunk.run(acts, cut)
        losses = nn.functional.cross_entropy(logits, labels, reduction="none")
        backward(losses.mean(), labels=labels)
        assert acts.grad is not None
        if not math.isfinite(magnitude(acts.grad)):
            raise FrameError(Reason.STEP_NOT_FINITE, "the gradient at the cut is not finite")
    return StepResult(acts.grad, losses.detach(), logits.argmax(dim=1) == labels)


def admit(trunk: Trunk, client: str, server_round: int, what: str, cut: int, rows: Tensor
          ) -> None:
    """Pass a frame's rows through the trunk's guard, if it has one, before it learns from them.

    Raises
    ------
    FrameError
        ``OUT_OF_RANGE`` beyond the calibrated bound, ``QUARANTINED`` (see :mod:`server.guard`).
    """
    if trunk.guard is not None:
        trunk.guard.admit(client, server_round, what, cut, rows)


def checked_batch(
    part: pb.Forward | pb.Evaluate | pb.Smashed, *, trunk: Trunk, cut: int,
    dataplane: DataPlaneConfig,
) -> tuple[Tensor, Tensor]:
    """Decode a request's activations and labels, checked against the client's cut."""
    acts = check_activations(
        present(part, "activations"), cut_shape=trunk.cut_shape(cut),
        max_batch=dataplane.max_batch, max_bytes=dataplane.max_frame_bytes,
        max_abs=dataplane.max_abs_value,
    )
    labels = check_labels(
        present(part, "labels"), batch=len(acts), num_classes=trunk.num_classes,
        max_bytes=dataplane.max_frame_bytes,
    )
    return acts, labels


@torch.no_grad()
def evaluate_batch(trunk: Trunk, cut: int, activations: Tensor, labels: Tensor) -> pb.Metrics:
    """Mean loss and hits of one batch in eval mode, without an update."""
    with trunk.forward_only(train=False):
        logits = trunk.run(activations, cut)
    loss = float(nn.functional.cross_entropy(logits, labels))
    return pb.Metrics(loss=loss, correct=int((logits.argmax(dim=1) == labels).sum()))


def example_ids(part: pb.Forward | pb.Smashed, batch: int, *, feedback: FeedbackBook | None,
                max_bytes: int) -> Tensor | None:
    """Return a training frame's example ids under error feedback, else None (refusing any)."""
    sent: TensorMessage | None = present(part, "example_ids")
    if feedback is None:
        if sent is not None:
            raise FrameError(Reason.BAD_TENSOR, "example_ids sent, but this trunk runs "
                             "without error feedback (dataplane.compression.error_feedback)")
        return None
    return check_example_ids(sent, batch=batch, max_bytes=max_bytes)


def prepare_feedback(book: FeedbackBook, client: str, ids: Tensor, row_shape: tuple[int, ...],
                     part: pb.Forward | pb.Smashed, *,
                     feature_shape: tuple[int, ...] | None = None) -> ClientFeedback:
    """:meth:`FeedbackBook.prepare` at the frame's version and lineage (data-plane refusals)."""
    try:
        return book.prepare(client, ids, row_shape, version=int(part.feedback_version),
                            lineage=int(part.feedback_lineage), feature_shape=feature_shape)
    except StaleFeedback as err:
        raise FrameError(Reason.STALE_FEEDBACK, str(err)) from None
    except FeedbackFull as err:
        raise FrameError(Reason.TOO_LARGE, f"error feedback: {err}") from None


def round_trip(encode: Callable[[Tensor], object], tensor: Tensor, *, name: str, max_bytes: int
               ) -> tuple[object, Tensor]:
    """Encode ``tensor``; return its frame and what the receiver will decode from it."""
    frame = encode(tensor)
    return frame, decode_tensor(frame, name=name, max_bytes=max_bytes)


class SplitSession:
    """Answers ``forward`` with ``gradient`` and ``evaluate`` with ``metrics``.

    Parameters
    ----------
    pool : SharedTrunk | TrunkPerClient
        Which trunk each client trains.
    dataplane : DataPlaneConfig
        Batch size and value bounds for the activations.
    """

    def __init__(self, pool: SharedTrunk | TrunkPerClient, *, dataplane: DataPlaneConfig) -> None:
        self.pool = pool
        self.dataplane = dataplane
        self._encode = encoder(dataplane.compression, "downlink")  # the gradient at the cut
        #: The gradient's encoding and what the client will decode from it (error feedback).
        self._round_trip = partial(round_trip, self._encode, name="grad",
                                   max_bytes=dataplane.max_frame_bytes)
        #: Every client's per-example error feedback, kept across rounds (None: not used).
        self.feedback = FeedbackBook.for_compression(dataplane.compression)

    def handle(self, session: Session, request: AnyRequest) -> AnyReply:
        """Validate the batch against the client's cut, then train or evaluate."""
        kind = request.WhichOneof("kind")
        if kind not in ("forward", "evaluate"):
            raise FrameError(
                Reason.UNEXPECTED_KIND, f"split sessions send 'forward' or 'evaluate', not {kind!r}"
            )
        cut = session.grant.cut
        trunk = self.pool.trunk_for(session.grant.client)
        part = getattr(request, kind)
        acts, labels = checked_batch(part, trunk=trunk, cut=cut, dataplane=self.dataplane)
        if kind == "evaluate":
            return build(pb.Reply, metrics=evaluate_batch(trunk, cut, acts, labels))
        ids = example_ids(part, len(acts), feedback=self.feedback,
                          max_bytes=self.dataplane.max_frame_bytes)
        if ids is not None:
            return self._train_with_feedback(session, trunk, acts, labels, ids, part)
        admit(trunk, session.grant.client, session.grant.server_round, "activations", cut, acts)
        result = self.train(session, trunk, acts, labels)
        return self._gradient(result, self._encode(result.grad))

    def train(self, session: Session, trunk: Trunk, acts: Tensor, labels: Tensor) -> StepResult:
        """Step ``trunk`` on one batch (the hook a batching protocol overrides)."""
        return train_on_batch(trunk, session.grant.cut, acts, labels)

    def _train_with_feedback(self, session: Session, trunk: Trunk, acts: Tensor, labels: Tensor,
                             ids: Tensor, part: pb.Forward) -> AnyReply:
        """Train on reference + the sent difference; feed back what the gradient's frame drops."""
        assert self.feedback is not None
        client = session.grant.client
        # Checked and made room for first: a refusal leaves trunk and memory as they were.
        memory = prepare_feedback(self.feedback, client, ids, tuple(acts.shape[1:]), part)
        if memory.uplink is not None:
            acts = memory.uplink.reconstruct(ids, acts)
            check_finite(acts, name="activations", max_abs=self.dataplane.max_abs_value)
        admit(trunk, client, session.grant.server_round, "activations", session.grant.cut, acts)
        result = self.train(session, trunk, acts, labels)
        if memory.uplink is not None:
            memory.uplink.commit(ids, acts)
        frame = (self._encode(result.grad) if memory.downlink is None
                 else memory.downlink.compress(ids, result.grad, self._round_trip))
        dropped = self.feedback.keep(client, memory)
        return self._gradient(result, frame, feedback_dropped=dropped)

    @staticmethod
    def _gradient(result: StepResult, frame: object, *, feedback_dropped: bool = False
                  ) -> AnyReply:
        return reply("gradient", grad=frame, loss=float(result.losses.mean()),
                     correct=int(result.hits.sum()), feedback_dropped=feedback_dropped)

    def attach(self, session: Session) -> None:
        """Nothing kept per stream."""

    def detach(self, session: Session) -> None:
        """Nothing kept per stream (error feedback is kept per client, across rounds)."""

    def finish_round(self, finished: Iterable[str]) -> None:
        """Settle what the pool keeps per client (SplitFed v1)."""
        self.pool.finish_round(finished)

    def merge_round(
        self, updates: Sequence[tuple[Mapping[str, Tensor], int]], *, upto: int
    ) -> dict[str, Tensor]:
        """Merge the clients' ``(state, samples)`` with the trunk's copies, stage by stage.

        Returns stages ``[0, upto)`` of the merged model (see :mod:`splitlearn.merge`).
        """
        return self.pool.merge_round([client_copy(s, n) for s, n in updates], upto=upto)

    def take_turn(self, client: Mapping[str, Tensor], *, upto: int) -> dict[str, Tensor]:
        """Hand a finished sequential turn's stages to the trunk (see ``SharedTrunk``)."""
        return self.pool.take_turn(client, upto=upto)


@dataclass
class Slot:
    """One client's batch waiting at the barrier."""

    cut: int
    activations: Tensor
    labels: Tensor
    done: threading.Event = field(default_factory=threading.Event)
    result: StepResult | FrameError | None = None


class BatchingSplitSession(SplitSession):
    """One trunk step over the batches that the attached sessions send together.

    Parameters
    ----------
    pool : SharedTrunk
        The shared trunk.
    dataplane : DataPlaneConfig
        As for :class:`SplitSession`.
    timeout_s : float
        Longest a batch waits for the other attached sessions' batches.
    """

    def __init__(self, pool: SharedTrunk, *, dataplane: DataPlaneConfig, timeout_s: float) -> None:
        super().__init__(pool, dataplane=dataplane)
        self.timeout_s = timeout_s
        self.attached = 0
        self.steps = 0  # combined steps taken
        self._pending: list[Slot] = []
        self._cond = threading.Condition()

    def attach(self, session: Session) -> None:
        """One more session joins the barrier."""
        super().attach(session)
        with self._cond:
            self.attached += 1

    def detach(self, session: Session) -> None:
        """One session leaves; those waiting for it go ahead."""
        super().detach(session)
        with self._cond:
            self.attached -= 1
            if self._pending and len(self._pending) >= self.attached:
                self._flush()

    def train(self, session: Session, trunk: Trunk, acts: Tensor, labels: Tensor) -> StepResult:
        """Wait for the other attached sessions' batches (or the timeout), step together."""
        slot = Slot(session.grant.cut, acts, labels)
        with self._cond:
            self._pending.append(slot)
            if len(self._pending) >= max(self.attached, 1):
                self._flush()
            elif not self._cond.wait_for(slot.done.is_set, timeout=self.timeout_s):
                self._flush()  # the others are late: go with who is here
        if isinstance(slot.result, FrameError):
            raise slot.result
        assert slot.result is not None
        return slot.result

    def _flush(self) -> None:
        """One step per cut over the pending batches (condition held)."""
        pending, self._pending = self._pending, []
        for cut in sorted({s.cut for s in pending}):
            group = [s for s in pending if s.cut == cut]
            try:
                results = self.step_group(cut, group)
            except FrameError as err:
                results = [err] * len(group)
            self.steps += 1
            for slot, result in zip(group, results, strict=True):
                slot.result = result
                slot.done.set()
        self._cond.notify_all()

    def step_group(self, cut: int, group: list[Slot]) -> list[StepResult]:
        """Step on the union of ``group``'s batches; give each client its own batch's share."""
        sizes = [len(s.labels) for s in group]
        step = train_on_batch(
            self.pool.trunk_for("any"), cut, torch.cat([s.activations for s in group]),
            torch.cat([s.labels for s in group]),
        )
        total = sum(sizes)
        parts = zip(
            step.grad.split(sizes), step.losses.split(sizes), step.hits.split(sizes), strict=True
        )
        # The union's mean loss weights each row by 1/total; rescale so that each client
        # receives the gradient of its own batch's mean loss.
        return [StepResult(g * (total / len(loss)), loss, hit) for g, loss, hit in parts]



def shared_sessions(trunk: Trunk, options: StrategyConfig, dataplane: DataPlaneConfig
                    ) -> SplitSession:
    """Split sessions on one shared trunk (sequential SL)."""
    return SplitSession(SharedTrunk(trunk), dataplane=dataplane)


def per_client_sessions(
    trunk: Trunk, options: StrategyConfig, dataplane: DataPlaneConfig
) -> SplitSession:
    """Split sessions on a trunk copy per client (SplitFed v1)."""
    return SplitSession(TrunkPerClient(trunk), dataplane=dataplane)


def splitfed_v2_sessions(
    trunk: Trunk, options: StrategyConfig, dataplane: DataPlaneConfig
) -> SplitSession:
    """Split sessions on the shared trunk, batched over connected clients if asked."""
    if options.batch_concurrent:  # type: ignore[attr-defined]
        return BatchingSplitSession(
            SharedTrunk(trunk), dataplane=dataplane,
            timeout_s=options.barrier_timeout_s,  # type: ignore[attr-defined]
        )
    return SplitSession(SharedTrunk(trunk), dataplane=dataplane)
