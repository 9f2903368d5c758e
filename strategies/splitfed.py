"""SplitFed: a reporting FedAvg plus data-plane sessions (Thapa et al. 2022).

FedAvg averages the client sides; what SplitFed adds, at its hooks, is the trunk:
each sampled client's round record carries a session (the trunk's address and a
token granting the protocol, the client, its cut and the round), the round's
tokens are revoked as soon as the replies are in (late frames are refused, open
streams closed), and the protocol's trunk side finishes the round with the clients
that finished (SplitFed v1 merges their trunk copies; local loss drains its queue).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from flwr.app import Message, MetricRecord

from splitlearn.config import StrategyConfig
from splitlearn.dataplane import TokenRegistry
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
    """

    tokens: TokenRegistry
    address: str
    ttl_s: float


class TrunkSide(Protocol):
    """What the strategy needs of the protocol's session handler."""

    def finish_round(self, finished: Iterable[str]) -> None:
        """Settle the round on the trunk for the clients (node ids) that finished."""
        ...


@dataclass
class SplitFedV2Options(StrategyConfig):
    """SplitFed v2: one shared trunk, a step per batch as activations arrive."""

    name: str = "splitfed_v2"
    batch_concurrent: bool = False  # one trunk step over the batches of connected clients
    barrier_timeout_s: float = 0.05  # longest a batch waits for the others' batches


@dataclass
class SplitFedV1Options(StrategyConfig):
    """SplitFed v1: a trunk copy per client, merged over those that finished."""

    name: str = "splitfed_v1"


class SplitFed(ReportingFedAvg):
    """SplitFed on Flower's message API.

    Parameters
    ----------
    dataplane : DataPlaneAccess
        Grants the clients' sessions.
    trunk : TrunkSide
        The protocol's trunk side (its session handler).
    **kwargs : Any
        Passed to :class:`ReportingFedAvg`.
    """

    def __init__(self, *, dataplane: DataPlaneAccess, trunk: TrunkSide, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dataplane = dataplane
        self.trunk = trunk

    def round_record(self, node: int, server_round: int) -> dict[str, Any]:
        """Return the round's data plus a session: the trunk's address and a fresh token."""
        record = super().round_record(node, server_round)
        token = self.dataplane.tokens.issue(
            client=str(node), protocol=self.protocol, cut=record["cut"],
            server_round=server_round, ttl_s=self.dataplane.ttl_s,
        )
        return record | {"trunk_address": self.dataplane.address, "token": token}

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

