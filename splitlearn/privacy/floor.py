"""A client's own privacy floor: what it accepts from the server, whatever the task asks.

The privacy option and its settings arrive in the server's task, so without a
floor the party we defend against would choose the defence. A node carries its
floor in its own configuration (Flower's node config, set where the device runs)::

    flower-supernode ... --node-config "privacy-option='activation_gaussian'
        privacy-min-noise-multiplier=1.0 privacy-epsilon-max=8.0"   (one line)

and refuses, before it computes or sends anything, a task below it. Keys (all
optional; a node without them accepts what the server asks):

``privacy-option``
    The option the node requires (``activation_gaussian`` or ``dpsgd_client``);
    a task with another option, or none, is refused.
``privacy-min-noise-multiplier``
    The least sigma the node accepts. sigma alone sets the guarantee of either
    option (the noise is ``sigma x C`` for a sensitivity proportional to C).
``privacy-max-delta``
    The largest delta the node accepts.
``privacy-epsilon-max``
    The node's own budget: the tighter of it and the task's ``epsilon_max``
    applies, so a server can lower a node's budget but never raise it.
``privacy-label-epsilon-max``
    The node requires label DP (``privacy.label_epsilon``) at this epsilon or
    below; a task without it, or above, is refused. Independent of the others.
``privacy-secure-aggregation``
    ``true``: the node sends its weights only masked by SecAgg+
    (``aggregation.secure``); a training task that arrives any other way is
    refused. Independent of the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from splitlearn.config import PRIVACY_NAMES, PrivacyConfig

#: Node-config keys of the floor, by field.
FLOOR_KEYS = {
    "option": "privacy-option",
    "min_noise_multiplier": "privacy-min-noise-multiplier",
    "max_delta": "privacy-max-delta",
    "epsilon_max": "privacy-epsilon-max",
    "label_epsilon_max": "privacy-label-epsilon-max",
    "secure_aggregation": "privacy-secure-aggregation",
}
#: How a node config may spell a yes/no key.
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class PrivacyFloorViolation(ValueError):
    """The server's task asks for less privacy than the node's floor."""

    #: Reply status of a node that refuses a task for this reason.
    kind = "privacy"


@dataclass(frozen=True)
class PrivacyFloor:
    """The least privacy a node accepts (None / 0: no requirement).

    Parameters
    ----------
    option : str | None
        The privacy option the node requires.
    min_noise_multiplier : float
        The least sigma it accepts.
    max_delta : float | None
        The largest delta it accepts.
    epsilon_max : float | None
        Its own budget.
    label_epsilon_max : float | None
        The largest label epsilon it accepts (it then requires label DP).
    secure_aggregation : bool
        Whether it sends its weights only through SecAgg+.
    """

    option: str | None = None
    min_noise_multiplier: float = 0.0
    max_delta: float | None = None
    epsilon_max: float | None = None
    label_epsilon_max: float | None = None
    secure_aggregation: bool = False

    def __post_init__(self) -> None:
        accepted = [n for n in PRIVACY_NAMES if n != "none"]
        if self.option is not None and self.option not in accepted:
            raise ValueError(f"{FLOOR_KEYS['option']}={self.option!r}; accepted: {accepted}")
        if not (math.isfinite(self.min_noise_multiplier) and self.min_noise_multiplier >= 0):
            raise ValueError(f"{FLOOR_KEYS['min_noise_multiplier']} must be a finite number "
                             f">= 0, got {self.min_noise_multiplier!r}")
        if self.max_delta is not None and not 0 < self.max_delta < 1:
            raise ValueError(f"{FLOOR_KEYS['max_delta']} must be in (0, 1), got {self.max_delta!r}")
        if self.epsilon_max is not None and not (
            math.isfinite(self.epsilon_max) and self.epsilon_max > 0
        ):
            raise ValueError(f"{FLOOR_KEYS['epsilon_max']} must be a finite number > 0, got "
                             f"{self.epsilon_max!r}")
        if self.label_epsilon_max is not None and not (
            math.isfinite(self.label_epsilon_max) and self.label_epsilon_max > 0
        ):
            raise ValueError(f"{FLOOR_KEYS['label_epsilon_max']} must be a finite number > 0, "
                             f"got {self.label_epsilon_max!r}")

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, object]) -> PrivacyFloor:
        """Read the floor from a node's config (ValueError naming a malformed key)."""
        values: dict[str, object] = {}
        for field, key in FLOOR_KEYS.items():
            if key not in node_config:
                continue
            raw = node_config[key]
            if field == "option":
                values[field] = str(raw)
                continue
            if field == "secure_aggregation":
                values[field] = _boolean(key, raw)
                continue
            if isinstance(raw, bool):
                raise ValueError(f"{key} must be a number, got {raw!r}")
            try:
                values[field] = float(raw)  # type: ignore[arg-type]
            except (TypeError, ValueError) as err:
                raise ValueError(f"{key} must be a number, got {raw!r}") from err
        return cls(**values)  # type: ignore[arg-type]

    @property
    def required(self) -> bool:
        """Whether the node requires noise (an accounted option); label DP is checked apart."""
        return self.option is not None or self.min_noise_multiplier > 0 or (
            self.max_delta is not None or self.epsilon_max is not None)

    def check(self, settings: PrivacyConfig) -> None:
        """Refuse (PrivacyFloorViolation) a task whose privacy is below this floor."""
        self._check_labels(settings)
        if not self.required:
            return
        if settings.name == "none":
            raise PrivacyFloorViolation(
                "the task asks for no privacy (privacy=none); this node requires "
                f"{self.option or 'an accounted option'}")
        if self.option is not None and settings.name != self.option:
            raise PrivacyFloorViolation(
                f"the task asks for privacy={settings.name}; this node requires {self.option}")
        if settings.noise_multiplier < self.min_noise_multiplier:
            raise PrivacyFloorViolation(
                f"the task asks for noise_multiplier={settings.noise_multiplier}; this node "
                f"requires at least {self.min_noise_multiplier}")
        if self.max_delta is not None and settings.delta > self.max_delta:
            raise PrivacyFloorViolation(
                f"the task asks for delta={settings.delta}; this node accepts at most "
                f"{self.max_delta}")

    def check_aggregation(self, *, secure: bool) -> None:
        """Refuse (PrivacyFloorViolation) a training task whose weights would leave unmasked."""
        if self.secure_aggregation and not secure:
            raise PrivacyFloorViolation(
                "the task would send this node's weights to the server unmasked; this node "
                "requires secure aggregation (aggregation.secure=true)")

    def _check_labels(self, settings: PrivacyConfig) -> None:
        if self.label_epsilon_max is None:
            return
        if settings.label_epsilon is None:
            raise PrivacyFloorViolation(
                "the task asks for no label privacy (privacy.label_epsilon=null); this node "
                f"requires label epsilon <= {self.label_epsilon_max}")
        if settings.label_epsilon > self.label_epsilon_max:
            raise PrivacyFloorViolation(
                f"the task asks for label_epsilon={settings.label_epsilon}; this node accepts "
                f"at most {self.label_epsilon_max}")

    def budget(self, task_epsilon_max: float | None) -> float | None:
        """Return the budget that applies: the tighter of the node's and the task's (or None)."""
        limits = [e for e in (self.epsilon_max, task_epsilon_max) if e is not None]
        return min(limits) if limits else None


def _boolean(key: str, raw: object) -> bool:
    """Read a yes/no node-config value (ValueError naming the key)."""
    if isinstance(raw, bool):
        return raw
    word = str(raw).strip().lower()
    if word not in _BOOLEANS:
        raise ValueError(f"{key} must be true or false, got {raw!r}")
    return _BOOLEANS[word]
