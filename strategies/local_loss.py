"""Local-loss split learning: clients never wait for the trunk.

Han et al. 2021, "Accelerating Federated Learning with Split Learning on
Locally Generated Losses". Each client trains its bottom stages against a small
auxiliary head of its own (no gradient comes back from the trunk) and hands the
smashed data (activations at the cut and labels) to the server, which trains
the trunk on it separately. Built on :class:`SplitFed` at its hooks:

* ``train_message_type`` is ``train.local_loss``; the client-side ArrayRecord
  holds the bottom's stages *and* the auxiliary head (``"aux.…"`` keys,
  :mod:`splitlearn.aux_head`), FedAvg'd together; :meth:`initial_arrays` adds
  the seeded head.
* **Streaming** (default): clients stream ``smashed`` frames one way over the
  data plane; the trunk trains on them asynchronously
  (:class:`server.async_trunk.AsyncTrunkTrainer`). The builder passes the
  trainer's ``finish_round`` as ``merge_round``: before the round is averaged
  and evaluated, queued batches of clients that did not finish are dropped and
  the rest trained.
* **Bulk** (``train_batch`` given): no data-plane session is used; each reply
  carries the round's smashed data as a second ArrayRecord
  (:data:`~splitlearn.smashed_stream.SMASHED_RECORD_KEY`). It is taken out of
  every reply before FedAvg (which wants one ArrayRecord per reply), and only
  the clients that finished are trained on, batch by batch, in an order shuffled
  by the seed and the round. Size: the reply grows by the round's activations,
  ``local_epochs x samples x cut bytes`` (digits, CNN cut 1: 8 KiB per sample, so
  about 2.3 MiB per client and epoch for 10 clients); Flower's gRPC transport in
  the Deployment Engine caps a message at 512 MiB, so large datasets or deep cuts
  should stream.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from splitlearn.aux_head import aux_state, build_aux_head
from splitlearn.models import SplittableModel
from splitlearn.smashed_stream import SMASHED_RECORD_KEY, unpack_smashed
from splitlearn.split import bottom_state
from splitlearn.wire import record_to_state, state_to_record
from strategies.failures import reply_metrics
from strategies.splitfed import SplitFed

log = logging.getLogger(__name__)

#: Trains the trunk on one batch: (client, cut, activations, labels); raises
#: ValueError (with the reason) for a batch it refuses.
TrainBatch = Callable[[str, int, torch.Tensor, torch.Tensor], None]


class LocalLossSplit(SplitFed):
    """Local-loss split learning on Flower's message API.

    Parameters
    ----------
    aux_hidden : int
        Hidden units of the auxiliary head (0: one linear layer).
    train_batch : TrainBatch, optional
        Bulk mode: trains the trunk on one batch of a reply's smashed data.
        Without it the clients stream (pass the async trainer's
        ``finish_round`` as ``merge_round``).
    **kwargs : Any
        Passed to :class:`SplitFed`.
    """

    train_message_type = "train.local_loss"

    def __init__(
        self, *, aux_hidden: int = 0, train_batch: TrainBatch | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.aux_hidden = aux_hidden
        self.train_batch = train_batch
        if train_batch is not None:
            if self.merge_round is not None:
                raise ValueError("bulk mode trains the trunk itself; pass no merge_round")
            self.merge_round = self._train_bulk
        #: Bulk mode, per round: batches trained and refused.
        self.bulk_batches: dict[int, dict[str, int]] = {}
        self._smashed: dict[str, tuple[int, ArrayRecord]] = {}
        self._round = 0

    def initial_arrays(self, model: SplittableModel) -> ArrayRecord:
        """Bottom stages plus a seeded auxiliary head (keys ``"aux.…"``)."""
        cut = self.task.cut
        head = build_aux_head(
            model.cut_shape(cut), model.num_classes, hidden=self.aux_hidden, seed=self.task.seed
        )
        return state_to_record(bottom_state(model, cut) | aux_state(head))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Set the bulk smashed data aside, then record, train the trunk and FedAvg."""
        replies = list(replies)
        self._round = server_round
        self._smashed = {}
        for reply in replies:
            if reply.has_error() or SMASHED_RECORD_KEY not in reply.content:
                continue
            smashed = reply.content.array_records[SMASHED_RECORD_KEY]
            del reply.content[SMASHED_RECORD_KEY]
            partition = int(reply_metrics(reply).get("partition-id", -1))
            self._smashed[str(reply.metadata.src_node_id)] = (partition, smashed)
        try:
            return super().aggregate_train(server_round, replies)
        finally:
            self._smashed = {}

    def _train_bulk(self, finished: list[str]) -> None:
        """Train the trunk on the finished clients' batches in a seeded shuffled order."""
        assert self.train_batch is not None
        batches: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        # Sorted by partition, so the order depends on the seed, not on node ids.
        for client in sorted(finished, key=lambda c: (self._smashed.get(c, (-1,))[0], c)):
            if client not in self._smashed:
                continue
            try:
                pairs = unpack_smashed(record_to_state(self._smashed[client][1]))
            except ValueError as err:
                log.warning("local_loss: client %s's smashed data refused: %s", client, err)
                continue
            batches += [(client, acts, labels) for acts, labels in pairs]
        random.Random(f"{self.task.seed}/{self._round}").shuffle(batches)
        counts = {"trained": 0, "refused": 0}
        for client, acts, labels in batches:
            try:
                self.train_batch(client, self.task.cut, acts, labels)
                counts["trained"] += 1
            except ValueError as err:
                counts["refused"] += 1
                log.warning("local_loss: a smashed batch of client %s refused: %s", client, err)
        self.bulk_batches[self._round] = counts
