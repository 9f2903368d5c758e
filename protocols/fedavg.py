"""FedAvg (McMahan et al. 2017): the whole model on every device; the baseline."""

from __future__ import annotations

from dataclasses import dataclass

from protocols.spec import Capabilities, Protocol
from splitlearn.communication import whole_model_bytes
from splitlearn.config import StrategyConfig


@dataclass
class FedAvgOptions(StrategyConfig):
    """The FedAvg baseline: no options beyond the shared ones."""

    name: str = "fedavg"


FEDAVG = Protocol(
    "fedavg", FedAvgOptions,
    Capabilities(trunk="none", sends_activations=False, bytes_per_sample=whole_model_bytes),
    client_path="clients.steps.whole:WholeModelStep",
    strategy_path="strategies.reporting:ReportingFedAvg",
)
