"""Vanilla (sequential) split learning: clients take turns on one trunk (Gupta & Raskar 2018).

Within a round the sampled clients train one after another; each starts from the
client-side weights the previous one finished with, and the round's result is the
last finished client's weights (no averaging). The turns are the grid's business,
not the aggregation's: :class:`TurnByTurnGrid` sends one message at a time and
hands each turn the latest weights, so ``aggregate_train`` does no I/O.

Clients may hold different cuts (``planner=``). After each finished turn (its
arrays checked as a reply's are) the client's stages replace the trunk's copies
(:meth:`server.sessions.split.SharedTrunk.take_turn`), so the trunk holds the
latest copy of every stage, and the next client is sent the stages below its own
cut from there: a stage the previous client trained on the device and the next
leaves to the trunk, or the reverse, moves with its latest weights. With one cut
for all this is the plain chain (each client starts from the last one's weights).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from splitlearn.messages import record_to_state, state_to_record
from strategies.grids import GridWrapper
from strategies.reporting import arrays_problem, reply_status
from strategies.splitfed import SplitFed


class TurnByTurnGrid(GridWrapper):
    """A grid that sends training messages one at a time, chaining the weights.

    Parameters
    ----------
    grid : Grid
        The real grid.
    strategy : SequentialSplit
        Says which replies finished and where the weights are.
    """

    def __init__(self, grid: Grid, strategy: SequentialSplit) -> None:
        super().__init__(grid)
        self.strategy = strategy

    def send_training(
        self, messages: list[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send training one turn at a time, from the latest weights."""
        replies: list[Message] = []
        latest: ArrayRecord | None = None
        for message in messages:
            if latest is not None:
                message = self.strategy.with_arrays(message, latest)
            turn = list(self.grid.send_and_receive([message], timeout=timeout))
            replies += turn
            latest = self.strategy.after_turn(turn) or latest
        return replies


class SequentialSplit(SplitFed):
    """Sequential split learning on Flower's message API."""

    clients_in_parallel = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: The global arrays after the round's last finished turn (None before one).
        self._latest: ArrayRecord | None = None

    def wrap_grid(self, grid: Grid) -> Grid:
        """Take turns: one client after another."""
        return TurnByTurnGrid(grid, self)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Start the round's chain from the global arrays."""
        self._latest = None
        return super().configure_train(server_round, arrays, config, grid)

    def after_turn(self, turn: list[Message]) -> ArrayRecord | None:
        """Hand a finished turn's stages to the trunk; return the latest global arrays.

        None when the turn did not finish, or its arrays are not what it was sent
        (``aggregate_train`` then marks it refused): the next client starts from
        the previous weights.
        """
        finished = [r for r in turn if reply_status(r, deadline_s=self.round_deadline_s) == "ok"]
        if not finished:
            return None
        reply = finished[-1]
        returned = reply.content.array_records.get(self.arrayrecord_key)
        if arrays_problem(returned, self._sent.get(reply.metadata.src_node_id)) is not None:
            return None
        take_turn = getattr(self.trunk, "take_turn", None)
        if take_turn is None:  # a trunk side without stages to hand over: the plain chain
            self._latest = returned
        else:
            self._latest = state_to_record(
                take_turn(record_to_state(returned), upto=self.global_cut))
        return self._latest

    def aggregate_arrays(self, server_round: int, finished: list[Message]) -> ArrayRecord:
        """Return the weights after the last finished turn (nothing is averaged)."""
        if self._latest is None:  # replies that did not come turn by turn
            return finished[-1].content[self.arrayrecord_key]
        return self._latest

    def with_arrays(self, message: Message, arrays: ArrayRecord) -> Message:
        """``message`` carrying ``arrays`` (the stages below its cut) instead of the round's."""
        content = RecordDict({k: v for k, v in message.content.items()})
        content[self.arrayrecord_key] = self.client_arrays(message.metadata.dst_node_id, arrays)
        return Message(content=content, dst_node_id=message.metadata.dst_node_id,
                       message_type=message.metadata.message_type)

