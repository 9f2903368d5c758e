"""Local-loss split learning (Han et al. 2021): devices never wait for the trunk.

Each device trains its bottom against a small auxiliary head of its own and hands
the smashed data (activations and labels) to the trunk, which trains on it apart:
streamed over the data plane, or in bulk in the Flower reply (``bulk``). See
:mod:`clients.steps.local_loss`, :mod:`server.sessions.local_loss` and
:mod:`strategies.local_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocols.spec import Capabilities, Protocol
from splitlearn.communication import upload_only_bytes
from splitlearn.config import StrategyConfig


@dataclass
class LocalLossOptions(StrategyConfig):
    """Local-loss split learning."""

    name: str = "local_loss"
    bulk: bool = False  # ship a round's smashed data in the Flower reply (no data plane)
    aux_hidden: int = 0  # auxiliary head: 0 = one linear layer, else an MLP this wide
    queue_bytes: int = 256 * 1024 * 1024  # smashed data the trunk holds before back-pressure
    put_timeout_s: float = 60.0  # longest a streamed batch waits for room in the queue


def reply_payload(options: Any) -> str | None:
    """Return ``strategy.bulk=true`` when the reply carries the round's smashed data."""
    return "strategy.bulk=true" if options.bulk else None


LOCAL_LOSS = Protocol(
    "local_loss", LocalLossOptions,
    Capabilities(trunk="shared", per_device_cuts=True, error_feedback=True,
                 bytes_per_sample=upload_only_bytes, reply_payload=reply_payload),
    client_path="clients.steps.local_loss:LocalLossStep",
    strategy_path="strategies.local_loss:LocalLossSplit",
    trunk_path="server.sessions.local_loss:local_loss_sessions",
)
