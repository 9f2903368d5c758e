"""U-shaped split learning (Vepakomma et al. 2018): labels never leave the device.

The device keeps the first stages ``[0, cut)``, a tail ``[tail_cut, n)`` and the loss;
the shared trunk runs the stages in between. The strategy is SplitFed's (head and tail
are averaged like any device side, under their stage keys); what is U-shaped is the
device step (:mod:`clients.steps.ushaped`) and the trunk's session
(:mod:`server.sessions.ushaped`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocols.spec import Capabilities, Protocol
from splitlearn.communication import split_with_tail_bytes
from splitlearn.config import StrategyConfig


@dataclass
class UShapedOptions(StrategyConfig):
    """U-shaped: the device keeps ``[0, model.cut)``, ``[tail_cut, n)`` and the loss."""

    name: str = "ushaped"
    tail_cut: int = 0  # first stage of the device's tail; 0 = the last stage only


def device_tail(options: Any, num_stages: int) -> int:
    """Return the first stage of the device's tail (``tail_cut`` 0: the last stage)."""
    return int(options.tail_cut) or num_stages - 1


USHAPED = Protocol(
    "ushaped", UShapedOptions,
    Capabilities(trunk="shared", per_device_cuts=True, error_feedback=True,
                 runtimes=("eager", "web"),
                 bytes_per_sample=split_with_tail_bytes, device_tail=device_tail),
    client_path="clients.steps.ushaped:UShapedStep",
    strategy_path="strategies.splitfed:SplitFed",
    trunk_path="server.sessions.ushaped:ushaped_sessions",
)
