"""SplitFed: a reporting FedAvg plus data-plane sessions (Thapa et al. 2022).

FedAvg averages the client sides; what SplitFed adds, at its hooks, is the trunk:
each sampled client's round record carries a session (the trunk's address and a
token granting the protocol, the client, its cut and the round), the round's
tokens are revoked as soon as the replies are in (late frames are refused, open
streams closed), and the protocol's trunk side finishes the round with the clients
that finished (SplitFed v1 merges their trunk copies; local loss drains its queue).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp import Grid
from torch import Tensor

from splitlearn.dataplane import TokenRegistry
from splitlearn.messages import RECOMPUTE_KEY, record_to_state, stages_outside, state_to_record
from splitlearn.planning.cost import Assignment
from strategies.adaptive import CutPlanning
from strategies.key_exchange import NodeKeys
from strategies.reporting import ReportingFedAvg


@dataclass(frozen=True)
class DataPlaneAccess:
    """How the ServerApp grants sessions on its trunk service.

    Parameters
    ----------
    tokens : TokenRegistry
        Issues and revokes the tokens.
    address : str
        ``host:port`` clients dial.
    ttl_s : float
        Longest a token lives (it also dies with its round).
    route : Callable[[str], str], optional
        Token -> the address of the trunk that serves it, when several do (trunk
        workers); without it every client dials ``address``.
    node_keys : NodeKeys, optional
        Binds each token to its node's key (learned through Flower first); without it
        tokens are bearer secrets.
    websocket : str, optional
        The URL of the same trunk's WebSocket service (``dataplane.websocket_port``), for
        devices that dial it (browsers); None when it is not served.
    """

    tokens: TokenRegistry
    address: str
    ttl_s: float
    route: Callable[[str], str] | None = None
    node_keys: NodeKeys | None = None
    websocket: str | None = None

    def address_for(self, token: str) -> str:
        """Return the address the holder of ``token`` dials."""
        return self.route(token) if self.route is not None else self.address


class TrunkSide(Protocol):
    """What the strategy needs of the protocol's session handler."""

    def finish_round(self, finished: Iterable[str]) -> None:
        """Settle the round on the trunk for the clients (node ids) that finished."""
        ...


class SplitFed(ReportingFedAvg):
    """SplitFed on Flower's message API.

    Parameters
    ----------
    dataplane : DataPlaneAccess
        Grants the clients' sessions.
    trunk : TrunkSide
        The protocol's trunk side (its session handler).
    planning : CutPlanning, optional
        Plans each round's clients and their cuts (per-client cuts); without it
        every client trains at ``model.cut``.
    **kwargs : Any
        Passed to :class:`ReportingFedAvg`.
    """

    def __init__(self, *, dataplane: DataPlaneAccess, trunk: TrunkSide,
                 planning: CutPlanning | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dataplane = dataplane
        self.trunk = trunk
        self.planning = planning
        #: The global arrays hold stages [0, global_cut): every cut a client may get.
        self.global_cut = planning.max_cut if planning else self.spec.model.cut
        self._assigned: dict[int, Assignment] = {}

    def ready(self, grid: Grid, nodes: list[int]) -> list[int]:
        """With node keys, keep the nodes whose key is known (asking the others first)."""
        nodes = super().ready(grid, nodes)
        keys = self.dataplane.node_keys
        return nodes if keys is None else keys.learn(grid, nodes)

    def choose(self, server_round: int, nodes: list[int]) -> list[int]:
        """Keep the planner's choice of clients and cuts (all at ``model.cut`` without one)."""
        nodes = super().choose(server_round, nodes)
        if self.planning is None:
            return nodes
        self._assigned = self.planning.assign(server_round, nodes)
        return [n for n in nodes if n in self._assigned]

    def assignment(self, node: int) -> Assignment:
        """``node``'s cut and whether it recomputes activations this round."""
        default = Assignment(str(node), self.spec.model.cut)
        return self._assigned.get(node, default)

    def client_arrays(self, node: int, arrays: ArrayRecord) -> ArrayRecord:
        """Return the global stages ``node`` holds: all but those its trunk runs this round.

        The global arrays hold stages ``[0, global_cut)`` (and a U-shaped tail); a
        client at cut ``c`` gets them without ``[c, global_cut)``.
        """
        cut = self.assignment(node).cut
        return arrays if cut == self.global_cut else stages_outside(arrays, cut, self.global_cut)

    def aggregate_arrays(self, server_round: int, finished: list[Message]) -> ArrayRecord | None:
        """Merge every stage over the copies that trained it, client and trunk alike.

        A trunk side that cannot merge per stage gets FedAvg of the client sides
        (its clients all hold ``model.cut``). Claimed examples and updates are
        bounded (:meth:`bounded_weights`, :meth:`bounded_states`); with a robust rule
        the devices' copies of each block of stages become one copy, weighted by their
        examples, beside the trunk's own (:meth:`device_side`).
        """
        merge = getattr(self.trunk, "merge_round", None)
        if merge is None:
            return super().aggregate_arrays(server_round, finished)
        states = self.bounded_states(
            finished, [record_to_state(r.content[self.arrayrecord_key]) for r in finished])
        updates = self.device_side(finished, [
            (state, int(w))
            for state, w in zip(states, self.bounded_weights(finished), strict=True)])
        return state_to_record(merge(updates, upto=self.global_cut))

    def device_side(self, finished: list[Message], updates: list[tuple[dict[str, Tensor], int]]
                    ) -> list[tuple[dict[str, Tensor], int]]:
        """Return what stands for the devices' copies in the per-stage merge.

        Without a robust rule, the copies themselves. With one, a copy per block (the
        stages held by the same devices) holding its robust aggregate, weighted by
        the holders' bounded examples: the trunk's own copy of a stage is the
        server's computation and is trusted, so it keeps the share it has in the
        plain merge, and only what stands for the devices changes. A held block
        (too few copies for the rule) is passed with no examples: no copy of the
        devices counts, and its stages keep the trunk's weights (the previous
        round's, where the trunk did not train them).
        """
        if self.robust is None:
            return updates
        blocks = self.robust_blocks(finished, updates)
        return [(b.state, 0 if b.held is not None else int(b.weight)) for b in blocks]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate, then let the planner learn from every reply (declines included).

        After the merge, so that SplitFed v1's trunk copies have added their
        busy time to the trunk's books when the planner measures its speed.
        """
        replies = list(replies)
        result = super().aggregate_train(server_round, replies)
        if self.dataplane.node_keys is not None:  # refused or lost: it may have a new key now
            asked = (m.metadata.dst_node_id for m in self._asked)
            self.dataplane.node_keys.forget(
                n for n in asked if self.statuses.get(n, "lost") in ("refused", "lost"))
        if self.planning is not None:
            self.planning.observe(server_round, [
                (r, self.statuses[r.metadata.src_node_id], self.assignment(r.metadata.src_node_id))
                for r in replies
            ])
        return result

    def checkpoint(self) -> dict[str, Any]:
        """Add the planner's state (its estimates, its last plans) to FedAvg's."""
        state = super().checkpoint()
        return state | {"planning": self.planning.checkpoint() if self.planning else None}

    def restore(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`checkpoint`'s state (the trunk is restored first)."""
        super().restore(saved)
        if self.planning is not None:
            self.planning.restore(saved["planning"])

    def round_record(self, node: int, server_round: int) -> dict[str, Any]:
        """Return the round's data plus a session: the trunk's address and a fresh token."""
        assigned = self.assignment(node)
        record = super().round_record(node, server_round) | {
            "cut": assigned.cut, RECOMPUTE_KEY: assigned.recompute,
            "max_steps": assigned.steps or 0,  # partial work: the batches it trains (0: all)
        }
        if assigned.deadline_s is not None:  # partial work kept by the device's own clock
            record |= {"max_steps": 0, "deadline_s": assigned.deadline_s,
                       "min_work": assigned.least_work}
        keys = self.dataplane.node_keys
        token = self.dataplane.tokens.issue(
            client=str(node), protocol=self.protocol, cut=record["cut"],
            server_round=server_round, ttl_s=self.dataplane.ttl_s,
            node_key=None if keys is None else keys.of(node),
        )
        record |= {"trunk_address": self.dataplane.address_for(token), "token": token}
        if self.dataplane.websocket is not None:
            record["trunk_websocket"] = self.dataplane.websocket
        return record

    def finish_round(self, server_round: int, finished: list[Message]) -> None:
        """Close the round's sessions, then let the trunk settle the finished clients."""
        self.dataplane.tokens.revoke_round(server_round)
        self.trunk.finish_round([str(r.metadata.src_node_id) for r in finished])

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Average client evaluations, then close the evaluation's sessions."""
        metrics = super().aggregate_evaluate(server_round, replies)
        self.dataplane.tokens.revoke_round(server_round)
        return metrics

