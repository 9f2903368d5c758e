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

Every stage's replies are checked before Flower's workflow reads them: a device
whose reply is malformed is refused and treated as one that dropped out, which
SecAgg+ recovers from. The strategy then reads one reply per device as always
(its status and metrics; metrics are not masked), each carrying the round's
average: FedAvg of identical arrays returns them unchanged, so nothing else in
the strategy changes. What the
masking cannot do is check one device's arrays: a device may shift the average
by up to ``clipping_range`` per coordinate (SecAgg's known limit).

Only ``_Selected`` below speaks the legacy ``Strategy`` interface, because
Flower's workflow asks it which nodes take part and hands it the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.common import FitIns, Parameters, bytes_to_ndarray, log, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy as LegacyStrategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from splitlearn.config import AggregationConfig
from splitlearn.messages import ROUND_KEY, STATUS_KEY, with_dtypes_of
from strategies.grids import GridWrapper

#: Why a device that trained still has no weights in the round (the log says more).
HALTED_REASON = "no weights through secure aggregation this round: {why}"


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
        return ok and self._without_early_dropouts(state)

    def share_keys_stage(self, grid: Grid, context: LegacyContext, state) -> bool:  # noqa: ANN001
        """Share keys as Flower does; a node that dropped meanwhile leaves the round."""
        return super().share_keys_stage(grid, context, state) and \
            self._without_early_dropouts(state)

    @staticmethod
    def _without_early_dropouts(state) -> bool:  # noqa: ANN001
        """Leave out of the round the nodes that dropped before their key shares went out.

        Flower's workflow keeps them among the sampled nodes, so the unmask stage would
        ask their neighbours for key shares they never received and fail the round. No
        one's mask involves them (masks are built with the nodes a device got shares
        from), so they are not part of the sum at all.
        """
        state.sampled_node_ids = set(state.active_node_ids)
        return True

    def unmask_stage(self, grid: Grid, context: LegacyContext, state) -> bool:  # noqa: ANN001
        """Unmask as Flower does, unless no device put any weight in the sum."""
        if not any(fitres.num_examples for _, fitres in state.legacy_results):
            log(INFO, "secure aggregation: no device finished the round; nothing to unmask")
            return False  # Flower's division by the total weight would fail on 0
        return super().unmask_stage(grid, context, state)


#: What each stage's reply must hold (in SecAgg+'s config record): key -> (type, item type).
STAGE_FIELDS: tuple[dict[str, tuple[type, type | None]], ...] = (
    {Key.PUBLIC_KEY_1: (bytes, None), Key.PUBLIC_KEY_2: (bytes, None)},
    {Key.DESTINATION_LIST: (list, int), Key.CIPHERTEXT_LIST: (list, bytes)},
    {Key.MASKED_PARAMETERS: (list, bytes)},
    {Key.NODE_ID_LIST: (list, int), Key.SHARE_LIST: (list, bytes)},
)
#: Error code of a reply refused before Flower's workflow reads it.
MALFORMED_REPLY = 3


class _CheckedStages(GridWrapper):
    """Keeps each stage's replies, and turns a malformed one into an error reply.

    Flower's workflow reads the replies as the protocol says they are; one device
    sending another type, a list of another length, arrays of another shape or
    an unknown node id would stop the whole round with an exception. Refused
    here, that device counts as one that dropped out (SecAgg+ recovers from
    those), and the others' round goes on.

    Parameters
    ----------
    grid : Grid
        The real grid.
    shapes : list[tuple[int, ...]]
        Shapes of the arrays a device masks (its update), in order.
    nodes : set[int]
        The round's nodes (shares may only be of them, a dropped one's included).
    """

    def __init__(self, grid: Grid, shapes: list[tuple[int, ...]], nodes: set[int]) -> None:
        super().__init__(grid)
        self.shapes = [(1,), *shapes]  # SecAgg+ puts the device's weight first
        self.nodes = nodes
        self.stages: list[list[Message]] = []
        #: Node id -> why its reply was refused.
        self.refused: dict[int, str] = {}

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send, wait, check and keep the replies."""
        sent = {m.metadata.dst_node_id: m for m in messages}
        replies = []
        for reply in self.grid.send_and_receive(list(sent.values()), timeout=timeout):
            problem = None if reply.has_error() else self.problem(len(self.stages), reply)
            if problem is not None:
                node = reply.metadata.src_node_id
                log(WARNING, "secure aggregation: node %s refused: %s", node, problem)
                self.refused[node] = f"malformed SecAgg+ reply: {problem}"
                reply = (Message(Error(MALFORMED_REPLY, self.refused[node]), reply_to=sent[node])
                         if node in sent else None)
            if reply is not None:
                replies.append(reply)
        self.stages.append(replies)
        return replies

    def problem(self, stage: int, reply: Message) -> str | None:
        """Say what is wrong with a stage's reply, or None."""
        configs = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is None:
            return f"no {RECORD_KEY_CONFIGS!r} record"
        for key, (kind, item) in STAGE_FIELDS[stage].items():
            value = configs.get(key)
            if not isinstance(value, kind) or (item is not None and not all(
                    type(v) is item for v in value)):
                return f"{key!r} is not a {kind.__name__}" + (
                    f" of {item.__name__}" if item else "")
        if stage == 1 and len(configs[Key.DESTINATION_LIST]) != len(configs[Key.CIPHERTEXT_LIST]):
            return "destinations and ciphertexts differ in number"
        if stage == 2:
            return self._masked_problem(configs[Key.MASKED_PARAMETERS], reply)
        if stage == 3:
            owners = configs[Key.NODE_ID_LIST]
            if len(owners) != len(configs[Key.SHARE_LIST]):
                return "node ids and shares differ in number"
            if not set(owners) <= self.nodes:
                return f"shares of nodes outside the round {sorted(set(owners) - self.nodes)[:5]}"
        return None

    def _masked_problem(self, masked: list[bytes], reply: Message) -> str | None:
        try:
            arrays = [bytes_to_ndarray(b) for b in masked]
            compat.recorddict_to_fitres(reply.content, keep_input=True)
        except Exception as err:  # noqa: BLE001 - whatever the bytes are, they are refused
            return f"unreadable masked vector or FitRes ({type(err).__name__})"
        shapes = [a.shape for a in arrays]
        if shapes != self.shapes or any(a.dtype.kind not in "iu" for a in arrays):
            return f"masked arrays {shapes[:3]}... are not integer arrays of {self.shapes[:3]}..."
        return None


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
        recorder = _CheckedStages(
            self.grid, [tuple(a.shape) for a in messages[0].content["arrays"].values()],
            set(by_node))
        selected = _Selected(list(by_node), recorder)
        server_round = int(messages[0].content[ROUND_KEY]["server_round"])
        workflow = RoundSecAggPlus(
            {node: m.content for node, m in by_node.items()},
            num_shares=_count_or_fraction(self.settings.num_shares),
            reconstruction_threshold=_count_or_fraction(self.settings.reconstruction_threshold),
            max_weight=self.settings.max_weight, clipping_range=self.settings.clipping_range,
            quantization_range=self.settings.quantization_range, timeout=timeout,
        )
        why = ""
        try:
            workflow(recorder, _legacy_context(server_round, selected))
        except Exception as err:  # noqa: BLE001 - a round that cannot be unmasked keeps the weights
            log(WARNING, "secure aggregation failed in round %s: %r", server_round, err)
            selected.aggregated, why = None, f"{type(err).__name__}: {err}"
        masked = recorder.stages[2] if len(recorder.stages) > 2 else []
        if selected.aggregated is None and not why:
            why = "fewer devices than the reconstruction threshold, or none finished"
        replies = [self._as_protocol_reply(by_node, reply, selected.aggregated, why)
                   for reply in masked]
        trained = {r.metadata.src_node_id for r in replies}
        # Devices dropped in the key stages never got the round: say why, not "lost".
        return replies + [
            halted(m, recorder.refused.get(node, why or "it did not finish SecAgg+'s key stages"))
            for node, m in by_node.items() if node not in trained]

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
    """Return ``message``'s reply saying SecAgg+ has no weights of it: the device failed."""
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

