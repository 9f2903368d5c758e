"""The ServerApp's book of node keys, learned through Flower before a node's first session.

A node's data-plane public key arrives in its reply to a ``query.node_key`` message, so
it is as authentic as Flower's node authentication makes that reply: the SuperLink only
accepts a node's replies from the holder of the node's registered key. Tokens granted to
the node are then bound to its data-plane key (:mod:`splitlearn.dataplane.node_keys`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from splitlearn.dataplane.node_keys import (
    NODE_KEY_QUERY,
    NODE_KEY_RECORD,
    PUBLIC_KEY_FIELD,
    public_key_problem,
)

log = logging.getLogger(__name__)


class NodeKeys:
    """Each node's data-plane public key, asked for once per run (and again after a loss).

    Parameters
    ----------
    timeout_s : float
        Longest the ServerApp waits for the nodes' answers.
    """

    def __init__(self, *, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._keys: dict[int, bytes] = {}

    def of(self, node: int) -> bytes | None:
        """Return ``node``'s key, or None when it has none on record."""
        return self._keys.get(node)

    def learn(self, grid: Grid, nodes: Iterable[int]) -> list[int]:
        """Ask the ``nodes`` without a key on record for theirs; return those that have one.

        A node that does not answer in time, answers with an error or with something
        that is not an Ed25519 public key gets no session this time (it is asked again
        the next time it is sampled).
        """
        nodes = list(nodes)
        unknown = [n for n in nodes if n not in self._keys]
        if unknown:
            queries = [Message(RecordDict(), dst_node_id=n, message_type=NODE_KEY_QUERY)
                       for n in unknown]
            asked = set(unknown)
            for reply in grid.send_and_receive(queries, timeout=self.timeout_s):
                # Only an asked node's own answer counts, not the SuperLink's error reply
                # for it (Flower routes a node's replies from that node only).
                if reply.metadata.src_node_id in asked:
                    self._record(reply)
            if missing := [n for n in unknown if n not in self._keys]:
                log.warning("no data-plane key from node(s) %s: no session for them now",
                            missing)
        return [n for n in nodes if n in self._keys]

    def _record(self, reply: Message) -> None:
        node = reply.metadata.src_node_id
        if reply.has_error():
            log.warning("node %s did not give its data-plane key: %s", node, reply.error.reason)
            return
        record = reply.content.config_records.get(NODE_KEY_RECORD)
        key = None if record is None else record.get(PUBLIC_KEY_FIELD)
        if (problem := public_key_problem(key)) is not None:
            log.warning("node %s sent no usable data-plane key: %s", node, problem)
            return
        assert isinstance(key, bytes)
        if (owner := self._owner_of(key)) not in (None, node):
            # Only the node holding the private key can use it, so a copy hurts no one
            # but the copier; it is refused so that a proof always names one node.
            log.warning("node %s sent node %s's data-plane key: not kept", node, owner)
            return
        self._keys[node] = key

    def _owner_of(self, key: bytes) -> int | None:
        return next((n for n, k in self._keys.items() if k == key), None)

    def forget(self, nodes: Iterable[int]) -> None:
        """Drop the keys of ``nodes`` (they may have restarted with a new one)."""
        for node in nodes:
            self._keys.pop(node, None)
