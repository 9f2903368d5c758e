"""Secure aggregation of the client-side weights: Flower's SecAgg+ under any averaging protocol.

With ``aggregation.secure`` the protocol's strategy builds its round as always, and
its grid (:class:`SecureAggregationGrid`) delivers the train messages through
Flower's own ``SecAggPlusWorkflow`` stages instead of one send:

0. setup and 1. share keys: every device makes its key pairs and sends each
   neighbour, through the server, encrypted shares of its secrets;
2. collect masked vectors: each device gets the protocol's own message (weights,
   run spec, session), trains as usual, and the ClientApp's ``train`` handler
   returns its *update* (new weights minus those it was sent), which Flower's
   ``secaggplus_mod`` quantises and masks before it leaves;
3. unmask: the devices send the shares that remove the masks of the round's
   devices (and of any that dropped out after stage 0), and the server recovers
   the weighted sum of the updates and nothing else.

The strategy then reads one reply per device as always (its status and metrics;
metrics are not masked), each carrying the round's average: FedAvg of identical
arrays returns them unchanged, so nothing else in the strategy changes. What the
masking cannot do is check one device's arrays: a device may shift the average
by up to ``clipping_range`` per coordinate (SecAgg's known limit).

Only ``_Selected`` below speaks the legacy ``Strategy`` interface, because
Flower's workflow asks it which nodes take part and hands it the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common import FitIns, Parameters, log, parameters_to_ndarrays
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from splitlearn.config import AggregationConfig
from strategies.grids import GridWrapper
from strategies.reporting import ROUND_KEY, STATUS_KEY, with_dtypes_of

#: Why a device that trained still has no weights in the round (the log says more).
HALTED_REASON = "secure aggregation halted before the masks were removed ({why})"


class _Selected(LegacyStrategy):
    """The legacy strategy Flower's workflow talks to: the round's nodes in, the sum out."""

    def __init__(self, nodes: list[int], grid: Grid) -> None:
        self.nodes = nodes
        self.grid = grid
        self.aggregated: Parameters | None = None

    def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201, D102
        return [(GridClientProxy(node, self.grid, 0), FitIns(parameters, {}))
                for node in self.nodes]

    def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001, ANN201, D102
        # Every result carries the unmasked average (the workflow sets it on each).
        self.aggregated = results[0][1].parameters if results else None
        return self.aggregated, {}

    def initialize_parameters(self, client_manager):  # noqa: ANN001, ANN201, D102
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201, D102
        return []

    def aggregate_evaluate(self, server_round, results, failures):  # noqa: ANN001, ANN201, D102
        return None, {}

    def evaluate(self, server_round, parameters):  # noqa: ANN001, ANN201, D102
        return None


class RoundSecAggPlus(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow for one round whose stage 2 carries the protocol's messages.

    Parameters
    ----------
    contents : dict[int, RecordDict]
        Node id -> the content of the protocol's train message for it.
    **params : Any
        ``SecAggPlusWorkflow``'s own parameters.
    """

    def __init__(self, contents: dict[int, RecordDict], **params: object) -> None:
        super().__init__(**params)  # type: ignore[arg-type]
        self.contents = contents

    def setup_stage(self, grid: Grid, context: LegacyContext, state) -> bool:  # noqa: ANN001
        """Set up as Flower does, then send each node the protocol's content in stage 2."""
        ok = super().setup_stage(grid, context, state)
        # The legacy path would send FitIns built from the legacy strategy.
        state.nid_to_fitins = {nid: self.contents[nid] for nid in state.nid_to_fitins}
        return ok

    def unmask_stage(self, grid: Grid, context: LegacyContext, state) -> bool:  # noqa: ANN001
        """Unmask as Flower does, unless no device put any weight in the sum."""
        if not any(fitres.num_examples for _, fitres in state.legacy_results):
            log(INFO, "secure aggregation: no device finished the round; nothing to unmask")
            return False  # Flower's division by the total weight would fail on 0
        return super().unmask_stage(grid, context, state)


class _Recorder(GridWrapper):
    """Keeps the replies of each send (one per SecAgg+ stage)."""

    def __init__(self, grid: Grid) -> None:
        super().__init__(grid)
        self.stages: list[list[Message]] = []

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send, wait and keep the replies."""
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.stages.append(replies)
        return replies


class SecureAggregationGrid(GridWrapper):
    """A grid that delivers train messages through SecAgg+ (evaluation as usual).

    Parameters
    ----------
    grid : Grid
        The real grid.
    settings : AggregationConfig
        ``aggregation`` (shares, threshold, ranges).
    """

    def __init__(self, grid: Grid, settings: AggregationConfig) -> None:
        super().__init__(grid)
        self.settings = settings

    def send_training(
        self, messages: list[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Run one round of SecAgg+ over the train messages; return one reply per device."""
        by_node = {m.metadata.dst_node_id: m for m in messages}
        recorder = _Recorder(self.grid)
        selected = _Selected(list(by_node), recorder)
        server_round = int(messages[0].content[ROUND_KEY]["server_round"])
        workflow = RoundSecAggPlus(
            {node: m.content for node, m in by_node.items()},
            num_shares=_count_or_fraction(self.settings.num_shares),
            reconstruction_threshold=_count_or_fraction(self.settings.reconstruction_threshold),
            max_weight=self.settings.max_weight, clipping_range=self.settings.clipping_range,
            quantization_range=self.settings.quantization_range, timeout=timeout,
        )
        workflow(recorder, _legacy_context(server_round, selected))
        masked = recorder.stages[2] if len(recorder.stages) > 2 else []
        why = ("" if selected.aggregated is not None else
               "fewer devices than the reconstruction threshold, or none finished")
        return [self._as_protocol_reply(by_node, reply, selected.aggregated, why)
                for reply in masked] or [halted(m, why or "no device reached stage 2")
                                        for m in messages]

    @staticmethod
    def _as_protocol_reply(by_node: dict[int, Message], reply: Message,
                           aggregated: Parameters | None, why: str) -> Message:
        """Give a stage-2 reply the protocol's layout: status, metrics and the round's average."""
        if reply.has_error():
            return reply
        sent = by_node[reply.metadata.src_node_id]
        content = RecordDict({"metrics": reply.content.metric_records.get("metrics",
                                                                          MetricRecord())})
        if (status := reply.content.config_records.get(STATUS_KEY)) is not None:
            content[STATUS_KEY] = status
        elif aggregated is None:
            return halted(sent, why)
        else:
            content["arrays"] = _applied(sent.content["arrays"], aggregated)
        reply.content = content
        return reply


def halted(message: Message, why: str) -> Message:
    """Return ``message``'s reply saying SecAgg+ halted: the device counts as failed."""
    log(WARNING, "secure aggregation: node %s has no weights this round: %s",
        message.metadata.dst_node_id, why)
    return Message(RecordDict({
        STATUS_KEY: ConfigRecord({"status": "failed", "reason": HALTED_REASON.format(why=why)}),
        "metrics": MetricRecord(),
    }), reply_to=message)


def _applied(sent: ArrayRecord, update: Parameters) -> ArrayRecord:
    """Return the arrays a device was sent plus the round's average update, in their dtypes."""
    deltas = parameters_to_ndarrays(update)
    summed = {key: Array(np.asarray(array.numpy(), dtype=np.float64) + delta)
              for (key, array), delta in zip(sent.items(), deltas, strict=True)}
    return with_dtypes_of(ArrayRecord(summed), sent)


def _count_or_fraction(value: float) -> int | float:
    """Flower's convention: an int is a count, a float a fraction."""
    return int(value) if value > 1 else float(value)


def _legacy_context(server_round: int, selected: _Selected) -> LegacyContext:
    """Return the context Flower's workflow reads the round from and reports to."""
    state = RecordDict({
        MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round}),
        MAIN_PARAMS_RECORD: ArrayRecord(),
    })
    context = Context(run_id=0, node_id=0, node_config={}, state=state, run_config={})
    return LegacyContext(context, strategy=selected)

