"""SplitFed with one shared trunk, as a small extension of Flower's FedAvg.

FedAvg already samples clients, sends them the global (here: client-side)
weights and averages the replies by examples. SplitFed adds, per client and
round, the data-plane session (trunk address, token, cut, training settings)
to the ``train.split`` message, revokes the round's tokens when the replies
are in, and keeps a per-client table of what each client reported. A client
that failed mid-round sends an error reply (or none): FedAvg ignores it, so
nothing of its partial work is aggregated into the client-side weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from splitlearn.models import SplittableModel
from splitlearn.split import bottom_state
from splitlearn.task import SplitTask
from splitlearn.wire import state_to_record
from strategies.failures import FAILURE_KINDS, client_row, reply_status, status_counts

#: Issues a token: (client id, cut, round) -> token.
IssueToken = Callable[[str, int, int], str]

#: Metrics summed over clients (the rest are averaged, weighted by examples).
SUMMED_METRICS = ("num-examples", "steps", "bytes-up", "bytes-down", "compute-s")
#: Metrics whose round value is the worst client's (the slowest device sets the pace).
MAX_METRICS = ("virtual-s", "epsilon")  # epsilon: the least private client's
#: Per-client labels, meaningless when averaged.
CLIENT_ONLY_METRICS = ("partition-id",)


def aggregate_split_metrics(records: list[RecordDict], weighting_key: str) -> MetricRecord:
    """Sum counts, bytes and seconds; average the rest weighted by ``weighting_key``."""
    totals: dict[str, float] = {}
    first_metrics = [next(iter(r.metric_records.values())) for r in records]
    weight_sum = sum(float(m[weighting_key]) for m in first_metrics) or 1.0
    for metrics in first_metrics:
        weight = float(metrics[weighting_key]) / weight_sum
        for key, value in metrics.items():
            if key in CLIENT_ONLY_METRICS:
                continue
            if key in MAX_METRICS:
                totals[key] = max(totals.get(key, float("-inf")), float(value))
                continue
            share = float(value) if key in SUMMED_METRICS else float(value) * weight
            totals[key] = totals.get(key, 0.0) + share
    totals["clients"] = float(len(records))
    return MetricRecord(totals)


class SplitFed(FedAvg):
    """SplitFed (v2: one trunk shared by all clients) on Flower's message API.

    Parameters
    ----------
    task : SplitTask
        Template of what clients receive; round, token and injected failure are
        filled in per client.
    issue_token : IssueToken
        Issues a data-plane token for (client, cut, round).
    revoke_round : Callable[[int], None]
        Revokes the tokens of a finished round.
    merge_round : Callable[[list[str]], None], optional
        Called with the ids of the clients that finished the round (e.g. to
        average per-client trunk copies, SplitFed v1).
    round_deadline_s : float, optional
        Virtual seconds; a client reporting a longer ``virtual-s`` is a
        straggler and is left out of the round like a failed one.
    **fedavg_kwargs : Any
        Passed to :class:`flwr.serverapp.strategy.FedAvg`.
    """

    #: Message type of the training message; protocols with another client
    #: behaviour (U-shaped, local loss) override it.
    train_message_type = "train.split"
    #: Whether the sampled clients train at the same time (the virtual clock then
    #: takes the slowest) or one after another (their times add up).
    clients_in_parallel = True

    def __init__(
        self,
        *,
        task: SplitTask,
        issue_token: IssueToken,
        revoke_round: Callable[[int], None],
        merge_round: Callable[[list[str]], None] | None = None,
        round_deadline_s: float | None = None,
        **fedavg_kwargs: Any,
    ) -> None:
        fedavg_kwargs.setdefault("train_metrics_aggr_fn", aggregate_split_metrics)
        super().__init__(**fedavg_kwargs)
        self.task = task
        self.issue_token = issue_token
        self.revoke_round = revoke_round
        self.merge_round = merge_round
        self.round_deadline_s = round_deadline_s
        #: Per round: one row per sampled client (its metrics, or its failure).
        self.client_rows: dict[int, list[dict[str, Any]]] = {}
        #: Per round: the aggregated training metrics.
        self.train_metrics: dict[int, MetricRecord] = {}
        self._round_started = 0.0

    def initial_arrays(self, model: SplittableModel) -> ArrayRecord:
        """Client-side weights that round 1 starts from (the stages below the cut)."""
        return state_to_record(bottom_state(model, self.task.cut))

    def summary(self) -> None:
        """Log the FedAvg settings plus the split settings."""
        super().summary()
        log(INFO, "\t└──> Split: model %s, cut %d", self.task.model, self.task.cut)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients as FedAvg does, then give each its own data-plane session."""
        messages = super().configure_train(server_round, arrays, config, grid)
        self._round_started = time.perf_counter()
        return [self._session_message(m, server_round, self.train_message_type) for m in messages]

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation through the trunk (off unless fraction_evaluate > 0)."""
        messages = super().configure_evaluate(server_round, arrays, config, grid)
        return [self._session_message(m, server_round, "evaluate") for m in messages]

    def _session_message(self, message: Message, server_round: int, kind: str) -> Message:
        node = message.metadata.dst_node_id
        task = replace(
            self.task,
            server_round=server_round,
            token=self.issue_token(str(node), self.task.cut, server_round),
        )
        config = ConfigRecord({**message.content[self.configrecord_key], **task.to_config()})
        content = RecordDict(
            {self.arrayrecord_key: message.content[self.arrayrecord_key],
             self.configrecord_key: config}
        )
        return Message(content=content, dst_node_id=node, message_type=kind)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Close the round's sessions, record every client, FedAvg those that finished."""
        replies = list(replies)
        round_train_s = time.perf_counter() - self._round_started
        self.revoke_round(server_round)
        statuses = [reply_status(r, deadline_s=self.round_deadline_s) for r in replies]
        self.client_rows[server_round] = [
            client_row(r, s) for r, s in zip(replies, statuses, strict=True)
        ]
        finished = [r for r, s in zip(replies, statuses, strict=True) if s == "ok"]
        if self.merge_round is not None:
            self.merge_round([str(r.metadata.src_node_id) for r in finished])
        arrays, metrics = super().aggregate_train(server_round, finished)
        if metrics is not None:
            counts = status_counts(statuses)
            metrics["failed-clients"] = len(replies) - counts["ok"]
            for status in ("straggler", *FAILURE_KINDS):
                metrics[f"clients-{status}"] = counts[status]
            # Server-side wall time from sending the round to having every reply.
            metrics["round-train-s"] = round_train_s
            self.train_metrics[server_round] = metrics
        return arrays, metrics

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Average client evaluations, then close the sessions."""
        metrics = super().aggregate_evaluate(server_round, replies)
        self.revoke_round(server_round)
        return metrics
