"""The virtual clock: what a round would have cost on the emulated devices.

Clients measure what they really did here (compute, bytes, exchanges); the clock
charges the compute at the device's speed and adds the link: ``flops / device_flops +
up / uplink + down / downlink + exchanges * rtt``, where ``flops`` are the FLOPs the
device's step executed (counted) or, without a count, the seconds this host took times
its FLOP/s. A round is those devices played out batch by batch at the
trunk (:mod:`splitlearn.planning.queue`). Pure Python: real deployments feed the
same functions with their own measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitlearn.planning.devices import DeviceProfile


@dataclass(frozen=True)
class ClientMeasurement:
    """What one client really did in a round, measured on this host.

    Parameters
    ----------
    compute_s : float
        Seconds of client-side compute (forward, backward, optimiser step).
    bytes_up, bytes_down : int
        Data-plane bytes sent and received.
    exchanges : int
        Round trips with the trunk (one per batch for SplitFed).
    flops : float | None
        FLOPs the device's compute executed, where they were counted: the device's
        compute is then those FLOPs at its own speed, whatever this host's load (None:
        ``compute_s`` rescaled).
    """

    compute_s: float
    bytes_up: int
    bytes_down: int
    exchanges: int
    flops: float | None = None


@dataclass(frozen=True)
class ClientTime:
    """Virtual seconds one client would have needed, by cause."""

    compute_s: float
    upload_s: float
    download_s: float
    latency_s: float

    @property
    def total_s(self) -> float:
        """All causes added up (they do not overlap in lock-step split learning)."""
        return self.compute_s + self.upload_s + self.download_s + self.latency_s


def client_time(
    work: ClientMeasurement, device: DeviceProfile, *, host_flops_per_s: float
) -> ClientTime:
    """Convert a measurement on this host into the device's time.

    Parameters
    ----------
    work : ClientMeasurement
        Measured compute, bytes and exchanges.
    device : DeviceProfile
        The emulated device.
    host_flops_per_s : float
        Sustained training FLOP/s of this host on the same workload (so that
        ``compute_s * host_flops_per_s`` are the FLOPs that were executed).

    Returns
    -------
    ClientTime
        Virtual seconds per cause.
    """
    if host_flops_per_s <= 0:
        raise ValueError(f"host_flops_per_s must be > 0, got {host_flops_per_s}")
    compute = (work.compute_s * host_flops_per_s if work.flops is None else work.flops)
    return ClientTime(
        compute_s=compute / device.flops_per_s,
        upload_s=work.bytes_up / device.uplink_bytes_per_s,
        download_s=work.bytes_down / device.downlink_bytes_per_s,
        latency_s=work.exchanges * device.rtt_s,
    )


class VirtualClock:
    """Accumulates virtual time over rounds (stateful; the maths above is not)."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds``; return the new time."""
        if seconds < 0:
            raise ValueError(f"time cannot go backwards ({seconds} s)")
        self.now_s += seconds
        return self.now_s
