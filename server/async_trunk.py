"""Asynchronous trunk training on streamed smashed data (the ``local_loss`` protocol).

With local-loss split learning a client never waits for the trunk: it sends
each batch's activations and labels one way (a ``smashed`` frame) and trains
its bottom against its own auxiliary head. The trunk endpoint validates each
frame exactly like a ``forward`` one, puts it on :class:`AsyncTrunkTrainer`'s
bounded queue and answers at once with an ``ack``; a worker thread trains the
trunk on queued batches in arrival order (the gradient at the cut is
discarded).

Semantics:

* **Back-pressure.** The queue holds at most ``max_queue`` batches. A frame
  that arrives when it is full waits (so the stream stops reading and the
  client's send window fills up) for up to ``put_timeout_s`` seconds, then is
  refused with a reason.
* **Round end.** :meth:`AsyncTrunkTrainer.finish_round` is the strategy's
  ``merge_round`` hook, called with the clients that finished the round before
  the round is aggregated and evaluated. Batches still queued from clients that
  did *not* finish (failed, vanished, straggler, timed out) are dropped, the
  rest are trained, and it returns once the queue is empty and the worker idle
  (or after ``drain_timeout_s``, dropping what is left). Batches of a vanished
  client that were trained before the round ended stay applied, as trunk steps
  of a vanished client do in SplitFed v2.
* **Bulk mode** has no queue: the strategy hands every finished client's
  batches, in a seeded shuffled order, to :func:`train_smashed_batch`, which
  validates each one like a ``smashed`` frame and trains on it at once.
* **Threads.** The worker starts with the first batch of a round and stops when
  the round is drained, so no thread outlives a run that finished its rounds.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from splitlearn.wire import Frame, check_forward_frame

if TYPE_CHECKING:  # the endpoint imports this module
    from server.trunk_service import TrunkEndpoint

log = logging.getLogger(__name__)


class StepsTrunk(Protocol):
    """What the trainer needs of a trunk (``server.trunk.Trunk`` or a mode's trunk)."""

    def train_step(self, cut: int, activations: torch.Tensor, labels: torch.Tensor) -> object:
        """Forward, backward and update above ``cut``."""
        ...


class QueueFull(RuntimeError):
    """The trunk's queue stayed full for the whole put timeout."""


@dataclass(frozen=True)
class _Batch:
    client: str
    trunk: StepsTrunk
    cut: int
    activations: torch.Tensor
    labels: torch.Tensor


class AsyncTrunkTrainer:
    """A bounded queue of smashed batches and the worker that trains the trunk on them.

    Parameters
    ----------
    max_queue : int
        Most batches waiting to be trained (memory: ``max_queue`` times one
        batch of activations).
    put_timeout_s : float
        Longest a submitted batch waits for room in the queue before it is refused.
    drain_timeout_s : float
        Longest :meth:`finish_round` waits for the queue to drain.
    """

    def __init__(
        self, *, max_queue: int = 256, put_timeout_s: float = 60.0, drain_timeout_s: float = 600.0
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.put_timeout_s = put_timeout_s
        self.drain_timeout_s = drain_timeout_s
        #: Batches trained, per client (cumulative over rounds).
        self.trained: Counter[str] = Counter()
        #: Batches dropped at round end, per client (cumulative over rounds).
        self.dropped: Counter[str] = Counter()
        #: Batches whose trunk step raised (logged; the worker carries on).
        self.errors = 0
        self._queue: deque[_Batch] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._stopping = False
        self._worker: threading.Thread | None = None

    @property
    def pending(self) -> int:
        """Batches queued or being trained right now."""
        with self._cond:
            return len(self._queue) + int(self._busy)

    def submit(
        self,
        client: str,
        trunk: StepsTrunk,
        cut: int,
        activations: torch.Tensor,
        labels: torch.Tensor,
    ) -> int:
        """Queue one validated batch for training; return the queue length after it.

        Blocks while the queue is full (back-pressure on the client's stream).

        Raises
        ------
        QueueFull
            If no room appeared within ``put_timeout_s`` seconds.
        """
        batch = _Batch(client, trunk, cut, activations, labels)
        with self._cond:
            if not self._cond.wait_for(
                lambda: len(self._queue) < self.max_queue, timeout=self.put_timeout_s
            ):
                raise QueueFull(
                    f"the trunk's queue stayed full ({self.max_queue} batches) for "
                    f"{self.put_timeout_s:g} s"
                )
            self._queue.append(batch)
            self._stopping = False
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="trunk-async", daemon=True
                )
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
                self._cond.notify_all()  # room for a waiting submit
            try:
                batch.trunk.train_step(batch.cut, batch.activations, batch.labels)
                failed = False
            except Exception:  # validated input should never fail; keep serving others
                log.exception("async trunk: a step on client %s's batch failed", batch.client)
                failed = True
            with self._cond:
                self._busy = False
                if failed:
                    self.errors += 1
                else:
                    self.trained[batch.client] += 1
                self._cond.notify_all()

    def finish_round(self, finished: Iterable[str]) -> None:
        """Drop queued batches of clients not in ``finished``; train the rest; wait.

        Parameters
        ----------
        finished : Iterable[str]
            Client ids whose round counts (the strategy's ``merge_round`` hook).
        """
        keep = set(finished)
        with self._cond:
            self._drop(lambda b: b.client not in keep)
            drained = self._cond.wait_for(
                lambda: not self._queue and not self._busy, timeout=self.drain_timeout_s
            )
            if not drained:
                log.warning(
                    "async trunk: queue not drained within %.0f s; dropping %d batches",
                    self.drain_timeout_s, len(self._queue),
                )
                self._drop(lambda b: True)
            self._stopping = True  # the worker exits once idle; the next round starts one
            self._cond.notify_all()

    def _drop(self, which) -> None:  # noqa: ANN001 - a predicate over _Batch (lock held)
        kept: deque[_Batch] = deque()
        for batch in self._queue:
            if which(batch):
                self.dropped[batch.client] += 1
            else:
                kept.append(batch)
        self._queue = kept
        self._cond.notify_all()


def train_smashed_batch(
    endpoint: TrunkEndpoint, client: str, cut: int, activations: torch.Tensor,
    labels: torch.Tensor,
) -> None:
    """Validate one batch of bulk smashed data like a ``smashed`` frame; train on it.

    Raises
    ------
    FrameError
        Naming the first violated rule; the trunk is untouched and the
        refusal is counted in ``endpoint.rejected``.
    """
    frame = Frame("smashed", {"activations": activations, "labels": labels})
    try:
        acts, checked = check_forward_frame(
            frame, cut_shape=endpoint.trunk.cut_shape(cut),
            num_classes=endpoint.trunk.model.num_classes, max_batch=endpoint.max_batch,
        )
    except ValueError:
        endpoint.rejected[client] += 1
        raise
    assert checked is not None
    endpoint.mode.trunk_for(client).train_step(cut, acts, checked)
