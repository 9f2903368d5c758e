"""A FedAvg that reports: every protocol's strategy starts from :class:`ReportingFedAvg`.

Flower's FedAvg samples clients, sends them the global (here: client-side) arrays
and averages the replies by examples. This adds what every protocol reports the
same way, at FedAvg's own hooks:

* messages typed ``train.<protocol>`` / ``evaluate.<protocol>`` that carry the run
  spec (built once per run) and the round's data (round, cut) as two records;
* a status per reply, read from its ``status`` record (a client that declined,
  vanished or was refused says so); only an error reply with no record is
  ``failed``, a reply past ``round_deadline_s`` virtual seconds is a
  ``straggler``, and one whose arrays are not what it was sent (other keys,
  shapes or dtypes — with per-client cuts, stages beyond its own — or values
  that are not finite) is ``refused``. Only ``ok`` replies are averaged, so
  nothing of a client's partial or malformed work reaches the weights;
* a :class:`RoundOutcome` per round (a row per sampled client and the aggregated
  metrics) handed to the ``on_round`` hook, which is how the reporter learns it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from splitlearn.config import AggregationConfig, RunSpec, encode_spec
from splitlearn.messages import (
    DECLARED_PROFILE_RECORD,
    ROUND_KEY,
    SPEC_KEY,
    STATUS_KEY,
    with_dtypes_of,
)

#: Statuses a reply can have, in report order.
STATUSES = ("ok", "straggler", "unavailable", "dropout", "memory", "refused", "budget", "privacy",
            "failed", "lost")
#: Why a client that was sent the round but never replied has status ``lost``.
LOST_REASON = "no reply within strategy.round_timeout_s (the node vanished or stalled)"
#: Metrics summed over clients (the rest are averaged, weighted by examples).
SUMMED_METRICS = ("num-examples", "steps", "bytes-up", "bytes-down", "weights-bytes-up",
                  "weights-bytes-down", "compute-s", "setup-s", "handler-s")
#: Metrics whose round value is the worst client's (the slowest device sets the pace).
MAX_METRICS = ("virtual-s", "epsilon", "epsilon-vs-server", "peak-memory-bytes")
#: A declared name longer than this is cut (it is the device's text, not a checked preset).
PROFILE_NAME_CHARS = 64
#: Per-client labels, meaningless when averaged.
CLIENT_ONLY_METRICS = ("partition-id", "cut", "checkpoint", "memory-budget", "round-examples",
                       "round-steps")


@dataclass(frozen=True)
class RoundOutcome:
    """What one training round produced, for whoever reports it.

    Parameters
    ----------
    server_round : int
        The round.
    rows : list[dict[str, Any]]
        One per sampled client: its status, reason, and metrics.
    metrics : dict[str, float]
        Aggregated metrics of the finished clients plus counts per status.
    parallel : bool
        Whether the clients trained at the same time (else their times add up).
    """

    server_round: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    parallel: bool = True


def reply_metrics(reply: Message) -> MetricRecord:
    """Return the reply's MetricRecord (empty for an error reply)."""
    if reply.has_error():
        return MetricRecord()
    return next(iter(reply.content.metric_records.values()), MetricRecord())


def reply_order(reply: Message) -> tuple[int, int, int]:
    """Sort key of a round's replies: by the client's partition, then by node id.

    A float sum depends on its order, so a round is averaged in an order that is
    the same in every run: the Simulation Engine draws new node ids each run, the
    partitions stay. Replies without a partition (errors) come after, by node id.
    """
    partition = reply_metrics(reply).get("partition-id")
    node = reply.metadata.src_node_id
    return (0, int(partition), node) if partition is not None else (1, 0, node)


def reply_status(reply: Message, *, deadline_s: float | None) -> str:
    """Return the reply's status: its status record, ``failed``, ``straggler`` or ``ok``."""
    if reply.has_error():
        return "failed"
    declined = reply.content.config_records.get(STATUS_KEY)
    if declined is not None:
        return str(declined["status"])
    if deadline_s is not None and float(reply_metrics(reply).get("virtual-s", 0.0)) > deadline_s:
        return "straggler"
    return "ok"


def arrays_signature(arrays: ArrayRecord) -> dict[str, tuple[tuple[int, ...], str]]:
    """Return each array's shape and dtype, by key: what a reply must send back."""
    return {key: (tuple(array.shape), array.dtype) for key, array in arrays.items()}


def arrays_problem(
    returned: ArrayRecord | None, sent: dict[str, tuple[tuple[int, ...], str]] | None
) -> str | None:
    """Say what is wrong with the arrays a client returned, or None.

    A client returns exactly the arrays it was sent (same keys, shapes and
    dtypes: with per-client cuts, no stage beyond its own), all finite.
    ``sent`` is None when this strategy sent the node nothing to compare with
    (replies built by hand); finiteness is checked all the same.
    """
    if returned is None:
        return "no weights in the reply"
    if sent is not None:
        extra, missing = sorted(set(returned) - set(sent)), sorted(set(sent) - set(returned))
        if extra or missing:
            return f"returned arrays it was not sent {extra[:5]}, left out {missing[:5]}"
    for key, array in returned.items():
        if sent is not None and (tuple(array.shape), array.dtype) != sent[key]:
            return f"array {key!r} is {array.dtype}{list(array.shape)}, expected {sent[key]}"
        values = array.numpy()
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            return f"array {key!r} is not finite"
    return None


def client_row(reply: Message, status: str) -> dict[str, Any]:
    """Return the per-client table row for ``reply``."""
    node = str(reply.metadata.src_node_id)
    row: dict[str, Any] = {"client": node, "node_id": node, "status": status}
    if reply.has_error():
        lines = reply.error.reason.strip().splitlines()  # the last line names the error
        return row | {"reason": lines[-1][:200] if lines else ""}
    if (declined := reply.content.config_records.get(STATUS_KEY)) is not None:
        row["reason"] = str(declined["reason"])
    if (declared := reply.content.config_records.get(DECLARED_PROFILE_RECORD)) is not None:
        row["profile"] = str(declared.get("name", ""))[:PROFILE_NAME_CHARS]
    metrics = reply_metrics(reply)
    # Partition ids are short and stable across runs; node ids are neither.
    if "partition-id" in metrics:
        row["partition_id"] = int(metrics["partition-id"])
        row["client"] = str(row["partition_id"])
    return row | {k.replace("-", "_"): v for k, v in metrics.items() if k != "partition-id"}


def aggregate_split_metrics(records: list[RecordDict], weighting_key: str) -> MetricRecord:
    """Sum counts, bytes and seconds; take the worst of times and epsilon; average the rest."""
    totals: dict[str, float] = {}
    first = [next(iter(r.metric_records.values())) for r in records]
    weight_sum = sum(float(m[weighting_key]) for m in first) or 1.0
    for metrics in first:
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


class ReportingFedAvg(FedAvg):
    """Flower's FedAvg with per-client reporting, statuses and ``<kind>.<protocol>`` messages.

    Parameters
    ----------
    protocol : str
        The protocol's name: message types are ``train.<protocol>`` and
        ``evaluate.<protocol>``.
    spec : RunSpec
        What clients need of the run (sent with every message).
    on_round : Callable[[RoundOutcome], None], optional
        Called once per training round with its outcome.
    round_deadline_s : float, optional
        Virtual seconds; a client reporting a longer ``virtual-s`` is a straggler.
    secure_aggregation : AggregationConfig, optional
        Deliver training rounds through SecAgg+ (``aggregation.secure``): the
        server learns only the average of the client-side weights.
    **fedavg_kwargs : Any
        Passed to :class:`flwr.serverapp.strategy.FedAvg`.
    """

    #: Whether the sampled clients train at the same time (the virtual clock then
    #: takes the slowest) or one after another (their times add up).
    clients_in_parallel = True

    def __init__(
        self,
        *,
        protocol: str,
        spec: RunSpec,
        on_round: Callable[[RoundOutcome], None] | None = None,
        round_deadline_s: float | None = None,
        secure_aggregation: AggregationConfig | None = None,
        **fedavg_kwargs: Any,
    ) -> None:
        fedavg_kwargs.setdefault("train_metrics_aggr_fn", aggregate_split_metrics)
        super().__init__(**fedavg_kwargs)
        self.protocol = protocol
        self.spec = spec
        self.on_round = on_round
        self.round_deadline_s = round_deadline_s
        self.secure_aggregation = secure_aggregation
        #: Adds server-side metrics to a round's report (a wrapper's: DP-FedAvg's epsilon).
        self.extra_metrics: Callable[[list[Message]], dict[str, float]] | None = None
        self._spec_text = encode_spec(spec)  # the same for every message of the run
        self._round_started = 0.0
        self._sent: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {}  # node -> arrays
        #: The last training round's status of each node that replied.
        self.statuses: dict[int, str] = {}
        self._asked: list[Message] = []  # this round's train messages, as sent
        #: How many replies the last training round averaged.
        self.averaged = 0

    def summary(self) -> None:
        """Log FedAvg's settings plus the protocol's."""
        super().summary()
        log(INFO, "\t└──> Protocol %s: model %s, cut %d", self.protocol,
            self.spec.model._target_ or self.spec.model.name, self.spec.model.cut)

    def wrap_grid(self, grid: Grid) -> Grid:
        """Return the grid this protocol sends through (a hook: sequential SL takes turns).

        With secure aggregation, training rounds go through SecAgg+'s stages.
        """
        if self.secure_aggregation is None:
            return grid
        from strategies.secure_aggregation import (
            SecureAggregationGrid,  # it reads this module's records
        )

        return SecureAggregationGrid(grid, self.secure_aggregation)

    def checkpoint(self) -> dict[str, Any]:
        """Return what carries over to the next round (a resumed run restores it)."""
        return {"statuses": dict(self.statuses)}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`checkpoint`'s state."""
        self.statuses = dict(saved["statuses"])

    def start(self, *, grid: Grid, **kwargs: Any) -> Any:
        """Flower's loop, over :meth:`wrap_grid`'s grid."""
        return super().start(grid=self.wrap_grid(grid), **kwargs)

    def round_record(self, node: int, server_round: int) -> dict[str, Any]:
        """Return the round's data for one client (split protocols add a session)."""
        return {"server_round": server_round, "cut": self.spec.model.cut,
                "protocol": self.protocol}

    def _typed(self, message: Message, server_round: int, kind: str) -> Message:
        node = message.metadata.dst_node_id
        config = ConfigRecord({**message.content[self.configrecord_key], SPEC_KEY: self._spec_text})
        arrays = self.client_arrays(node, message.content[self.arrayrecord_key])
        if kind == "train":
            self._sent[node] = arrays_signature(arrays)
        content = RecordDict({
            self.arrayrecord_key: arrays,
            self.configrecord_key: config,
            ROUND_KEY: ConfigRecord(self.round_record(node, server_round)),
        })
        return Message(content=content, dst_node_id=node, message_type=f"{kind}.{self.protocol}")

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample as FedAvg does, let :meth:`choose` keep some; type and fill each message."""
        # In node order, not the order Flower drew them in: tokens, and so trunk
        # workers, go to the same nodes in the same order whenever the node ids are
        # the same (the Simulation Engine draws new ones each run).
        messages = sorted(super().configure_train(server_round, arrays, config, grid),
                          key=lambda m: m.metadata.dst_node_id)
        ready = self.ready(grid, [m.metadata.dst_node_id for m in messages])
        kept = set(self.choose(server_round, ready))
        self._round_started = time.perf_counter()
        typed = [self._typed(m, server_round, "train") for m in messages
                 if m.metadata.dst_node_id in kept]
        self._asked = typed
        return typed

    def withdraw(self, nodes: Iterable[int]) -> None:
        """Forget that ``nodes`` were asked this round: a wrapper did not send their messages."""
        dropped = set(nodes)
        self._asked = [m for m in self._asked if m.metadata.dst_node_id not in dropped]

    def choose(self, server_round: int, nodes: list[int]) -> list[int]:
        """Return which of the sampled nodes train this round (a hook: a planner selects)."""
        return nodes

    def ready(self, grid: Grid, nodes: list[int]) -> list[int]:
        """Return the sampled nodes that can be asked now (a hook: node keys are learned)."""
        return nodes

    def client_arrays(self, node: int, arrays: ArrayRecord) -> ArrayRecord:
        """Return the part of the global arrays ``node`` gets (a hook: per-client cuts)."""
        return arrays

    def aggregate_arrays(self, server_round: int, finished: list[Message]) -> ArrayRecord:
        """Average the finished clients' arrays by examples, as FedAvg does (a hook).

        Each array keeps the dtype the clients sent: Flower's average turns
        integer buffers (batch norm's ``num_batches_tracked``) into float64,
        which the next round's clients would send back as int64 and be refused.
        """
        averaged = aggregate_arrayrecords([r.content for r in finished], self.weighted_by_key)
        return with_dtypes_of(averaged, finished[0].content[self.arrayrecord_key])

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation (off unless ``fraction_evaluate`` > 0), typed like training."""
        messages = list(super().configure_evaluate(server_round, arrays, config, grid))
        ready = set(self.ready(grid, [m.metadata.dst_node_id for m in messages]))
        return [self._typed(m, server_round, "evaluate") for m in messages
                if m.metadata.dst_node_id in ready]

    def finish_round(self, server_round: int, finished: list[Message]) -> None:
        """Settle the round with its finished replies, before they are averaged (a hook)."""

    def _refuse_bad_arrays(self, replies: list[Message], statuses: list[str]
                           ) -> dict[int, dict[str, str]]:
        """Mark ``refused`` the finished replies whose arrays are not what was sent back."""
        problems: dict[int, dict[str, str]] = {}
        for i, reply in enumerate(replies):
            if statuses[i] != "ok":
                continue
            returned = reply.content.array_records.get(self.arrayrecord_key)
            sent = self._sent.get(reply.metadata.src_node_id)
            if (problem := arrays_problem(returned, sent)) is not None:
                log(WARNING, "client %s refused: %s", reply.metadata.src_node_id, problem)
                statuses[i] = "refused"
                problems[i] = {"reason": problem}
        return problems

    def _own_replies(self, replies: list[Message]) -> tuple[list[Message], dict[int, str]]:
        """Split the replies into the asked nodes' own and the nodes lost, with why.

        A node that never replied is lost: Flower's grid gave up at the round's
        timeout, or the SuperLink answered for it (a node that stopped sending
        heartbeats gets an error reply from the SuperLink's id, not its own).
        """
        if not self._asked:  # not configured through configure_train (replies as given)
            return replies, {}
        asked = {m.metadata.dst_node_id for m in self._asked}
        by_message = {m.metadata.message_id: m.metadata.dst_node_id for m in self._asked}
        own = [r for r in replies if r.metadata.src_node_id in asked]
        replied = {r.metadata.src_node_id for r in own}
        lost = {m.metadata.dst_node_id: LOST_REASON for m in self._asked
                if m.metadata.dst_node_id not in replied}
        for reply in replies:
            node = by_message.get(reply.metadata.reply_to_message_id)
            if reply.metadata.src_node_id not in asked and node in lost and reply.has_error():
                lost[node] = f"{reply.error.reason} (reported by the SuperLink)"
        return own, lost

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Record every client, average those that finished, report the round."""
        replies, lost = self._own_replies(sorted(replies, key=reply_order))
        round_train_s = time.perf_counter() - self._round_started
        statuses = [reply_status(r, deadline_s=self.round_deadline_s) for r in replies]
        problems = self._refuse_bad_arrays(replies, statuses)
        self.statuses = {r.metadata.src_node_id: s for r, s in zip(replies, statuses, strict=True)}
        finished = [r for r, s in zip(replies, statuses, strict=True) if s == "ok"]
        self.averaged = len(finished)
        self.finish_round(server_round, finished)
        arrays, metrics = None, None
        if finished:
            arrays = self.aggregate_arrays(server_round, finished)
            metrics = self.train_metrics_aggr_fn([r.content for r in finished],
                                                 self.weighted_by_key)
        report = dict(metrics or {"num-examples": 0.0})
        for status in STATUSES[1:]:
            report[f"clients-{status}"] = statuses.count(status)
        report["clients-lost"] = len(lost)
        report["failed-clients"] = len(replies) + len(lost) - len(finished)
        # Server-side wall time from sending the round to having every reply.
        report["round-train-s"] = round_train_s
        if self.extra_metrics is not None and finished:
            report |= self.extra_metrics(finished)
        if self.on_round is not None:
            rows = [client_row(r, s) | problems.get(i, {})
                    for i, (r, s) in enumerate(zip(replies, statuses, strict=True))]
            rows += [{"client": node, "node_id": node, "status": "lost", "reason": reason}
                     for node, reason in lost.items()]
            self.on_round(RoundOutcome(
                server_round, rows, {k.replace("-", "_"): float(v) for k, v in report.items()},
                self.clients_in_parallel,
            ))
        return arrays, (MetricRecord(report) if metrics is not None else None)
