"""A grid around Flower's grid: the hook protocols use to change how messages travel.

A strategy's ``wrap_grid`` returns the grid its loop sends through. Subclasses of
:class:`GridWrapper` override ``send_training`` (sequential SL takes turns, secure
aggregation runs SecAgg+'s stages) and hand everything else to the real grid.
"""

from __future__ import annotations

from collections.abc import Iterable

from flwr.app import Message
from flwr.serverapp import Grid


class GridWrapper(Grid):
    """Flower's ``Grid`` interface, delegated to ``grid``.

    Parameters
    ----------
    grid : Grid
        The real grid (or another wrapper).
    """

    def __init__(self, grid: Grid) -> None:
        self.grid = grid

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send a training round through :meth:`send_training`, anything else as usual."""
        messages = list(messages)
        if not messages or not messages[0].metadata.message_type.startswith("train"):
            return self.grid.send_and_receive(messages, timeout=timeout)
        return self.send_training(messages, timeout=timeout)

    def send_training(
        self, messages: list[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send a round's train messages and wait for the replies (the hook to override)."""
        return self.grid.send_and_receive(messages, timeout=timeout)

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
