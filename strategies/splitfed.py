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

import random
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from splitlearn.task import SplitTask

#: Issues a token: (client id, cut, round) -> token.
IssueToken = Callable[[str, int, int], str]

#: Metrics summed over clients (the rest are averaged, weighted by examples).
SUMMED_METRICS = ("num-examples", "steps", "bytes-up", "bytes-down", "compute-s")
#: Per-client labels, meaningless when averaged.
CLIENT_ONLY_METRICS = ("partition-id",)


def aggregate_split_metrics(records: list[RecordDict], weighting_key: str) -> MetricRecord:
    """Sum counts, bytes and seconds; average the rest weighted by ``weighting_key``."""
    totals: dict[str, float] = {}
    weight_sum = sum(float(_metrics(r)[weighting_key]) for r in records) or 1.0
    for record in records:
        metrics = _metrics(record)
        weight = float(metrics[weighting_key]) / weight_sum
        for key, value in metrics.items():
            if key in CLIENT_ONLY_METRICS:
                continue
            share = float(value) if key in SUMMED_METRICS else float(value) * weight
            totals[key] = totals.get(key, 0.0) + share
    totals["clients"] = float(len(records))
    return MetricRecord(totals)


def _metrics(record: RecordDict) -> MetricRecord:
    return next(iter(record.metric_records.values()))


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
    dropout_rate : float
        Probability that a sampled client is told to vanish mid-round
        (failure injection; 0 in normal runs).
    dropout_after_steps : int
        Batches a dropping client completes before vanishing.
    seed : int
        Seeds the failure injection.
    **fedavg_kwargs : Any
        Passed to :class:`flwr.serverapp.strategy.FedAvg`.
    """

    def __init__(
        self,
        *,
        task: SplitTask,
        issue_token: IssueToken,
        revoke_round: Callable[[int], None],
        dropout_rate: float = 0.0,
        dropout_after_steps: int = 2,
        seed: int = 0,
        **fedavg_kwargs: Any,
    ) -> None:
        fedavg_kwargs.setdefault("train_metrics_aggr_fn", aggregate_split_metrics)
        super().__init__(**fedavg_kwargs)
        self.task = task
        self.issue_token = issue_token
        self.revoke_round = revoke_round
        self.dropout_rate = dropout_rate
        self.dropout_after_steps = dropout_after_steps
        self.seed = seed
        #: Per round: one row per sampled client (its metrics, or its failure).
        self.client_rows: dict[int, list[dict[str, Any]]] = {}
        #: Per round: the aggregated training metrics.
        self.train_metrics: dict[int, MetricRecord] = {}
        self._round_started = 0.0

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
        rng = random.Random(self.seed * 7919 + server_round)
        return [self._session_message(m, server_round, rng, "train.split") for m in messages]

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation through the trunk (off unless fraction_evaluate > 0)."""
        messages = super().configure_evaluate(server_round, arrays, config, grid)
        return [self._session_message(m, server_round, None, "evaluate") for m in messages]

    def _session_message(
        self, message: Message, server_round: int, rng: random.Random | None, kind: str
    ) -> Message:
        node = message.metadata.dst_node_id
        drops = rng is not None and rng.random() < self.dropout_rate
        task = replace(
            self.task,
            server_round=server_round,
            token=self.issue_token(str(node), self.task.cut, server_round),
            fail_after_steps=self.dropout_after_steps if drops else -1,
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
        """Close the round's sessions, record per-client rows, then FedAvg."""
        replies = list(replies)
        round_train_s = time.perf_counter() - self._round_started
        self.revoke_round(server_round)
        self.client_rows[server_round] = [_client_row(r) for r in replies]
        arrays, metrics = super().aggregate_train(server_round, replies)
        if metrics is not None:
            metrics["failed-clients"] = sum(r.has_error() for r in replies)
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


def _client_row(reply: Message) -> dict[str, Any]:
    node = str(reply.metadata.src_node_id)
    if reply.has_error():
        return {"client": node, "node_id": node, "status": "failed",
                "reason": reply.error.reason[:200]}
    metrics: Mapping[str, Any] = _metrics(reply.content)
    # Partition ids are short and stable across runs; node ids are neither.
    client = str(int(metrics["partition-id"])) if "partition-id" in metrics else node
    return {"client": client, "node_id": node, "status": "ok"} | {
        k.replace("-", "_"): v for k, v in metrics.items() if k != "partition-id"
    }
