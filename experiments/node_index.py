"""Flower's in-memory LinkState for the Simulation Engine: indexed by node, and prompt.

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

The same loop waits its 0.1 s between sweeps however soon a message arrives, so
each round's messages reached the ClientApps 50 ms late on average, with the shared
trunk idle. The state also sets an event whenever a message is stored, and the
loop is handed a stand-in for its stop event (:class:`WakeOnStore`) whose ``wait``
returns when that event fires (at most every :data:`MIN_SWEEP_GAP_S`, since a sweep
asks every registered node). Flower's own loop runs unchanged around it.

The Simulation Engine builds its LinkState inside ``run_simulation`` without a
way to pass one in, so :func:`node_indexed_link_state` swaps the class the
factory instantiates and the engine's loop for the duration of a run and
restores both afterwards.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from queue import Queue

from flwr.app import Message
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import linkstate_factory
from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState


class NodeIndexedLinkState(InMemoryLinkState):
    """``InMemoryLinkState`` that skips the store scan for nodes with nothing pending."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        #: Nodes that may hold an undelivered message (a superset, never fewer).
        self.nodes_with_pending: set[int] = set()
        #: Set whenever a message is stored; the engine's loop clears it when it wakes.
        self.stored = threading.Event()

    def store_message_ins(self, message: Message) -> str | None:
        """Store one message (Flower's checks), mark its destination pending, wake the loop."""
        with self.lock:
            message_id = super().store_message_ins(message)
            if message_id is not None:
                self.nodes_with_pending.add(message.metadata.dst_node_id)
        if message_id is not None:
            self.stored.set()
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


#: The least time between two sweeps that a stored message brings forward. A sweep of
#: 10,000 registered nodes costs about a millisecond, and a round's messages are stored
#: one by one: each store would otherwise start a sweep of its own.
MIN_SWEEP_GAP_S = 0.005


class WakeOnStore:
    """The engine's stop event as its message loop sees it: ``wait`` also ends on a store.

    Parameters
    ----------
    stop : threading.Event
        The engine's own stop event; ``is_set`` is its answer.
    state : NodeIndexedLinkState
        The state whose :attr:`~NodeIndexedLinkState.stored` event ends a wait.
    """

    def __init__(self, stop: threading.Event, state: NodeIndexedLinkState) -> None:
        self.stop = stop
        self.state = state

    def is_set(self) -> bool:
        """Whether the engine is stopping."""
        return self.stop.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s, ending early (after the least gap) once a message is stored.

        Returns
        -------
        bool
            Whether the engine is stopping, as ``Event.wait`` answers.
        """
        if self.stop.wait(min(MIN_SWEEP_GAP_S, timeout)):
            return True
        # Cleared before the sweep that follows, so a message stored from here on
        # wakes the next wait instead of being missed. A stop set meanwhile is seen
        # within the tick, as a stop is seen during Flower's own sweep.
        if self.state.stored.wait(max(0.0, timeout - MIN_SWEEP_GAP_S)):
            self.state.stored.clear()
        return self.stop.is_set()


def _deliver_promptly(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap Flower's loop so that it waits on :class:`WakeOnStore` (its own code unchanged)."""

    def add_messages_to_queue(state: NodeIndexedLinkState, queue: Queue[Message],
                              nodes_mapping: dict[int, int], f_stop: threading.Event) -> None:
        if isinstance(state, NodeIndexedLinkState):
            f_stop = WakeOnStore(f_stop, state)  # type: ignore[assignment]
        original(state, queue, nodes_mapping, f_stop)

    return add_messages_to_queue


@contextlib.contextmanager
def node_indexed_link_state() -> Iterator[None]:
    """Inside the block, Flower's factory builds :class:`NodeIndexedLinkState`, swept promptly."""
    original_state = linkstate_factory.InMemoryLinkState
    original_loop = vce_api.add_messages_to_queue
    linkstate_factory.InMemoryLinkState = NodeIndexedLinkState
    vce_api.add_messages_to_queue = _deliver_promptly(original_loop)
    try:
        yield
    finally:
        linkstate_factory.InMemoryLinkState = original_state
        vce_api.add_messages_to_queue = original_loop
