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
* the devices' own word bounded and, as an option, their copies aggregated robustly
  (``aggregation.max_examples_ratio``, ``aggregation.robust``: :mod:`splitlearn.robust`):
  each finished device's claimed examples are capped at a multiple of the round's
  median claim before they weigh its copy, and a robust statistic may replace the
  weighted mean; what the defence did (claims capped, devices left out, copies
  trimmed, stages held) is in the round's metrics and the devices' rows;
* a :class:`RoundOutcome` per round (a row per sampled client and the aggregated
  metrics) handed to the ``on_round`` hook, which is how the reporter learns it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from torch import Tensor

from splitlearn.config import AggregationConfig, RunSpec, encode_spec
from splitlearn.messages import (
    DECLARED_PROFILE_RECORD,
    RECOMPUTE_KEY,
    ROUND_KEY,
    SPEC_KEY,
    STATUS_KEY,
    record_to_state,
    state_to_record,
    with_dtypes_of,
)
from splitlearn.optim import lr_factor
from splitlearn.robust import (
    SELECTING,
    Block,
    RobustRule,
    bound_claims,
    bound_updates,
    robust_blocks,
)

#: Statuses a reply can have, in report order.
STATUSES = ("ok", "straggler", "unavailable", "dropout", "memory", "refused", "budget", "privacy",
            "failed", "lost")
#: Why a client that was sent the round but never replied has status ``lost``.
LOST_REASON = "no reply within strategy.round_timeout_s (the node vanished or stalled)"
#: Metrics summed over clients (the rest are averaged, weighted by examples).
SUMMED_METRICS = ("num-examples", "steps", "bytes-up", "bytes-down", "weights-bytes-up",
                  "weights-bytes-down", "compute-s", "setup-s", "handler-s", "flops")
#: Metrics whose round value is the worst client's (the slowest device sets the pace).
MAX_METRICS = ("virtual-s", "epsilon", "epsilon-vs-server", "peak-memory-bytes")
#: A declared name longer than this is cut (it is the device's text, not a checked preset).
PROFILE_NAME_CHARS = 64
#: Per-client labels, meaningless when averaged.
CLIENT_ONLY_METRICS = ("partition-id", "cut", RECOMPUTE_KEY, "memory-budget", "round-examples",
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


@dataclass
class RoundDefence:
    """What the bound on claims and the robust rule did in one round, for its report.

    Parameters
    ----------
    bounded : bool
        Whether claims were bounded (``examples-capped`` is then reported, 0 included).
    robust : bool
        Whether a robust rule aggregated the round (``robust-*`` are then reported).
    counted : dict[int, float]
        Node -> the weight its claim was capped to.
    left_out : dict[int, int]
        Node -> the blocks a selecting method left its copy out of (every node a
        selecting method saw, 0 included).
    trimmed : int
        The most copies any block left out of a coordinate's mean.
    held : int
        Blocks with too few copies for the rule (they keep their previous weights).
    updates_bounded : bool
        Whether updates were bounded (``updates-shortened`` is then reported).
    shortened : dict[int, int]
        Node -> the modules whose update was shortened to the bound.
    """

    bounded: bool = False
    robust: bool = False
    counted: dict[int, float] = field(default_factory=dict)
    left_out: dict[int, int] = field(default_factory=dict)
    trimmed: int = 0
    held: int = 0
    updates_bounded: bool = False
    shortened: dict[int, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Return the round's metrics of the defence (none when it is off)."""
        metrics = {"examples-capped": float(len(self.counted))} if self.bounded else {}
        if self.updates_bounded:
            metrics["updates-shortened"] = float(len(self.shortened))
        if self.robust:
            metrics |= {"robust-left-out": float(sum(n > 0 for n in self.left_out.values())),
                        "robust-trimmed": float(self.trimmed), "robust-held": float(self.held)}
        return metrics

    def row(self, node: int) -> dict[str, Any]:
        """Return what ``node``'s row adds: its counted examples, blocks it was left out of."""
        row: dict[str, Any] = {}
        if node in self.counted:
            row["examples_counted"] = self.counted[node]
        if node in self.left_out:
            row["robust_left_out"] = self.left_out[node]
        if node in self.shortened:
            row["update_shortened"] = self.shortened[node]
        return row


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
    aggregation : AggregationConfig, optional
        How the devices' copies are weighed and aggregated (``aggregation.robust``,
        ``aggregation.max_examples_ratio``); without it, FedAvg's weighted mean of
        the claimed examples, unbounded.
    set_trunk_lr_factor : Callable[[float], None], optional
        Sets the trunk's learning-rate factor; called with ``strategy.schedule``'s factor
        as each training round starts (devices receive it in their round record).
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
        aggregation: AggregationConfig | None = None,
        set_trunk_lr_factor: Callable[[float], None] | None = None,
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
        #: Tells the trunk the schedule's factor each round (None: no trunk).
        self.set_trunk_lr_factor = set_trunk_lr_factor
        #: The schedule's factor of the round being trained (sent with it to every device).
        self.lr_factor = 1.0
        self._round_started = 0.0
        self._sent: dict[int, dict[str, tuple[tuple[int, ...], str]]] = {}  # node -> arrays
        #: The last training round's status of each node that replied.
        self.statuses: dict[int, str] = {}
        self._asked: list[Message] = []  # this round's train messages, as sent
        #: How many replies the last training round averaged.
        self.averaged = 0
        #: The robust statistic of the devices' copies (None: the weighted mean).
        self.robust = RobustRule.of(aggregation)
        #: A device's claimed examples count at most this x the round's median (0: unbounded).
        #: Not under SecAgg+: each device weighs its own update inside the masked sum, and
        #: every reply carries the same average, so a cap here would change nothing.
        self.max_examples_ratio = (aggregation.max_examples_ratio
                                   if aggregation is not None and not aggregation.secure else 0.0)
        #: A device's update of a module counts at most this x the round's median (0: any).
        #: Not under SecAgg+, for the same reason.
        self.max_update_ratio = (aggregation.max_update_ratio
                                 if aggregation is not None and not aggregation.secure else 0.0)
        self._round_arrays: ArrayRecord | None = None  # the global arrays of this round
        self._given: dict[int, ArrayRecord] = {}  # node -> the arrays it got this round
        #: What the defence did in the last training round.
        self.defence = RoundDefence()

    def summary(self) -> None:
        """Log FedAvg's settings plus the protocol's."""
        super().summary()
        log(INFO, "\t└──> Protocol %s: model %s, cut %d", self.protocol,
            self.spec.model._target_ or self.spec.model.name, self.spec.model.cut)
        if self.robust is not None:
            log(INFO, "\t└──> Robust aggregation %s, f=%d (per stage over its devices' copies)",
                self.robust.method, self.robust.num_malicious)

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
                "protocol": self.protocol, "lr_factor": self.lr_factor}

    def _typed(self, message: Message, server_round: int, kind: str) -> Message:
        node = message.metadata.dst_node_id
        config = ConfigRecord({**message.content[self.configrecord_key], SPEC_KEY: self._spec_text})
        arrays = self.client_arrays(node, message.content[self.arrayrecord_key])
        if kind == "train":
            self._sent[node] = arrays_signature(arrays)
            self._given[node] = arrays
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
        self.lr_factor = lr_factor(self.spec.strategy, server_round)
        if self.set_trunk_lr_factor is not None:
            self.set_trunk_lr_factor(self.lr_factor)
        messages = sorted(super().configure_train(server_round, arrays, config, grid),
                          key=lambda m: m.metadata.dst_node_id)
        ready = self.ready(grid, [m.metadata.dst_node_id for m in messages])
        kept = set(self.choose(server_round, ready))
        self._round_started = time.perf_counter()
        self._round_arrays = arrays
        self._given = {}
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

    def aggregate_arrays(self, server_round: int, finished: list[Message]) -> ArrayRecord | None:
        """Average the finished clients' arrays by examples, as FedAvg does (a hook).

        Each array keeps the dtype the clients sent: Flower's average turns
        integer buffers (batch norm's ``num_batches_tracked``) into float64,
        which the next round's clients would send back as int64 and be refused.
        Claims above the bound count as the bound; with ``aggregation.robust`` the
        robust statistic replaces the mean (None: every array held, the previous
        weights stay).
        """
        weights = self.bounded_weights(finished)
        states = None
        if self.robust is not None or self.max_update_ratio > 0:
            states = self.bounded_states(finished, [
                record_to_state(r.content[self.arrayrecord_key]) for r in finished])
        if self.robust is not None:
            assert states is not None
            blocks = self.robust_blocks(finished, list(zip(states, weights, strict=True)))
            return self.blocks_record(blocks, states[0])
        contents = [r.content for r in finished]
        if self.defence.shortened or any(
                w != float(reply_metrics(r)[self.weighted_by_key])
                for r, w in zip(finished, weights, strict=True)):
            contents = [RecordDict({
                self.arrayrecord_key: (state_to_record(states[i]) if states is not None
                                       and r.metadata.src_node_id in self.defence.shortened
                                       else r.content[self.arrayrecord_key]),
                "metrics": MetricRecord({self.weighted_by_key: float(w)})})
                for i, (r, w) in enumerate(zip(finished, weights, strict=True))]
        averaged = aggregate_arrayrecords(contents, self.weighted_by_key)
        return with_dtypes_of(averaged, finished[0].content[self.arrayrecord_key])

    def bounded_weights(self, finished: Sequence[Message]) -> list[float]:
        """Return each finished reply's weight: its claim, capped at the round's bound.

        A claim within ``max_examples_ratio`` x the round's median claim is returned
        as it is (so honest rounds average exactly as before); the others count as
        the bound, and their rows say so (``examples_counted``).
        """
        claims = [float(reply_metrics(r)[self.weighted_by_key]) for r in finished]
        bounded = bound_claims(claims, self.max_examples_ratio)
        self.defence.bounded = self.max_examples_ratio > 0
        for reply, claim, weight in zip(finished, claims, bounded, strict=True):
            if weight < claim:
                node = reply.metadata.src_node_id
                log(WARNING, "client %s claims %s %s; counted as %s (aggregation."
                    "max_examples_ratio=%s x the round's median)", node, claim,
                    self.weighted_by_key, weight, self.max_examples_ratio)
                self.defence.counted[node] = weight
        return bounded

    def bounded_states(self, finished: Sequence[Message],
                       states: Sequence[Mapping[str, Tensor]]) -> list[dict[str, Tensor]]:
        """Return ``finished``'s states, each update beyond the round's bound shortened.

        See :func:`splitlearn.robust.bound_updates` (``aggregation.max_update_ratio``);
        each shortened device is logged and its row says how many modules
        (``update_shortened``).
        """
        if self.max_update_ratio <= 0:
            return [dict(state) for state in states]
        given = [record_to_state(self._given[n]) if (n := r.metadata.src_node_id) in self._given
                 else {} for r in finished]
        bounded, shortened = bound_updates(states, given, self.max_update_ratio)
        self.defence.updates_bounded = True
        for reply, modules in zip(finished, shortened, strict=True):
            if modules:
                node = reply.metadata.src_node_id
                log(WARNING, "client %s: its update of %d module(s) was shortened to aggregation."
                    "max_update_ratio=%s x the round's median update", node, modules,
                    self.max_update_ratio)
                self.defence.shortened[node] = self.defence.shortened.get(node, 0) + modules
        return bounded

    def counted_contents(self, finished: Sequence[Message]) -> list[RecordDict]:
        """``finished``'s contents, each capped claim replaced by what the round counted.

        The round's metrics (train loss and accuracy, examples) are weighed as the
        arrays were: a device claiming a billion examples must not make its own loss
        the round's either.
        """
        contents = []
        for reply in finished:
            counted = self.defence.counted.get(reply.metadata.src_node_id)
            if counted is None:
                contents.append(reply.content)
                continue
            metrics = dict(reply_metrics(reply)) | {self.weighted_by_key: float(counted)}
            contents.append(RecordDict({"metrics": MetricRecord(metrics)}))
        return contents

    def robust_blocks(self, finished: Sequence[Message],
                      updates: Sequence[tuple[Mapping[str, Tensor], float]]) -> list[Block]:
        """Aggregate ``updates`` (``finished``'s copies, in order) with the robust rule.

        May be called more than once a round (local loss: the stages, then each
        cut's heads); :attr:`defence` adds up what each call did: the devices a
        selecting method left out of a block they held (``robust-left-out``; their
        rows' ``robust_left_out`` counts the blocks), the copies left out of each
        coordinate's mean (``robust-trimmed``, the most of any block) and the
        blocks with too few copies for the rule (``robust-held``, logged with why).
        """
        assert self.robust is not None
        blocks = robust_blocks(updates, self.robust)
        nodes = [r.metadata.src_node_id for r in finished]
        defence = self.defence
        defence.robust = True
        for block in blocks:
            if block.held is not None:
                defence.held += 1
                log(WARNING, "robust aggregation: %d array(s) from %r keep their previous "
                    "weights: %s", len(block.keys), block.keys[0], block.held)
                continue
            defence.trimmed = max(defence.trimmed, block.trimmed)
            if self.robust.method in SELECTING:
                for index in block.holders:
                    node = nodes[index]
                    defence.left_out[node] = (defence.left_out.get(node, 0)
                                              + (index not in block.kept))
        if left := sorted(n for n, count in defence.left_out.items() if count):
            log(INFO, "robust aggregation (%s) left out client(s) %s", self.robust.method, left)
        return blocks

    def blocks_record(self, blocks: Sequence[Block], order: Mapping[str, Tensor]
                      ) -> ArrayRecord | None:
        """Return the aggregated blocks as the round's arrays, keyed in ``order``'s order.

        A held block keeps this round's global arrays. None (Flower keeps the previous
        arrays, all of them) when a block is held and this strategy sent no global
        arrays this round (replies handed in without :meth:`configure_train`).
        """
        merged: dict[str, Tensor] = {}
        held = [b for b in blocks if b.held is not None]
        if held and self._round_arrays is None:
            return None
        global_state = record_to_state(self._round_arrays) if held and self._round_arrays else {}
        for block in blocks:
            merged |= (block.state if block.held is None
                       else {k: global_state[k] for k in block.keys})
        return state_to_record({k: merged[k] for k in order if k in merged})

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
        self.defence = RoundDefence()
        if finished:
            arrays = self.aggregate_arrays(server_round, finished)
            metrics = self.train_metrics_aggr_fn(self.counted_contents(finished),
                                                 self.weighted_by_key)
        report = dict(metrics or {"num-examples": 0.0}) | self.defence.metrics()
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
                    | self.defence.row(r.metadata.src_node_id)
                    for i, (r, s) in enumerate(zip(replies, statuses, strict=True))]
            rows += [{"client": node, "node_id": node, "status": "lost", "reason": reason}
                     for node, reason in lost.items()]
            self.on_round(RoundOutcome(
                server_round, rows, {k.replace("-", "_"): float(v) for k, v in report.items()},
                self.clients_in_parallel,
            ))
        return arrays, (MetricRecord(report) if metrics is not None else None)
