"""Vanilla (sequential) split learning: clients take turns on one trunk.

Within a round the sampled clients train one after another; each starts from
the client-side weights the previous one finished with, passed through the
server. The round's result is the last finished client's weights (no
averaging). Built on :class:`SplitFed` at its hooks: ``configure_train`` sends
the first turn, ``aggregate_train`` runs the remaining turns on the grid it was
given, then lets SplitFed record and summarise every reply.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from strategies.failures import reply_status
from strategies.splitfed import SplitFed


class SequentialSplit(SplitFed):
    """Sequential split learning (Gupta & Raskar 2018) on Flower's message API.

    Parameters
    ----------
    turn_timeout_s : float
        Longest the server waits for one client's turn.
    **kwargs : Any
        Passed to :class:`SplitFed`.
    """

    clients_in_parallel = False

    def __init__(self, *, turn_timeout_s: float = 600.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.turn_timeout_s = turn_timeout_s
        self._grid: Grid | None = None
        self._waiting: list[Message] = []

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample and prepare every turn; send only the first."""
        messages = list(super().configure_train(server_round, arrays, config, grid))
        self._grid, self._waiting = grid, messages[1:]
        return messages[:1]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Run the remaining turns, each from the last finished weights; keep the last."""
        replies = list(replies)
        latest = self._last_finished(replies)
        assert self._grid is not None
        for message in self._waiting:
            if latest is not None:
                message = self._with_arrays(message, latest)
            replies += self._grid.send_and_receive([message], timeout=self.turn_timeout_s)
            latest = self._last_finished(replies) or latest
        self._waiting = []
        _, metrics = super().aggregate_train(server_round, replies)
        return (latest if metrics is not None else None), metrics

    def _last_finished(self, replies: list[Message]) -> ArrayRecord | None:
        for reply in reversed(replies):
            if reply_status(reply, deadline_s=self.round_deadline_s) == "ok":
                return reply.content[self.arrayrecord_key]
        return None

    def _with_arrays(self, message: Message, arrays: ArrayRecord) -> Message:
        content = RecordDict({
            self.arrayrecord_key: arrays,
            self.configrecord_key: message.content[self.configrecord_key],
        })
        return Message(
            content=content,
            dst_node_id=message.metadata.dst_node_id,
            message_type=message.metadata.message_type,
        )
