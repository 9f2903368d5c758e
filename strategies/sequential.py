"""Vanilla (sequential) split learning: clients take turns on one trunk (Gupta & Raskar 2018).

Within a round the sampled clients train one after another; each starts from the
client-side weights the previous one finished with, and the round's result is the
last finished client's weights (no averaging). The turns are the grid's business,
not the aggregation's: :class:`TurnByTurnGrid` sends one message at a time and
hands each turn the latest weights, so ``aggregate_train`` does no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from splitlearn.config import StrategyConfig
from strategies.reporting import reply_status
from strategies.splitfed import SplitFed


@dataclass
class SequentialOptions(StrategyConfig):
    """Sequential split learning; ``round_timeout_s`` bounds each client's turn."""

    name: str = "sequential"


class TurnByTurnGrid(Grid):
    """A grid that sends training messages one at a time, chaining the weights.

    Parameters
    ----------
    grid : Grid
        The real grid.
    strategy : SequentialSplit
        Says which replies finished and where the weights are.
    """

    def __init__(self, grid: Grid, strategy: SequentialSplit) -> None:
        self.grid = grid
        self.strategy = strategy

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send evaluation as usual; training one turn at a time, from the latest weights."""
        messages = list(messages)
        if not messages or not messages[0].metadata.message_type.startswith("train"):
            return self.grid.send_and_receive(messages, timeout=timeout)
        replies: list[Message] = []
        latest: ArrayRecord | None = None
        for message in messages:
            if latest is not None:
                message = self.strategy.with_arrays(message, latest)
            replies += self.grid.send_and_receive([message], timeout=timeout)
            latest = self.strategy.last_finished(replies) or latest
        return replies

    # The rest of the Grid interface is the real grid's.
    def set_run(self, run):  # noqa: ANN001, ANN201, D102
        return self.grid.set_run(run)

    @property
    def run(self):  # noqa: ANN201, D102
        return self.grid.run

    def create_message(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201, D102
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self):  # noqa: ANN201, D102
        return self.grid.get_node_ids()

    def push_messages(self, messages):  # noqa: ANN001, ANN201, D102
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201, D102
        return self.grid.pull_messages(message_ids)


class SequentialSplit(SplitFed):
    """Sequential split learning on Flower's message API."""

    clients_in_parallel = False

    def wrap_grid(self, grid: Grid) -> Grid:
        """Take turns: one client after another."""
        return TurnByTurnGrid(grid, self)

    def last_finished(self, replies: list[Message]) -> ArrayRecord | None:
        """Return the weights of the last reply that finished, if any."""
        for reply in reversed(replies):
            if reply_status(reply, deadline_s=self.round_deadline_s) == "ok":
                return reply.content[self.arrayrecord_key]
        return None

    def with_arrays(self, message: Message, arrays: ArrayRecord) -> Message:
        """``message`` carrying ``arrays`` instead of the round's starting weights."""
        content = RecordDict({k: v for k, v in message.content.items()})
        content[self.arrayrecord_key] = arrays
        return Message(content=content, dst_node_id=message.metadata.dst_node_id,
                       message_type=message.metadata.message_type)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Report as every protocol does; the result is the last finished client's weights."""
        replies = list(replies)
        _, metrics = super().aggregate_train(server_round, replies)
        return (self.last_finished(replies) if metrics is not None else None), metrics
