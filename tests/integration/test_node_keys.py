"""Through the shipped strategy and ClientApp: a node cannot use another node's token.

The ServerApp learns each node's data-plane key over Flower (``query.node_key``) and binds
the node's tokens to it. A grid that hands node 1 node 2's token each round plays a node
that got hold of another's token: its stream is refused as "token belongs to another
node", the owner trains, and the round is averaged over the others.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from flwr.app import Message

from experiments.local import LocalGrid, run_local
from splitlearn.dataplane.node_keys import NODE_KEY_QUERY
from splitlearn.messages import ROUND_KEY
from tests.conftest import small_config
from tests.integration.test_simulation import read_clients

THIEF, OWNER = 1, 2


class TokenLeakingGrid(LocalGrid):
    """Delivers as :class:`LocalGrid`, but node 1's task carries node 2's token."""

    queried: list[int] = []

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None
                         ) -> Iterable[Message]:
        messages = list(messages)
        by_node = {m.metadata.dst_node_id: m for m in messages}
        kinds = {m.metadata.message_type for m in messages}
        if NODE_KEY_QUERY in kinds:
            type(self).queried += list(by_node)
        if {THIEF, OWNER} <= set(by_node) and any(k.startswith("train.") for k in kinds):
            by_node[THIEF].content[ROUND_KEY]["token"] = by_node[OWNER].content[ROUND_KEY]["token"]
        return super().send_and_receive(messages, timeout=timeout)


@pytest.mark.parametrize("node_keys", [True, False])
def test_a_node_using_another_nodes_token_is_refused_and_the_round_goes_on(tmp_path, node_keys):
    TokenLeakingGrid.queried = []
    cfg = small_config("strategy.fraction_train=1.0", f"dataplane.node_keys={node_keys}",
                       run_dir=str(tmp_path))
    result = run_local(cfg, concurrency=1, grid_type=TokenLeakingGrid)  # node 1 goes first
    rows = read_clients(tmp_path)
    thief = [r for r in rows if int(r["node_id"]) == THIEF]
    others = [r for r in rows if int(r["node_id"]) != THIEF]
    if node_keys:
        # Each node is asked once per run; a refused node again (it may have a new key).
        assert sorted(TokenLeakingGrid.queried) == sorted([1, 2, 3, THIEF])
        assert [r["status"] for r in thief] == ["refused", "refused"]
        assert all("token belongs to another node: it was issued to node 2, and the stream's "
                   "proof is node 1's" in r["reason"] for r in thief)
        assert [r["status"] for r in others] == ["ok"] * 4  # the owner trained, every round
        assert result.history[-1]["test_accuracy"] > result.history[0]["test_accuracy"]
    else:  # a bearer token: whoever comes first trains as the owner, and the owner is shut out
        assert TokenLeakingGrid.queried == []
        assert [r["status"] for r in thief] == ["ok", "ok"]
        owner = [r for r in rows if int(r["node_id"]) == OWNER]
        assert [r["status"] for r in owner] == ["refused", "refused"]
