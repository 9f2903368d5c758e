"""Device emulation on the client: profile, availability, dropout, memory, pacing.

A client works out its own device profile from the fleet description in its
task (the assignment is a pure function of the seed), so the server never has
to know which node holds which partition. Each round the device may be
unavailable, may vanish mid-round, may lack the memory for its cut, and — with
``emulate`` — really takes as long as the device would. No Flower imports.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import torch

from splitlearn.calibration import client_train_memory_bytes
from splitlearn.data import describe_dataset
from splitlearn.models import build_model
from splitlearn.planning.clock import ClientMeasurement, ClientTime, client_time
from splitlearn.planning.devices import DeviceProfile, build_fleet
from splitlearn.task import SplitTask
from splitlearn.transport import TrunkReply, TrunkSession


class DeviceFailure(RuntimeError):
    """A device-side reason not to finish the round; ``kind`` names it."""

    kind = "failed"

    def __init__(self, message: str) -> None:
        # The tag survives Flower's error reply, so the server can tell causes apart.
        super().__init__(f"[{self.kind}] {message}")


class ClientUnavailable(DeviceFailure):
    """The device was not reachable this round."""

    kind = "unavailable"


class InjectedDropout(DeviceFailure):
    """The device vanished mid-round."""

    kind = "dropout"


class MemoryBudgetExceeded(DeviceFailure):
    """The client side at this cut does not fit the device's memory."""

    kind = "memory"


@dataclass(frozen=True)
class DevicePlan:
    """What this device does this round.

    Parameters
    ----------
    profile : DeviceProfile | None
        The emulated device, or None without emulation.
    available : bool
        Whether it is reachable at all.
    fail_after_steps : int
        Vanish after this many batches; -1 never.
    """

    profile: DeviceProfile | None
    available: bool
    fail_after_steps: int


def device_profile(
    task: SplitTask, *, partition_id: int, num_partitions: int
) -> DeviceProfile | None:
    """Recompute this client's profile from the fleet description in ``task``."""
    if not task.devices:
        return None
    fleet = json.loads(task.devices)
    profiles = build_fleet(
        num_clients=num_partitions, mix=fleet["mix"], profiles=fleet["profiles"], seed=task.seed
    )
    return profiles[partition_id] if profiles else None


def plan_round(task: SplitTask, *, partition_id: int, num_partitions: int) -> DevicePlan:
    """Draw this round's availability and dropout (seeded by seed, round, partition)."""
    profile = device_profile(task, partition_id=partition_id, num_partitions=num_partitions)
    rng = random.Random(f"{task.seed}/{task.server_round}/{partition_id}")
    availability = profile.availability if profile else 1.0
    dropout = 1 - (1 - (profile.dropout if profile else 0.0)) * (1 - task.dropout_rate)
    available = rng.random() < availability
    drops = rng.random() < dropout
    return DevicePlan(profile, available, task.dropout_after_steps if drops else -1)


def check_memory(task: SplitTask, profile: DeviceProfile | None, *, whole: bool = False) -> int:
    """Estimated client-side training bytes; raise if the profile cannot hold them.

    ``whole=True`` checks the whole model (the FedAvg baseline) instead of the
    stages below the task's cut.
    """
    spec = describe_dataset(task.dataset, image_size=task.resize_to)
    model = build_model(
        task.model, in_channels=spec.in_channels, image_size=spec.image_size,
        num_classes=spec.num_classes, **task.model_kwargs(),
    )
    cut = model.num_stages if whole else task.cut
    needed = client_train_memory_bytes(model, cut, batch_size=task.batch_size)
    if profile is not None and needed > profile.memory_bytes:
        raise MemoryBudgetExceeded(
            f"cut {cut} at batch {task.batch_size} needs {needed / 2**20:.1f} MiB; "
            f"{profile.name} has {profile.memory_bytes / 2**20:.1f} MiB"
        )
    return needed


def virtual_time(
    *, compute_s: float, bytes_up: int, bytes_down: int, exchanges: int,
    profile: DeviceProfile | None, host_flops_per_s: float,
) -> ClientTime:
    """Convert what was measured here into device time (host time without a profile)."""
    if profile is None or host_flops_per_s <= 0:
        return ClientTime(compute_s=compute_s, upload_s=0.0, download_s=0.0, latency_s=0.0)
    work = ClientMeasurement(compute_s, bytes_up, bytes_down, exchanges)
    return client_time(work, profile, host_flops_per_s=host_flops_per_s)


class EmulatedSession:
    """Wraps a session so that it takes as long as the device would.

    Before each exchange it sleeps for the extra compute a slower device would
    have needed since the previous reply (measured here, scaled by
    ``host_flops_per_s / profile.flops_per_s``), then for the upload and half the
    round trip; after the reply, for the download and the other half.
    """

    def __init__(self, inner: TrunkSession, profile: DeviceProfile, *, host_flops_per_s: float):
        self.inner = inner
        self.profile = profile
        self.slowdown = max(host_flops_per_s / profile.flops_per_s, 1.0)
        self._last = time.perf_counter()

    @property
    def bytes_up(self) -> int:
        """Bytes sent by the wrapped session."""
        return self.inner.bytes_up

    @property
    def bytes_down(self) -> int:
        """Bytes received by the wrapped session."""
        return self.inner.bytes_down

    def _pace(self, call, activations: torch.Tensor, labels: torch.Tensor) -> TrunkReply:  # noqa: ANN001
        local = time.perf_counter() - self._last
        up_before = self.inner.bytes_up
        down_before = self.inner.bytes_down
        # The frame size is known only after encoding; pay the upload after
        # sending, which keeps the total the same.
        time.sleep(local * (self.slowdown - 1) + self.profile.rtt_s / 2)
        reply = call(activations, labels)
        sent = self.inner.bytes_up - up_before
        received = self.inner.bytes_down - down_before
        time.sleep(
            sent / self.profile.uplink_bytes_per_s
            + received / self.profile.downlink_bytes_per_s
            + self.profile.rtt_s / 2
        )
        self._last = time.perf_counter()
        return reply

    def exchange(self, activations: torch.Tensor, labels: torch.Tensor) -> TrunkReply:
        """Exchange one batch, paced like the device."""
        return self._pace(self.inner.exchange, activations, labels)

    def evaluate(self, activations: torch.Tensor, labels: torch.Tensor) -> TrunkReply:
        """Evaluate one batch, paced like the device."""
        return self._pace(self.inner.evaluate, activations, labels)

    def close(self) -> None:
        """Close the wrapped session."""
        self.inner.close()
