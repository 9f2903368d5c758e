"""A round as the trunk serves it: devices and trunk queues overlapping (pure Python).

In split learning a device and the trunk take turns on each batch: the device runs
its stages and sends the activations, the trunk steps and sends back the gradient,
the device finishes its backward pass. While one device computes, the trunk serves
another. :func:`round_seconds` plays a round out batch by batch:

* device ``i`` first waits ``before_s`` (its weights coming down), then for each of
  its ``batches`` spends ``up_s`` (its forward, the activations up, half a round trip),
  queues at its trunk for ``trunk_s`` of service, and spends ``down_s`` (the gradient
  down, half a round trip, its backward and optimiser step); after its last batch,
  ``after_s`` (its weights going up);
* each trunk serves one batch at a time, in the order the batches reach it (first
  come, first served); a device's ``trunk`` says which trunk serves it (a shared
  trunk: all the same; trunk workers: the worker it was dealt to; a trunk copy per
  device, as SplitFed v1 keeps: its own);
* a device that does not wait for the trunk's answer (local loss: it trains on its own
  loss and only sends) goes on with its next batch at once; the trunk's queue of its
  batches still has to empty;
* the round ends when the last device has sent its weights and the trunks are idle.

``max_i T_i + sum_i W_i`` (every trunk step serialised after the slowest device) is
an upper bound of the shared trunk's round and ``max(max_i T_i, sum_i W_i)`` a lower
bound (:func:`bounds`): the queue is where between them a round falls. The
trunk's batching of devices that are ready together (``dataplane.batch_concurrent``)
is not modelled: it only shortens the queue.

``O(N log n)`` for ``N`` batches over ``n`` devices.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Which trunk serves the round's i-th device (in node order) of the given node id:
#: devices given equal values share one.
TrunkOf = Callable[[int, str], int | str]


def shared(_: int, __: str) -> int:
    """Serve every device on one shared trunk."""
    return 0


def own(_: int, node: str) -> str:
    """Serve each device on a trunk copy of its own (SplitFed v1)."""
    return node


def dealt(workers: int) -> TrunkOf:
    """Deal the round's devices to ``workers`` trunk workers in node order (``server.workers``)."""
    return lambda index, _: index % workers


@dataclass(frozen=True)
class DeviceRound:
    """One device's round, in seconds (see the module docstring).

    Parameters
    ----------
    batches : int
        Batches it trains, each one exchange with its trunk (0: weights only).
    before_s, after_s : float
        Before its first batch and after its last (its weights down and up).
    up_s, down_s : float
        Per batch, its own time before the trunk's step and after it.
    trunk_s : float
        Per batch, the trunk's service time.
    trunk : int | str
        Which trunk serves it: devices with equal values share one.
    waits : bool
        Whether it waits for the trunk's answer before ``down_s`` (False: local loss).
    """

    batches: int
    before_s: float
    up_s: float
    trunk_s: float
    down_s: float
    after_s: float
    trunk: int | str = 0
    waits: bool = True

    @property
    def alone_s(self) -> float:
        """Its round with a trunk of its own: no waiting."""
        if not self.waits:
            return round_seconds([self])
        per_batch = self.up_s + self.trunk_s + self.down_s
        return self.before_s + self.batches * per_batch + self.after_s

    @property
    def own_s(self) -> float:
        """Its own time in the round (``T``): everything but the trunk's service."""
        return self.before_s + self.batches * (self.up_s + self.down_s) + self.after_s


def round_seconds(devices: Sequence[DeviceRound]) -> float:
    """Return when the last device of the round is done (0 for none)."""
    if not devices:
        return 0.0
    free_at: dict[int | str, float] = {}
    left = [d.batches for d in devices]
    end = [d.before_s + d.after_s if d.batches == 0 else 0.0 for d in devices]
    # Batches reach the trunks in time order; ties go to the device listed first.
    arrivals = [(d.before_s + d.up_s, i) for i, d in enumerate(devices) if d.batches > 0]
    heapq.heapify(arrivals)
    while arrivals:
        arrived, i = heapq.heappop(arrivals)
        device = devices[i]
        done = max(arrived, free_at.get(device.trunk, 0.0)) + device.trunk_s
        free_at[device.trunk] = done
        left[i] -= 1
        goes_on = done if device.waits else arrived  # from the answer, or from sending
        if left[i]:
            heapq.heappush(arrivals, (goes_on + device.down_s + device.up_s, i))
        else:
            end[i] = max(goes_on + device.down_s + device.after_s, done)
    return max(end)


def sequential_round_seconds(devices: Sequence[DeviceRound]) -> float:
    """Return the round when devices take turns with the trunk (vanilla split learning)."""
    return sum(d.alone_s for d in devices)


def bounds(devices: Sequence[DeviceRound]) -> tuple[float, float]:
    """Return a lower and an upper bound of :func:`round_seconds`.

    Lower: no device finishes before its round alone, and no trunk before its work
    (after the earliest any of its batches can arrive and the least any of its
    devices that wait for it needs after it). Upper: every device's own time, then every trunk step,
    one after another.
    """
    if not devices:
        return 0.0, 0.0
    lower = max(d.alone_s for d in devices)
    for trunk in {d.trunk for d in devices}:
        mine = [d for d in devices if d.trunk == trunk and d.batches > 0]
        if mine:
            work = sum(d.batches * d.trunk_s for d in mine)
            first = min(d.before_s + d.up_s for d in mine)
            last = min((d.down_s + d.after_s) * d.waits for d in mine)
            lower = max(lower, first + work + last)
    upper = max(d.own_s for d in devices) + sum(d.batches * d.trunk_s for d in devices)
    return lower, upper
