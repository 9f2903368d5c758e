"""Device profiles and their deterministic assignment to clients (pure Python).

Nothing here imports torch or Flower: planners and the virtual clock reason
about devices from these numbers alone. The shipped presets (with the source of
every figure) live in ``conf/devices/profiles/presets.yaml`` (:func:`preset_profiles`).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from omegaconf import OmegaConf

from splitlearn.config import CONF_DIR

MBIT = 1_000_000 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class DeviceProfile:
    """What a device can do.

    Parameters
    ----------
    name : str
        Preset name.
    flops_per_s : float
        Sustained FLOP/s the device reaches when training (not its peak).
    memory_bytes : int
        Memory the training app may use.
    uplink_mbps, downlink_mbps : float
        Link bandwidth in Mbit/s.
    rtt_s : float
        Round-trip latency to the server in seconds (paid per exchange).
    availability : float
        Probability that the device is reachable when sampled for a round.
    dropout : float
        Probability that it vanishes mid-round once it started.
    """

    name: str
    flops_per_s: float
    memory_bytes: int
    uplink_mbps: float
    downlink_mbps: float
    rtt_s: float
    availability: float = 1.0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for attr in ("flops_per_s", "memory_bytes", "uplink_mbps", "downlink_mbps"):
            if not getattr(self, attr) > 0:
                raise ValueError(f"device {self.name!r}: {attr} must be > 0")
        if self.rtt_s < 0:
            raise ValueError(f"device {self.name!r}: rtt_s must be >= 0")
        for attr in ("availability", "dropout"):
            if not 0.0 <= getattr(self, attr) <= 1.0:
                raise ValueError(f"device {self.name!r}: {attr} must lie in [0, 1]")

    @property
    def uplink_bytes_per_s(self) -> float:
        """Uplink bandwidth in bytes per second."""
        return self.uplink_mbps * MBIT

    @property
    def downlink_bytes_per_s(self) -> float:
        """Downlink bandwidth in bytes per second."""
        return self.downlink_mbps * MBIT

    @classmethod
    def from_mapping(cls, name: str, values: Mapping[str, Any]) -> DeviceProfile:
        """Build from a config mapping; unknown keys raise ValueError naming them."""
        known = {f.name for f in fields(cls)} - {"name"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"device {name!r}: unknown keys {unknown}; known: {sorted(known)}")
        return cls(name=name, **dict(values))


def mix_counts(num_clients: int, mix: Mapping[str, float]) -> dict[str, int]:
    """Split ``num_clients`` over profiles in proportion to ``mix`` (largest remainder).

    Parameters
    ----------
    num_clients : int
        Number of clients.
    mix : Mapping[str, float]
        Profile name -> non-negative weight (need not sum to 1).

    Returns
    -------
    dict[str, int]
        Clients per profile; the counts add up to ``num_clients``.
    """
    total = sum(mix.values())
    if not mix or total <= 0 or any(w < 0 for w in mix.values()):
        raise ValueError(f"device mix needs non-negative weights with a positive sum: {dict(mix)}")
    quotas = {name: num_clients * w / total for name, w in mix.items()}
    counts = {name: math.floor(q) for name, q in quotas.items()}
    # Hand the remaining clients to the largest remainders (ties: mix order).
    order = sorted(mix, key=lambda n: quotas[n] - counts[n], reverse=True)
    for name in order[: num_clients - sum(counts.values())]:
        counts[name] += 1
    return counts


def assign_profiles(num_clients: int, mix: Mapping[str, float], *, seed: int) -> list[str]:
    """Deterministically give each client (by partition id) a profile name.

    The counts follow :func:`mix_counts`; which client gets which profile is a
    seeded shuffle, so a client can recompute its own profile from
    ``(num_clients, mix, seed)`` without asking anyone.
    """
    names = [name for name, n in mix_counts(num_clients, mix).items() for _ in range(n)]
    random.Random(seed).shuffle(names)
    return names


def build_fleet(
    *,
    num_clients: int,
    mix: Mapping[str, float],
    profiles: Mapping[str, Mapping[str, Any]],
    seed: int,
) -> list[DeviceProfile] | None:
    """Profiles of all clients by partition id, or None when no devices are emulated.

    Raises
    ------
    ValueError
        If the mix names a profile that is not defined (the message lists the
        defined ones) or a profile has invalid values.
    """
    if not mix:
        return None
    missing = sorted(set(mix) - set(profiles))
    if missing:
        raise ValueError(
            f"devices.mix names undefined profiles {missing}; defined: {sorted(profiles)}"
        )
    presets = {name: DeviceProfile.from_mapping(name, profiles[name]) for name in mix}
    return [presets[name] for name in assign_profiles(num_clients, mix, seed=seed)]


def apply_traces(
    profile: DeviceProfile, traces: Sequence[Any], *, partition_id: int, server_round: int
) -> DeviceProfile:
    """Return the device as it is in ``server_round``, after every trace event begun.

    Each event (``devices.traces`` in the config: ``from_round``, the ``profiles``
    and/or ``partitions`` it hits, ``flops_scale``, ``memory_scale`` and new link
    figures) applies from its round on, in order, to the devices it names: a phone
    that throttles, memory another app takes, a link that drops from Wi-Fi to
    cellular. A pure function of the round, so client and server agree on it.
    """
    for event in traces:
        hit = profile.name in event.profiles or partition_id in event.partitions
        if not hit or server_round < event.from_round:
            continue
        profile = replace(
            profile,
            flops_per_s=profile.flops_per_s * event.flops_scale,
            memory_bytes=int(profile.memory_bytes * event.memory_scale),
            uplink_mbps=profile.uplink_mbps if event.uplink_mbps is None else event.uplink_mbps,
            downlink_mbps=(profile.downlink_mbps if event.downlink_mbps is None
                           else event.downlink_mbps),
            rtt_s=profile.rtt_s if event.rtt_s is None else event.rtt_s,
        )
    return profile


#: The shipped device presets (``conf/devices/profiles/presets.yaml``).
PRESETS_FILE = CONF_DIR / "devices" / "profiles" / "presets.yaml"


@functools.cache
def preset_profiles() -> dict[str, dict]:
    """Return the shipped device presets by name (plain mappings; read once, do not modify)."""
    return OmegaConf.to_container(OmegaConf.load(PRESETS_FILE))  # type: ignore[return-value]
