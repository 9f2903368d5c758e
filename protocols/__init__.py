"""The protocols: each one's options, capabilities and parts, registered once.

A protocol is a name with

* its **options** (a :class:`~splitlearn.config.StrategyConfig` subclass; the typed keys
  under ``strategy.``, extended by ``conf/strategy/NAME.yaml`` as ``NAME_schema``);
* its **capabilities** (:class:`Capabilities`): every question other code asks about
  it, from whether it has a trunk to which device runtimes can run its device step;
* its **parts**, named by import path and loaded on first use: its Flower strategy
  (``strategies/``), its device step (``clients/steps/``) and its trunk session
  factory (``server/sessions/``, none without a data plane).

Each protocol is declared in its own module here (``protocols/NAME.py``) and listed in
:data:`PROTOCOLS` (:mod:`protocols.registry`). This package imports nothing of
``clients``, ``server`` or ``strategies``: a device's process asks it for its step only.
"""

from protocols.checks import check_config, cuts_in_play, tail_cut_of
from protocols.compose import compose_config, register_configs
from protocols.registry import PROTOCOLS, protocol_named, runtime_refusal
from protocols.spec import RUNTIMES, Capabilities, Protocol

__all__ = [
    "PROTOCOLS", "RUNTIMES", "Capabilities", "Protocol", "check_config", "compose_config",
    "cuts_in_play", "protocol_named", "register_configs", "runtime_refusal", "tail_cut_of",
]
