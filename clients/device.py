"""Device emulation on the client: profile, availability, dropout, memory and pacing.

A client works out its own device profile from the fleet description in the run
spec (the assignment is a pure function of the seed), so the server never has to
know which node holds which partition. Each round the device may be unavailable,
may vanish mid-round, may lack the memory for its protocol's modules, and, with
``devices.emulate``, really takes as long as the device would. No Flower imports.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from splitlearn.config import RunSpec
from splitlearn.planning.clock import ClientMeasurement, ClientTime, client_time
from splitlearn.planning.devices import DeviceProfile, apply_traces, build_fleet, preset_profiles

#: Node-config key of the preset a real device declares itself as (``clients.connect
#: --profile``): its memory budget holds, and its times are its own (nothing emulated).
PROFILE_KEY = "device-profile"


class DeviceFailure(RuntimeError):
    """A device-side reason not to finish the round; ``kind`` is the reply's status."""

    kind = "failed"


class ClientUnavailable(DeviceFailure):
    """The device was not reachable this round."""

    kind = "unavailable"


class InjectedDropout(DeviceFailure):
    """The device vanished mid-round."""

    kind = "dropout"


class MemoryBudgetExceeded(DeviceFailure):
    """The protocol's modules do not fit the device's memory at this batch size."""

    kind = "memory"

    def __init__(self, message: str, *, budget_bytes: int, examples: int = 0) -> None:
        super().__init__(message)
        #: What the device has: the planner follows budgets that change.
        self.budget_bytes = budget_bytes
        #: Examples in its data (per-example memory scales with them; 0: not counted).
        self.examples = examples


@dataclass(frozen=True)
class DevicePlan:
    """What this device does this round.

    Parameters
    ----------
    profile : DeviceProfile | None
        The emulated (or declared) device, or None without emulation.
    available : bool
        Whether it is reachable at all.
    fail_after_steps : int
        Vanish after this many batches; -1 never.
    emulated : bool
        False for a real device that declared its profile: only its memory
        budget applies; its availability, speed and links are its own.
    """

    profile: DeviceProfile | None
    available: bool
    fail_after_steps: int
    emulated: bool = True

    def check_memory(self, needed_bytes: int, *, what: str, examples: int = 0) -> None:
        """Decline the round if ``needed_bytes`` exceed the device's memory.

        ``examples`` (the device's, when some of the memory is per example) goes with
        the refusal, for the planner.
        """
        if self.profile is not None and needed_bytes > self.profile.memory_bytes:
            raise MemoryBudgetExceeded(
                f"{what} needs {needed_bytes / 2**20:.1f} MiB; {self.profile.name} has "
                f"{self.profile.memory_bytes / 2**20:.1f} MiB",
                budget_bytes=self.profile.memory_bytes, examples=examples,
            )


def device_profile(
    spec: RunSpec, *, partition_id: int, num_partitions: int
) -> DeviceProfile | None:
    """Recompute this client's profile from the fleet description in ``spec``."""
    if not spec.devices.mix:
        return None
    profiles = build_fleet(
        num_clients=num_partitions, mix=spec.devices.mix,
        profiles={k: vars(v) for k, v in spec.devices.profiles.items()}, seed=spec.seed,
    )
    return profiles[partition_id] if profiles else None


def declared_profile(name: str | None) -> DeviceProfile | None:
    """Return the preset ``name`` a real device declares itself as (None: declares none).

    Raises
    ------
    ValueError
        If ``name`` is not a shipped preset; the message lists them.
    """
    if not name:
        return None
    presets = preset_profiles()
    if name not in presets:
        raise ValueError(f"{PROFILE_KEY}={name!r} is not a device preset; known: "
                         f"{sorted(presets)}")
    return DeviceProfile.from_mapping(name, presets[name])


def plan_round(
    spec: RunSpec, *, server_round: int, partition_id: int, num_partitions: int,
    declared: DeviceProfile | None = None,
) -> DevicePlan:
    """Draw this round's availability and dropout (seeded by seed, round, partition).

    A real device (``declared``) is planned as it is: always available (its own
    absences are real), no injected dropout, its declared memory budget.
    """
    if declared is not None:
        return DevicePlan(declared, available=True, fail_after_steps=-1, emulated=False)
    profile = device_profile(spec, partition_id=partition_id, num_partitions=num_partitions)
    if profile is not None:  # the device as it is this round (throttled, on another link, ...)
        profile = apply_traces(profile, spec.devices.traces, partition_id=partition_id,
                               server_round=server_round)
    rng = random.Random(f"{spec.seed}/{server_round}/{partition_id}")
    availability = profile.availability if profile else 1.0
    dropout = 1 - (1 - (profile.dropout if profile else 0.0)) * (1 - spec.failures.dropout_rate)
    available = rng.random() < availability
    drops = rng.random() < dropout
    return DevicePlan(profile, available, spec.failures.dropout_after_steps if drops else -1)


def measured_time(work: ClientMeasurement, *, wall_s: float) -> ClientTime:
    """Return a real device's own time: its compute, the rest of its round waiting on links."""
    return ClientTime(compute_s=work.compute_s, upload_s=0.0, download_s=0.0,
                      latency_s=max(wall_s - work.compute_s, 0.0))


def virtual_time(
    work: ClientMeasurement, *, profile: DeviceProfile | None, host_flops_per_s: float
) -> ClientTime:
    """Convert what was measured here into device time (host time without a profile)."""
    if profile is None or host_flops_per_s <= 0:
        return ClientTime(compute_s=work.compute_s, upload_s=0.0, download_s=0.0, latency_s=0.0)
    return client_time(work, profile, host_flops_per_s=host_flops_per_s)


class Pacer:
    """Makes each batch take as long as it would on the device (``devices.emulate``).

    After a batch, sleeps for the device time of what the batch did (its compute
    rescaled, its bytes over the links, its exchanges' round trips) minus the
    time the device itself was busy here (waiting for the trunk comes on top, as
    on a real link: upload, the trunk's step, download).
    """

    def __init__(self, profile: DeviceProfile, *, host_flops_per_s: float) -> None:
        self.profile = profile
        self.host_flops_per_s = host_flops_per_s

    def transfer(self, *, bytes_up: int = 0, bytes_down: int = 0) -> None:
        """Sleep as long as the device's links take for bytes outside the batches (weights)."""
        time.sleep(bytes_up / self.profile.uplink_bytes_per_s
                   + bytes_down / self.profile.downlink_bytes_per_s)

    def after_batch(self, work: ClientMeasurement, *, wall_s: float) -> None:
        """Sleep off the difference between the device's time and ``wall_s``."""
        device = virtual_time(work, profile=self.profile, host_flops_per_s=self.host_flops_per_s)
        time.sleep(max(device.total_s - wall_s, 0.0))


class DeviceDeadline:
    """Partial work by the device's own clock: no batch starts that would end past the deadline.

    The planner gives a partial-work round a deadline on the devices' time
    (:mod:`splitlearn.planning.deadline`); the batches it predicts each device trains
    by then come from smoothed estimates, which lag a device that has just slowed down
    (throttled, on a worse link) and are a prior for one never measured. So the device
    keeps the deadline itself: it counts what its round has cost so far on the same
    clock the server charges (the weights' download, then each batch; the upload of its
    weights is reserved), and stops before a batch that, at its batches' mean so far,
    would end after the deadline. It trains at least ``least_steps`` batches (a round
    below that is not worth its weights' transfer) and at most its whole round.

    Parameters
    ----------
    deadline_s : float
        The round's deadline in device seconds, from the weights' arrival.
    least_steps : int
        Batches it trains whatever the deadline says (>= 1).
    batch_s : Callable[[ClientMeasurement, float], float]
        Device seconds of one batch from what was measured and its wall seconds.
    spent_s : float
        Device seconds already spent before the first batch (the weights' download).
    reserve_s : float
        Device seconds still owed after the last batch (the weights' upload).
    """

    def __init__(self, *, deadline_s: float, least_steps: int,
                 batch_s: Callable[[ClientMeasurement, float], float],
                 spent_s: float = 0.0, reserve_s: float = 0.0) -> None:
        self.deadline_s = deadline_s
        self.least_steps = max(1, least_steps)
        self.batch_s = batch_s
        self.spent_s = spent_s
        self.reserve_s = reserve_s
        self._batches_s = 0.0
        self._batches = 0

    def after_batch(self, work: ClientMeasurement, *, wall_s: float) -> None:
        """Charge one trained batch (an empty DP-SGD step costs nothing here)."""
        seconds = self.batch_s(work, wall_s)
        self.spent_s += seconds
        self._batches_s += seconds
        self._batches += 1

    def reached(self, steps: int) -> bool:
        """Whether the batch after ``steps`` would end after the deadline (and may be skipped)."""
        if steps < self.least_steps or self._batches == 0:
            return False
        next_batch_s = self._batches_s / self._batches
        return self.spent_s + next_batch_s + self.reserve_s > self.deadline_s

    @classmethod
    def emulated(cls, profile: DeviceProfile, *, host_flops_per_s: float, deadline_s: float,
                 least_steps: int, weights_bytes: int) -> DeviceDeadline:
        """Return an emulated device's deadline: its batches on the virtual clock."""

        def batch_s(work: ClientMeasurement, wall_s: float) -> float:
            return virtual_time(work, profile=profile, host_flops_per_s=host_flops_per_s).total_s

        return cls(deadline_s=deadline_s, least_steps=least_steps, batch_s=batch_s,
                   spent_s=weights_bytes / profile.downlink_bytes_per_s,
                   reserve_s=weights_bytes / profile.uplink_bytes_per_s)

    @classmethod
    def measured(cls, *, deadline_s: float, least_steps: int) -> DeviceDeadline:
        """Return a real device's deadline: its batches' own wall time (links included)."""
        return cls(deadline_s=deadline_s, least_steps=least_steps,
                   batch_s=lambda work, wall_s: wall_s)
