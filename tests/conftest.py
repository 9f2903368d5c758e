"""Shared fixtures: a trunk service on loopback, seeded models and batches."""

from __future__ import annotations

import os

# Flower and flwr-datasets read this at import: tests never phone home.
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import copy
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from server.trunk import Trunk
from server.trunk_service import TokenRegistry, TrunkEndpoint, TrunkService
from splitlearn.models import SplittableModel, build_model

# On the 2-core machines here, 2 intra-op threads run torch ~10x slower than 1.
torch.set_num_threads(1)


@dataclass
class TrunkServer:
    """A running data plane around a copy of ``model``."""

    model: SplittableModel
    trunk: Trunk
    tokens: TokenRegistry
    endpoint: TrunkEndpoint
    service: TrunkService

    def token(self, cut: int, client: str = "c0", server_round: int = 1) -> str:
        return self.tokens.issue(client=client, cut=cut, server_round=server_round, ttl_s=60)


def start_trunk_server(
    model: SplittableModel, *, lr: float = 0.1, max_frame_bytes: int = 1 << 20
) -> TrunkServer:
    server_model = copy.deepcopy(model)
    trunk = Trunk(server_model, lr=lr)
    tokens = TokenRegistry()
    endpoint = TrunkEndpoint(trunk, tokens, max_frame_bytes=max_frame_bytes, max_batch=64)
    service = TrunkService(endpoint, host="127.0.0.1", port=0)
    service.start()
    return TrunkServer(server_model, trunk, tokens, endpoint, service)


@pytest.fixture
def trunk_server_factory() -> Iterator:
    servers: list[TrunkServer] = []

    def make(model: SplittableModel, **kw) -> TrunkServer:
        servers.append(start_trunk_server(model, **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.service.stop(0)


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests by folder, so ``-m unit`` / ``-m integration`` select them."""
    for item in items:
        for folder in ("unit", "integration"):
            if f"tests/{folder}/" in item.nodeid:
                item.add_marker(getattr(pytest.mark, folder))
