"""U-shaped split learning: labels never leave the device (Vepakomma et al. 2018).

The strategy is SplitFed's (head and tail are averaged like any client side, under
their stage keys); what is U-shaped is the client step (:mod:`clients.steps.ushaped`)
and the trunk's session (:mod:`server.sessions.ushaped`). This module holds its options.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitlearn.config import StrategyConfig


@dataclass
class UShapedOptions(StrategyConfig):
    """U-shaped: the device keeps ``[0, model.cut)``, ``[tail_cut, n)`` and the loss."""

    name: str = "ushaped"
    tail_cut: int = 0  # first stage of the device's tail; 0 = the last stage only

