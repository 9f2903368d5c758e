"""SGLR (Pal et al. 2021): server-side gradient averaging and split learning rates.

Devices train in parallel against one trunk, as in SplitFed v2, and their device
sides are averaged each round; the trunk steps once over the batches that arrive
together, with an accelerated learning rate, and sends every one of those devices
the same, averaged gradient at the cut (:mod:`server.sessions.sglr`). The strategy
is SplitFed's and the device step the split step.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.spec import Capabilities, Protocol
from protocols.splitfed import SPLIT_STEP
from splitlearn.config import StrategyConfig


@dataclass
class SGLROptions(StrategyConfig):
    """SGLR: gradient averaging at the cut, server learning rate accelerated."""

    name: str = "sglr"
    # The trunk's step is this many times the clients' (0: the number of clients in the
    # step, which keeps the trunk's progress per batch that of SplitFed v2).
    server_lr_scale: float = 0.0
    barrier_timeout_s: float = 0.05  # longest a batch waits for the others' batches


SGLR = Protocol(
    "sglr", SGLROptions,
    Capabilities(trunk="shared", **SPLIT_STEP),
    client_path="clients.steps.split:SplitStep",
    strategy_path="strategies.splitfed:SplitFed",
    trunk_path="server.sessions.sglr:sglr_sessions",
)
