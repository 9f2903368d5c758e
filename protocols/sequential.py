"""Vanilla (sequential) split learning (Gupta & Raskar 2018): devices take turns on one trunk.

Each device starts from the device side the previous one finished with; nothing is
averaged (:mod:`strategies.sequential`).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.spec import Capabilities, Protocol
from protocols.splitfed import SPLIT_STEP
from splitlearn.config import StrategyConfig


@dataclass
class SequentialOptions(StrategyConfig):
    """Sequential split learning; ``round_timeout_s`` bounds each client's turn."""

    name: str = "sequential"


SEQUENTIAL = Protocol(
    "sequential", SequentialOptions,
    Capabilities(trunk="shared", averages_device_weights=False, **SPLIT_STEP),
    client_path="clients.steps.split:SplitStep",
    strategy_path="strategies.sequential:SequentialSplit",
    trunk_path="server.sessions.split:shared_sessions",
)
