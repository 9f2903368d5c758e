"""What a protocol is: its capabilities and its parts, as the registry holds them.

Code elsewhere asks a protocol's entry, never its name: whether there is a trunk and
whether it is shared, whether device weights are averaged, which device runtimes can
run the device step, what the options say about a device tail or about shipping
activations in the Flower reply.

The parts (strategy, device step, trunk session factory) are named by import path and
loaded when first asked for, so that a device's process, which only ever asks for its
step, never loads server or strategy code.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from splitlearn.communication import ClosedForm
from splitlearn.config import StrategyConfig

#: Where a protocol's trunk lives: none (the whole model on the device), one trunk shared
#: by every device, or a copy per device merged at the end of the round.
TrunkKind = Literal["none", "shared", "per_device"]
#: Device runtimes a protocol may declare: ``devices.runtime``'s values, and ``web`` (a
#: phone's browser, ``devices.web``).
RUNTIMES = ("eager", "executorch", "web")


@dataclass(frozen=True)
class Capabilities:
    """What a protocol supports: the questions other code asks about it.

    Parameters
    ----------
    trunk : {"none", "shared", "per_device"}
        Whether it has a trunk, and one shared by every device or a copy per device.
    bytes_per_sample : ClosedForm
        The closed form of its bytes per training sample
        (:mod:`splitlearn.communication`).
    averages_device_weights : bool
        Whether the round's device weights are averaged (False: they pass from device
        to device, so secure aggregation and DP-FedAvg have no average to act on).
    per_device_cuts : bool
        Whether devices of one round may hold different cuts (adaptive planners).
    shards_trunk : bool
        Whether its shared trunk can be split over worker processes
        (``dataplane.trunk_workers``).
    runtimes : tuple of str
        The device runtimes (:data:`RUNTIMES`) that can run its device step.
    sends_activations : bool
        Whether the device sends activations at the cut (activation privacy applies).
    nopeek : bool
        Whether the device step adds the NoPeek term (``privacy.nopeek_weight``).
    error_feedback : bool
        Whether devices send each row's example id, which error feedback keys on.
    device_tail : Callable[[StrategyConfig, int], int], optional
        Options and number of stages -> the first stage of a tail the device keeps
        after the trunk (the device returns the gradient of the trunk's output).
    reply_payload : Callable[[StrategyConfig], str | None], optional
        Options -> the setting that makes devices ship activations in the Flower
        reply instead of the data plane (None: they do not).
    """

    trunk: TrunkKind
    bytes_per_sample: ClosedForm
    averages_device_weights: bool = True
    per_device_cuts: bool = False
    shards_trunk: bool = False
    runtimes: tuple[str, ...] = ("eager",)
    sends_activations: bool = True
    nopeek: bool = False
    error_feedback: bool = False
    device_tail: Callable[[StrategyConfig, int], int] | None = None
    reply_payload: Callable[[StrategyConfig], str | None] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.runtimes) - set(RUNTIMES))
        if unknown or "eager" not in self.runtimes:
            raise ValueError(f"runtimes={self.runtimes}: need 'eager', and only {RUNTIMES}")


@dataclass(frozen=True)
class Protocol:
    """One protocol: its name, options schema, capabilities and parts.

    Parameters
    ----------
    name : str
        ``strategy.name``; messages are typed ``train.NAME`` and ``evaluate.NAME``.
    options : type[StrategyConfig]
        Its typed keys under ``strategy.`` (``conf/strategy/NAME.yaml`` extends them
        as ``NAME_schema``).
    capabilities : Capabilities
        What it supports.
    client_path, strategy_path : str
        ``module:attribute`` of its device step (a ``clients.steps`` ``ClientStep``)
        and of its Flower strategy (a ``strategies`` ``ReportingFedAvg``).
    trunk_path : str, optional
        ``module:attribute`` of its trunk session factory (``server.sessions``):
        (trunk, options, data-plane limits) -> session handler. None: no data plane.
    """

    name: str
    options: type[StrategyConfig]
    capabilities: Capabilities
    client_path: str
    strategy_path: str
    trunk_path: str | None = None

    def __post_init__(self) -> None:
        has_trunk = self.capabilities.trunk != "none"
        if has_trunk != (self.trunk_path is not None):
            raise ValueError(f"protocol {self.name!r}: trunk={self.capabilities.trunk!r} "
                             f"but trunk_path={self.trunk_path!r}")

    @property
    def client(self) -> Any:
        """The device step class (loaded on first use)."""
        return load_part(self.client_path)

    @property
    def strategy(self) -> Any:
        """The Flower strategy class (loaded on first use)."""
        return load_part(self.strategy_path)

    @property
    def trunk(self) -> Any:
        """The trunk session factory, or None without a data plane (loaded on first use)."""
        return None if self.trunk_path is None else load_part(self.trunk_path)

    def first_tail_stage(self, options: Any, num_stages: int) -> int | None:
        """Return the first stage of the device's tail (None: the device keeps no tail)."""
        tail = self.capabilities.device_tail
        return None if tail is None else tail(options, num_stages)

    def reply_payload(self, options: Any) -> str | None:
        """Return the setting that ships activations in the Flower reply (None: none does)."""
        payload = self.capabilities.reply_payload
        return None if payload is None else payload(options)


@functools.cache
def load_part(path: str) -> Any:
    """Import ``module:attribute`` (ValueError naming the path when it does not exist)."""
    module, _, attribute = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"protocol part {path!r} does not exist: {err}") from err
