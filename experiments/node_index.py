"""An index of pending messages by node for Flower's in-memory LinkState.

Flower's Simulation Engine hands messages to ClientApps from a loop that, every
0.1 s, asks the LinkState for the pending messages of *every registered node*
(``vce_api.add_messages_to_queue``), and ``InMemoryLinkState.get_message_ins``
answers each question by scanning the whole message store under its lock. A
tick therefore costs O(registered nodes x stored messages) whether or not a node
was sampled: at 10,000 registered nodes and 10 sampled per round it took a
third of this machine's CPU and doubled the time per training sample.

:class:`NodeIndexedLinkState` keeps the set of nodes that may have an
undelivered message and answers every other node with an empty list without
scanning. Everything else, and every answer for a node in the set, is Flower's
own code (``super()``). The set is a superset of the truth: a node joins it when
a message to it is stored and leaves it only when a full scan for it found
nothing left, both under the state's own (reentrant) lock, so no message is
ever skipped. The check itself takes no lock: a message stored just after it is
delivered on the engine's next tick, as it would be after Flower's own scan.

The Simulation Engine builds its LinkState inside ``run_simulation`` without a
way to pass one in, so :func:`node_indexed_link_state` swaps the class the
factory instantiates for the duration of a run and restores it afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from flwr.app import Message
from flwr.server.superlink.linkstate import linkstate_factory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState


class NodeIndexedLinkState(InMemoryLinkState):
    """``InMemoryLinkState`` that skips the store scan for nodes with nothing pending."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        #: Nodes that may hold an undelivered message (a superset, never fewer).
        self.nodes_with_pending: set[int] = set()

    def store_message_ins(self, message: Message) -> str | None:
        """Store one message (Flower's checks) and mark its destination as pending."""
        with self.lock:
            message_id = super().store_message_ins(message)
            if message_id is not None:
                self.nodes_with_pending.add(message.metadata.dst_node_id)
            return message_id

    def get_message_ins(
        self, node_id: int, limit: int | None, *, run_id: int | None = None
    ) -> list[Message]:
        """Flower's answer for a pending node; an empty list, without a scan, otherwise."""
        # No lock for the check (see the module's docstring): 10,000 calls a tick.
        if node_id not in self.nodes_with_pending:
            return []
        with self.lock:
            messages = super().get_message_ins(node_id, limit, run_id=run_id)
            # A scan of every run that returned fewer than it could has delivered all
            # the node had; a full page may have left more, so the node stays.
            if run_id is None and (limit is None or len(messages) < limit):
                self.nodes_with_pending.discard(node_id)
            return messages


@contextlib.contextmanager
def node_indexed_link_state() -> Iterator[None]:
    """Make Flower's LinkState factory build :class:`NodeIndexedLinkState` inside the block."""
    original = linkstate_factory.InMemoryLinkState
    linkstate_factory.InMemoryLinkState = NodeIndexedLinkState
    try:
        yield
    finally:
        linkstate_factory.InMemoryLinkState = original
