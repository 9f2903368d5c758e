"""A protocol's trunk service in a few lines, outside a Flower run.

For a native-client author, an attack harness or a test: build one protocol's trunk
from a model and its options, serve it over gRPC, grant sessions, settle rounds, stop::

    from protocols.splitfed import SplitFedV2Options
    from server.standalone import serve_trunk

    with serve_trunk(model, SplitFedV2Options(lr=0.05)) as trunk:
        token = trunk.grant("device-0", cut=1)
        ...  # a device dials trunk.address with the token (see trunk.proto)
        trunk.finish_round(["device-0"])

The ServerApp builds its trunk with the same :func:`build_trunk_side`. The wire's
constants (method name, metadata keys) are :mod:`splitlearn.dataplane`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc

from protocols import protocol_named
from server.guard import TrunkGuard
from server.trunk import Trunk
from splitlearn.config import DataPlaneConfig, ServerConfig, StrategyConfig
from splitlearn.dataplane import SessionHandler, TokenRegistry, TrunkEndpoint, TrunkService
from splitlearn.models import SplittableModel
from splitlearn.optim import base_lr, side_config


@dataclass(frozen=True)
class TrunkSide:
    """A protocol's trunk and what serves it, before any transport."""

    trunk: Trunk
    handler: SessionHandler | None  # None: the protocol has no data plane
    tokens: TokenRegistry
    endpoint: TrunkEndpoint


def build_trunk_side(model: SplittableModel, options: StrategyConfig,
                     dataplane: DataPlaneConfig, *, sticky_core: bool = False,
                     server: ServerConfig | None = None) -> TrunkSide:
    """Build the trunk of ``model`` and ``options.name``'s session handler on it.

    Parameters
    ----------
    model : SplittableModel
        The network; the trunk trains it in place.
    options : StrategyConfig
        The protocol's options (``name`` picks it; ``trunk_optimizer``, else ``optimizer``,
        with lr, momentum and weight decay, is the trunk's optimiser).
    dataplane : DataPlaneConfig
        What the endpoint accepts (frame size, value bound, batch, timeouts) and the
        trunk's layout.
    sticky_core : bool, optional
        Start each step on the core the last one ended on.
    server : ServerConfig, optional
        Where the trunk computes, and in what precision (None: the CPU, float32).
    """
    server = server or ServerConfig()
    protocol = protocol_named(options.name)
    guard = TrunkGuard(dataplane.guard) if dataplane.guard.enabled else None
    optimizer, _ = side_config(options, "trunk")
    trunk = Trunk(model, lr=base_lr(options, "trunk"), momentum=options.momentum,
                  weight_decay=options.weight_decay, optimizer=optimizer,
                  device=server.device, precision=server.precision,
                  channels_last=dataplane.channels_last,
                  sticky_core=sticky_core, guard=guard)
    handler = protocol.trunk(trunk, options, dataplane) if protocol.trunk else None
    tokens = TokenRegistry()
    handlers = {protocol.name: handler} if handler is not None else {}
    return TrunkSide(trunk, handler, tokens, TrunkEndpoint(handlers, tokens, dataplane=dataplane))


@dataclass
class ServedTrunk:
    """A running trunk service for one protocol (see :func:`serve_trunk`)."""

    side: TrunkSide
    service: TrunkService
    protocol: str
    server_round: int = 1

    @property
    def address(self) -> str:
        """``host:port`` a device dials."""
        return self.service.address

    @property
    def trunk(self) -> Trunk:
        """The trunk (its model, steps and books)."""
        return self.side.trunk

    def grant(self, client: str, *, cut: int, ttl_s: float = 600.0,
              node_key: bytes | None = None) -> str:
        """Return a token granting ``client`` a session at ``cut`` in the current round.

        With ``node_key`` (a device's public key) the token is bound to it: every stream
        must carry the node's proof (:mod:`splitlearn.dataplane.node_keys`).
        """
        return self.side.tokens.issue(client=client, protocol=self.protocol, cut=cut,
                                      server_round=self.server_round, ttl_s=ttl_s,
                                      node_key=node_key)

    def finish_round(self, finished: list[str]) -> None:
        """Settle the round for the clients that finished; revoke its tokens; next round."""
        self.side.tokens.revoke_round(self.server_round)  # late frames are refused
        if self.side.handler is not None:
            self.side.handler.finish_round(finished)
        self.server_round += 1

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (open streams get ``grace_s`` seconds)."""
        self.service.stop(grace_s)

    def __enter__(self) -> ServedTrunk:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()


def serve_trunk(model: SplittableModel, options: StrategyConfig,
                dataplane: DataPlaneConfig | None = None, *, host: str = "127.0.0.1",
                port: int = 0, credentials: grpc.ServerCredentials | None = None,
                **service: Any) -> ServedTrunk:
    """Build ``options.name``'s trunk of ``model`` and serve it over gRPC; return it running.

    Parameters
    ----------
    model : SplittableModel
        The network the trunk trains (in place).
    options : StrategyConfig
        The protocol's options (e.g. :class:`protocols.splitfed.SplitFedV2Options`).
    dataplane : DataPlaneConfig, optional
        Limits and timeouts of the data plane (defaults: :class:`DataPlaneConfig`'s).
    host, port : str, int
        Where to listen (port 0: a free one; see :attr:`ServedTrunk.address`).
    credentials : grpc.ServerCredentials, optional
        TLS (``grpc.ssl_server_credentials``); plaintext without.
    **service : Any
        Passed to :class:`~splitlearn.dataplane.TrunkService` (``max_streams``,
        ``watchdog_s``).

    Raises
    ------
    ValueError
        For a protocol without a data plane, or an unknown one.
    """
    dataplane = dataplane or DataPlaneConfig()
    side = build_trunk_side(model, options, dataplane)
    if side.handler is None:
        raise ValueError(f"strategy={options.name} has no trunk to serve")
    served = TrunkService(side.endpoint, host=host, port=port, server_credentials=credentials,
                          max_streams=service.pop("max_streams", dataplane.max_streams),
                          **service)
    served.start()
    return ServedTrunk(side, served, options.name)
