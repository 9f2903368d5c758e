"""Shared fixtures: a trunk service on loopback, seeded models and batches, small configs."""

from __future__ import annotations

import os

# Flower and flwr-datasets read this at import: tests never phone home.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import copy
import ssl
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from omegaconf import DictConfig
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

from protocols import compose_config, protocol_named
from server.trunk import Trunk
from splitlearn.config import DataPlaneConfig, OptimizerConfig, StrategyConfig
from splitlearn.dataplane import (
    GrpcTransport,
    InProcessTransport,
    SessionHandler,
    TokenRegistry,
    TrunkChannel,
    TrunkEndpoint,
    TrunkService,
    TrunkWebSocketService,
    WebSocketTransport,
)
from splitlearn.models import SplittableModel, build_model

# One intra-op thread per process: tests run beside each other and beside Ray workers.
torch.set_num_threads(1)


@dataclass
class TrunkServer:
    """A running data plane around a copy of ``model``, serving one protocol."""

    model: SplittableModel
    trunk: Trunk
    handler: SessionHandler
    tokens: TokenRegistry
    endpoint: TrunkEndpoint
    service: TrunkService
    protocol: str
    #: The same endpoint over WebSocket, started by the first :meth:`channel` that asks.
    websocket: TrunkWebSocketService | None = None
    ws_context: ssl.SSLContext | None = None  # TLS of that service (wss://)

    def token(self, cut: int, client: str = "c0", server_round: int = 1, ttl_s: float = 60,
              node_key: bytes | None = None) -> str:
        return self.tokens.issue(client=client, protocol=self.protocol, cut=cut,
                                 server_round=server_round, ttl_s=ttl_s, node_key=node_key)

    def channel(self, token: str, *, tls: bool = False, root_certificates: bytes | None = None,
                proof: bytes | None = None, transport: str = "grpc", **kwargs) -> TrunkChannel:
        """A client channel over gRPC (TLS with ``tls`` or ``root_certificates``), or over
        the WebSocket service with ``transport="websocket"``."""
        link: GrpcTransport | WebSocketTransport
        if transport == "websocket":
            link = WebSocketTransport(self.websocket_url(), token, max_frame_bytes=1 << 22,
                                      root_certificates=root_certificates, proof=proof)
        else:
            link = GrpcTransport(self.service.address, token, max_frame_bytes=1 << 22,
                                 tls=tls, root_certificates=root_certificates, proof=proof)
        return TrunkChannel(link, max_frame_bytes=1 << 22, **kwargs)

    def websocket_url(self) -> str:
        """Start the WebSocket service on the same endpoint (once); return its URL."""
        if self.websocket is None:
            self.websocket = TrunkWebSocketService(self.endpoint, ssl_context=self.ws_context)
            self.websocket.start()
        return self.websocket.url

    def local_channel(self, token: str, **kwargs) -> TrunkChannel:
        """A client channel calling the endpoint directly (same frames and checks)."""
        return TrunkChannel(InProcessTransport(self.endpoint, token), **kwargs)


def start_trunk_server(
    model: SplittableModel,
    *,
    protocol: str = "splitfed_v2",
    options: StrategyConfig | None = None,
    lr: float = 0.1,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    optimizer: OptimizerConfig | None = None,
    dataplane: DataPlaneConfig | None = None,
    handler: Callable[[Trunk, DataPlaneConfig], SessionHandler] | None = None,
    channels_last: bool | None = None,
    ws_context: ssl.SSLContext | None = None,
    **service_kwargs,
) -> TrunkServer:
    """Serve a copy of ``model`` with ``protocol``'s session handler (or ``handler``).

    ``channels_last`` is the trunk's layout (None: the model's own, as in a run); ``lr``,
    ``momentum``, ``weight_decay`` and ``optimizer`` (None: SGD) are the trunk's optimiser.
    """
    server_model = copy.deepcopy(model)
    trunk = Trunk(server_model, lr=lr, momentum=momentum, weight_decay=weight_decay,
                  optimizer=optimizer, channels_last=channels_last)
    dataplane = dataplane or DataPlaneConfig(max_frame_bytes=1 << 20, max_batch=64)
    spec = protocol_named(protocol)
    if handler is not None:
        session_handler = handler(trunk, dataplane)
    else:
        assert spec.trunk is not None
        session_handler = spec.trunk(trunk, options or spec.options(), dataplane)
    tokens = TokenRegistry()
    endpoint = TrunkEndpoint({protocol: session_handler}, tokens, dataplane=dataplane)
    service = TrunkService(endpoint, host="127.0.0.1", port=0, **service_kwargs)
    service.start()
    return TrunkServer(server_model, trunk, session_handler, tokens, endpoint, service, protocol,
                       ws_context=ws_context)


@pytest.fixture
def task_identity() -> Iterator[None]:
    """Messages built outside Flower's runtime need a task identity (its public setters)."""
    from flwr.supercore.task_identity import TaskIdentity

    names = ("task_id", "run_id", "node_id")

    def current(name: str) -> int | None:
        try:
            return getattr(TaskIdentity, name)
        except RuntimeError:  # not set yet
            return None

    saved = {name: current(name) for name in names}
    for name in names:
        setattr(TaskIdentity, name, 1)
    yield
    for name, value in saved.items():
        setattr(TaskIdentity, name, value)


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    """Threads switch every microsecond (5 ms by default): races show in a few steps."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(saved)


@pytest.fixture
def trunk_server_factory() -> Iterator[Callable[..., TrunkServer]]:
    servers: list[TrunkServer] = []

    def make(model: SplittableModel, **kw) -> TrunkServer:
        servers.append(start_trunk_server(model, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.service.stop(0)
        if s.websocket is not None:
            s.websocket.stop()


def digits_like_model(name: str = "cnn", seed: int = 0) -> SplittableModel:
    return build_model(name, in_channels=1, image_size=8, num_classes=10, seed=seed)


def fixed_batches(
    n: int, *, batch: int = 16, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.rand(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(n)
    ]


def small_config(*overrides: str, run_dir: str | None = None) -> DictConfig:
    """The shipped config, shrunk for tests: few clients and rounds, JSON/CSV files only.

    No PNG plots (seconds per run folder): the tests that check them run the full
    command (``tests/integration/test_simulation.py``, ``test_heterogeneity.py``).
    """
    cfg = compose_config([
        "logger=none", "logger.plots=false", "num_clients=3", "strategy.num_rounds=2",
        "strategy.local_epochs=1", *overrides,
    ])
    if run_dir is not None:
        cfg.run_dir = run_dir
    return cfg


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests by folder, so ``-m unit`` / ``-m integration`` select them."""
    for item in items:
        for folder in ("unit", "integration"):
            if f"tests/{folder}/" in item.nodeid:
                item.add_marker(getattr(pytest.mark, folder))


#: Under ``--dist loadgroup`` (the serial tests' command, ``-n 3``) the serial tests run
#: in three xdist lanes, each test one at a time within its lane: the files named here in
#: the lane they name, every other file in the ``shared`` lane. The lanes are balanced by
#: CPU, which bounds the phase (each test alone in a cgroup, 2026-12-05): deployment = the
#: TLS deployment 327 CPU-s + the Ray cluster 82 + flwr run ~130; docs = the how-to 160 + the
#: connect-a-device tutorial 110 + the connect-a-phone tutorial (78 s alone, 2026-12-06) +
#: a phone's own pictures (test_own_pictures.py, 27 s alone);
#: shared = the tutorials 319 + the web runtime in Chromium (test_web_step.py, 67 s alone,
#: more than one core) + the phones through the gateway (test_gateway.py, 193 s alone with a
#: second round in its first run, 2026-12-06).
LANES = {
    "tests/integration/test_deployment.py": "deployment",
    "tests/integration/test_ray_cluster.py": "deployment",
    "tests/integration/test_deployment_docs.py": "docs",
    "tests/integration/test_own_pictures.py": "docs",
    "tests/integration/test_flwr_run.py": "deployment",
}


class SerialLanes(LoadScopeScheduling):
    """xdist lanes: the files of :data:`LANES` in the lane they name, every other test another."""

    def _split_scope(self, nodeid: str) -> str:
        return LANES.get(nodeid.partition("::")[0], "shared")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> SerialLanes | None:
    """The lanes of ``--dist loadgroup`` (see :data:`LANES`).

    xdist's own ``loadgroup`` reads ``xdist_group`` marks by renaming ``item._nodeid``,
    which pytest 9's ``nodeid`` no longer reads: every test would be a group of its own.
    """
    return SerialLanes(config, log) if config.getvalue("dist") == "loadgroup" else None
