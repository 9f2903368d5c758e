"""Smashed-data sessions: the trunk trains on streamed activations on its own time.

With local-loss split learning (Han et al. 2021) a client never waits for the
trunk: it sends each batch's activations and labels one way (``smashed``). The
session validates a frame exactly like a split ``forward``, puts the batch on a
queue and answers ``ack`` at once; a worker thread trains the trunk on queued
batches in arrival order (the gradient at the cut is discarded).

* **Back-pressure.** The queue holds at most ``max_queue_bytes`` of activations
  and labels *as stored* (float32: a float16 frame doubles once queued). A batch
  that does not fit waits up to ``put_timeout_s`` (so the stream stops reading
  and the client's window fills), then is refused with ``BUSY``.
* **Round end.** :meth:`SmashedSession.finish_round` drops the queued batches of
  clients that did not finish, trains the rest and returns once the queue is
  empty (or after ``drain_timeout_s``, dropping what is left). Batches of a
  vanished client trained before the round ended stay applied, as trunk steps of
  a vanished client do in SplitFed v2.
* **Error feedback** (a lossy uplink with ``dataplane.compression.error_feedback``):
  the frame's activations are the compressed difference from the client's references,
  which move when the frame is queued (before its ack), as the device's moved when it
  sent it. A refusal leaves them; the device learns of it behind the frames in flight,
  which the stale rule then refuses too (see :meth:`FeedbackBook.prepare`).
* **Bulk mode** has no stream: the strategy hands every finished client's
  batches to :meth:`SmashedSession.train_bulk`, which validates each like a
  ``smashed`` frame and trains on it at once.
* **Threads.** The worker starts with a round's first batch and stops once the
  round is drained, so no thread outlives a run.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from protocols.local_loss import LocalLossOptions
from server.sessions.split import (
    SharedTrunk,
    admit,
    checked_batch,
    example_ids,
    prepare_feedback,
    train_on_batch,
)
from server.trunk import Trunk
from splitlearn.config import DataPlaneConfig
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import (
    AnyReply,
    AnyRequest,
    FrameError,
    Reason,
    build,
    check_finite,
    encode_tensor,
)
from splitlearn.dataplane.endpoint import Session
from splitlearn.dataplane.feedback import FeedbackBook
from splitlearn.dataplane.frames import Frame
from splitlearn.merge import client_copy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Batch:
    client: str
    cut: int
    activations: Tensor
    labels: Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.activations, self.labels))


class SmashedSession:
    """Queues validated ``smashed`` batches and trains the shared trunk on them.

    Parameters
    ----------
    pool : SharedTrunk
        The shared trunk.
    dataplane : DataPlaneConfig
        Batch size and value bounds.
    max_queue_bytes : int
        Most bytes of batches waiting to be trained.
    put_timeout_s : float
        Longest a batch waits for room before it is refused.
    drain_timeout_s : float
        Longest :meth:`finish_round` waits for the queue to drain.
    """

    def __init__(
        self, pool: SharedTrunk, *, dataplane: DataPlaneConfig, max_queue_bytes: int,
        put_timeout_s: float = 60.0, drain_timeout_s: float = 600.0,
    ) -> None:
        if max_queue_bytes < 1:
            raise ValueError(f"max_queue_bytes must be >= 1, got {max_queue_bytes}")
        self.pool = pool
        self.trunk: Trunk = pool.trunk
        self.dataplane = dataplane
        self.max_queue_bytes = max_queue_bytes
        self.put_timeout_s = put_timeout_s
        self.drain_timeout_s = drain_timeout_s
        #: Batches trained and dropped at round end, per client (cumulative).
        self.trained: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        #: Batches whose step was refused (not finite) or failed; logged, the worker goes on.
        self.errors = 0
        self._queue: deque[_Batch] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._worker: threading.Thread | None = None
        #: Every client's activation references (lossy uplink with error feedback), or None.
        self.feedback = FeedbackBook.for_compression(dataplane.compression, gradient=False)

    def _checked(self, client: str, cut: int, part: Frame | pb.Smashed) -> _Batch:
        acts, labels = checked_batch(part, trunk=self.trunk, cut=cut, dataplane=self.dataplane)
        return _Batch(client, cut, acts, labels)

    def handle(self, session: Session, request: AnyRequest) -> AnyReply:
        """Validate a ``smashed`` frame like a split ``forward``, queue it, ``ack`` at once."""
        if request.WhichOneof("kind") != "smashed":
            raise FrameError(Reason.UNEXPECTED_KIND, "local-loss sessions send 'smashed', not "
                             f"{request.WhichOneof('kind')!r}")
        part = request.smashed
        batch = self._checked(session.grant.client, session.grant.cut, part)
        ids = example_ids(part, len(batch.labels), feedback=self.feedback,
                          max_bytes=self.dataplane.max_frame_bytes)
        if ids is None:
            admit(self.trunk, batch.client, session.grant.server_round, "activations",
                  batch.cut, batch.activations)
            return pb.Reply(ack=pb.Ack(queued=self._submit(batch)))
        return self._submit_with_feedback(batch, ids, part, server_round=session.grant.server_round)

    def _submit_with_feedback(self, batch: _Batch, ids: Tensor, part: Frame | pb.Smashed, *,
                              server_round: int) -> AnyReply:
        """Queue reference + the sent difference; the references move once it is queued."""
        assert self.feedback is not None
        # Checked and made room for first: a refusal leaves the references as they were.
        memory = prepare_feedback(self.feedback, batch.client, ids,
                                  tuple(batch.activations.shape[1:]), part)
        assert memory.uplink is not None
        acts = memory.uplink.reconstruct(ids, batch.activations)
        check_finite(acts, name="activations", max_abs=self.dataplane.max_abs_value)
        admit(self.trunk, batch.client, server_round, "activations", batch.cut, acts)
        queued = self._submit(_Batch(batch.client, batch.cut, acts, batch.labels))
        memory.uplink.commit(ids, acts)
        dropped = self.feedback.keep(batch.client, memory)
        return pb.Reply(ack=pb.Ack(queued=queued, feedback_dropped=dropped))

    @property
    def pending(self) -> int:
        """Batches queued or being trained right now."""
        with self._cond:
            return len(self._queue) + int(self._busy)

    def _submit(self, batch: _Batch) -> int:
        if batch.nbytes > self.max_queue_bytes:
            raise FrameError(Reason.TOO_LARGE, f"a batch of {batch.nbytes} bytes can never fit "
                             f"the trunk's queue of {self.max_queue_bytes}")
        with self._cond:
            if not self._cond.wait_for(
                lambda: self._queued_bytes + batch.nbytes <= self.max_queue_bytes,
                timeout=self.put_timeout_s,
            ):
                raise FrameError(Reason.BUSY, f"the trunk's queue stayed full "
                                 f"({self.max_queue_bytes} bytes) for {self.put_timeout_s:g} s")
            self._queue.append(batch)
            self._queued_bytes += batch.nbytes
            self._stopping = False
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name="trunk-async", daemon=True)
                self._worker.start()
            self._cond.notify_all()
            return len(self._queue)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:  # stopping, nothing left
                    self._worker = None
                    self._cond.notify_all()
                    return
                batch = self._queue.popleft()
                self._busy = True
            ok = self._train(batch)
            with self._cond:
                self._busy = False
                self._queued_bytes -= batch.nbytes
                self.trained[batch.client] += ok
                self._cond.notify_all()  # room for a waiting submit; maybe drained

    def _train(self, batch: _Batch) -> bool:
        try:
            train_on_batch(self.trunk, batch.cut, batch.activations, batch.labels)
            return True
        except Exception as err:  # noqa: BLE001 - validated input should not fail; keep serving
            log.warning("local loss: a step on client %s's batch failed: %s", batch.client, err)
            self.errors += 1
            return False

    def finish_round(self, finished: Iterable[str]) -> None:
        """Drop queued batches of clients not in ``finished``; train the rest; wait."""
        keep = set(finished)
        with self._cond:
            self._drop(lambda b: b.client not in keep)
            if not self._cond.wait_for(
                lambda: not self._queue and not self._busy, timeout=self.drain_timeout_s
            ):
                log.warning("local loss: queue not drained within %.0f s; dropping %d batches",
                            self.drain_timeout_s, len(self._queue))
                self._drop(lambda b: True)
            self._stopping = True  # the worker exits once idle; the next round starts one
            self._cond.notify_all()

    def _drop(self, which: Callable[[_Batch], bool]) -> None:
        kept: deque[_Batch] = deque()
        for batch in self._queue:
            if which(batch):
                self.dropped[batch.client] += 1
                self._queued_bytes -= batch.nbytes
            else:
                kept.append(batch)
        self._queue = kept
        self._cond.notify_all()

    def merge_round(
        self, updates: Sequence[tuple[Mapping[str, Tensor], int]], *, upto: int
    ) -> dict[str, Tensor]:
        """Merge the clients' stages with the trunk's copy, per stage (after the drain).

        See :meth:`server.sessions.split.SharedTrunk.merge_round`: a stage is
        averaged over every copy that trained it, so with equal cuts the client
        stages are FedAvg'd and the trunk keeps its own.
        """
        return self.pool.merge_round([client_copy(s, n) for s, n in updates], upto=upto)

    def train_bulk(self, client: str, cut: int, activations: Tensor, labels: Tensor, *,
                   server_round: int) -> None:
        """Bulk mode: validate one batch of a reply's smashed data like a frame; train on it.

        Raises
        ------
        FrameError
            Naming the first violated rule; the trunk is untouched.
        """
        part = build(pb.Smashed, activations=encode_tensor(activations),
                     labels=encode_tensor(labels))
        batch = self._checked(client, cut, part)
        admit(self.trunk, client, server_round, "activations", cut, batch.activations)
        train_on_batch(self.trunk, cut, batch.activations, batch.labels)
        self.trained[client] += 1

    def attach(self, session: Session) -> None:
        """Nothing kept per stream."""

    def detach(self, session: Session) -> None:
        """Queued batches stay until the round ends (the client may still finish)."""


def local_loss_sessions(
    trunk: Trunk, options: LocalLossOptions, dataplane: DataPlaneConfig
) -> SmashedSession:
    """Smashed-data sessions with a queue of ``strategy.queue_bytes``."""
    return SmashedSession(
        SharedTrunk(trunk), dataplane=dataplane, max_queue_bytes=options.queue_bytes,
        put_timeout_s=options.put_timeout_s, drain_timeout_s=options.round_timeout_s,
    )
