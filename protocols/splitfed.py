"""SplitFed (Thapa et al. 2022): parallel devices, their device sides averaged each round.

v2 trains one trunk shared by every device, a step per batch as activations arrive;
v1 keeps a trunk copy per device and merges the copies of the devices that finished.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.spec import Capabilities, Protocol
from splitlearn.communication import split_bytes
from splitlearn.config import StrategyConfig


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


#: The split step's device side: what SplitFed, SGLR and sequential SL devices share.
SPLIT_STEP = dict(
    per_device_cuts=True, runtimes=("eager", "executorch", "web"), nopeek=True, error_feedback=True,
    bytes_per_sample=split_bytes,
)

SPLITFED_V2 = Protocol(
    "splitfed_v2", SplitFedV2Options,
    Capabilities(trunk="shared", shards_trunk=True, **SPLIT_STEP),
    client_path="clients.steps.split:SplitStep",
    strategy_path="strategies.splitfed:SplitFed",
    trunk_path="server.sessions.split:splitfed_v2_sessions",
)
SPLITFED_V1 = Protocol(
    "splitfed_v1", SplitFedV1Options,
    Capabilities(trunk="per_device", **SPLIT_STEP),
    client_path="clients.steps.split:SplitStep",
    strategy_path="strategies.splitfed:SplitFed",
    trunk_path="server.sessions.split:per_client_sessions",
)
