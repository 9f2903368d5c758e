"""Local-loss split learning: clients never wait for the trunk (Han et al. 2021).

Each client trains its bottom against a small auxiliary head of its own and hands
the smashed data (activations and labels) to the server, which trains the trunk
on it apart (see :mod:`clients.steps.local_loss` and :mod:`server.sessions.local_loss`).
Streamed, the trunk side drains its queue over the clients that finished when the
round ends. In bulk mode each reply also carries the round's smashed data as a
second ArrayRecord: it is taken out of every reply before FedAvg (which wants one
ArrayRecord per reply), and only the clients that finished are trained on, batch
by batch, in an order shuffled by the seed and the round. A reply grows by
``local_epochs x samples x cut bytes`` (digits, CNN cut 1: 8 KiB per sample);
Flower's gRPC transport caps a message at 512 MiB, so large datasets should stream.

Clients may hold different cuts (``planner=``): the global arrays keep one
auxiliary head per cut (:func:`splitlearn.aux_head.cut_aux_prefix`); each
client gets its cut's head and the stages below its cut, the trunk trains each
batch from the cut it came from, and at round end every stage is averaged over
the copies that trained it (the trunk's included, :mod:`splitlearn.merge`)
and every head over the clients at its cut. With equal cuts this is FedAvg of
the client sides, as before.
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Protocol

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from torch import Tensor

from splitlearn.aux_head import (
    AUX_PREFIX,
    cut_aux_prefix,
    heads_by_cut,
    keyed_heads,
    split_client_state,
    without_aux,
)
from splitlearn.merge import weighted_average
from splitlearn.messages import SMASHED_RECORD_KEY, record_to_state, state_to_record, unpack_smashed
from strategies.reporting import reply_metrics
from strategies.splitfed import SplitFed

log = logging.getLogger(__name__)


class BulkTrunk(Protocol):
    """What bulk mode needs of the trunk side."""

    def train_bulk(self, client: str, cut: int, activations: Tensor, labels: Tensor, *,
                   server_round: int) -> None:
        """Validate one batch like a frame and train on it (ValueError: refused)."""
        ...


class LocalLossSplit(SplitFed):
    """Local-loss split learning on Flower's message API."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: Bulk mode, per round: batches trained and refused.
        self.bulk_batches: dict[int, dict[str, int]] = {}
        self._smashed: dict[str, tuple[int, ArrayRecord]] = {}
        self._global = ArrayRecord()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Keep the round's global arrays: heads of cuts nobody trains stay as they are."""
        self._global = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def client_arrays(self, node: int, arrays: ArrayRecord) -> ArrayRecord:
        """Return the stages ``node`` holds at its cut and its cut's head (under ``aux.``)."""
        prefix = cut_aux_prefix(self.assignment(node).cut)
        stages = ArrayRecord(without_aux(arrays))
        head = {AUX_PREFIX + k[len(prefix):]: v for k, v in arrays.items()
                if k.startswith(prefix)}
        return ArrayRecord({**super().client_arrays(node, stages), **head})

    def aggregate_arrays(self, server_round: int, finished: list[Message]) -> ArrayRecord:
        """Merge the stages over every copy that trained them; average each cut's heads.

        Claimed examples and updates are bounded first. With a robust rule the stages go to the
        merge as :meth:`SplitFed.device_side` says, and each cut's heads (trained
        on the devices only) are aggregated by the rule over that cut's devices; a
        head with too few copies for it keeps its previous weights.
        """
        stage_updates, head_updates = [], defaultdict(list)
        heads_of: dict[int, list[Message]] = defaultdict(list)
        states = self.bounded_states(
            finished, [record_to_state(r.content[self.arrayrecord_key]) for r in finished])
        for reply, weight, state in zip(finished, self.bounded_weights(finished), states,
                                        strict=True):
            stages, head = split_client_state(state)
            samples = int(weight)
            stage_updates.append((stages, samples))
            cut = self.assignment(reply.metadata.src_node_id).cut
            head_updates[cut].append((head, samples))
            heads_of[cut].append(reply)
        merge = getattr(self.trunk, "merge_round", None)  # a trunk side may not merge
        _, heads = heads_by_cut(record_to_state(self._global))
        if self.robust is None:
            merged = (merge(stage_updates, upto=self.global_cut) if merge is not None
                      else weighted_average(stage_updates))
            heads |= {cut: weighted_average(parts) for cut, parts in head_updates.items()}
            return state_to_record(merged | keyed_heads(heads))
        device_side = self.device_side(finished, stage_updates)
        if merge is not None:
            merged = merge(device_side, upto=self.global_cut)
        else:  # no trunk copy to merge with: the devices' aggregate, held blocks as they were
            current = record_to_state(self._global)
            merged = {k: v if n > 0 else current[k] for state, n in device_side
                      for k, v in state.items()}
        for cut, parts in head_updates.items():
            blocks = self.robust_blocks(heads_of[cut], parts)
            if all(b.held is None for b in blocks):  # a cut's head is one block
                heads[cut] = {k: v for b in blocks for k, v in b.state.items()}
        return state_to_record(merged | keyed_heads(heads))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Set the bulk smashed data aside, then report, train the trunk and average."""
        replies = list(replies)
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

    def finish_round(self, server_round: int, finished: list[Message]) -> None:
        """Streaming: the trunk drains its queue. Bulk: train on the finished clients' data."""
        super().finish_round(server_round, finished)
        if self.spec.strategy.bulk:  # type: ignore[attr-defined]
            self._train_bulk(server_round, [str(r.metadata.src_node_id) for r in finished])

    def _train_bulk(self, server_round: int, finished: list[str]) -> None:
        trunk: BulkTrunk = self.trunk  # type: ignore[assignment]
        batches: list[tuple[str, Tensor, Tensor]] = []
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
        random.Random(f"{self.spec.seed}/{server_round}").shuffle(batches)
        counts = {"trained": 0, "refused": 0}
        for client, acts, labels in batches:
            try:
                trunk.train_bulk(client, self.assignment(int(client)).cut, acts, labels,
                                 server_round=server_round)
                counts["trained"] += 1
            except ValueError as err:
                counts["refused"] += 1
                log.warning("local_loss: a smashed batch of client %s refused: %s", client, err)
        self.bulk_batches[server_round] = counts
