"""What the virtual clock charges for a round: its devices' rows played out at the trunk.

Each device that finished reports its virtual seconds by cause (compute, upload,
download, latency), its batches and the bytes of its weights among what it sent and
received (:func:`clients.app` metrics, one ``clients.csv`` row each). The trunk's busy
seconds for the round are measured here. :func:`device_rounds` turns them into
:class:`~splitlearn.planning.queue.DeviceRound` s and
:func:`~splitlearn.planning.queue.round_seconds` plays the round out, devices and
trunk overlapping as they do (:mod:`splitlearn.planning.queue`).

What is measured whole is split by what it is made of:

* the weights' share of a device's upload and download time (by their bytes) is its
  ``after_s`` and ``before_s``; the rest is per batch;
* a batch's compute is a third forward (before the trunk) and two thirds backward
  (after it), its round trips half each way;
* the trunk's busy seconds are shared among the devices by the trunk work each
  caused (examples x the trunk's training FLOPs per example at its cut; by examples
  when those are not given), and evenly among a device's batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from splitlearn.planning.cost import TRAIN_TO_FORWARD_FLOPS
from splitlearn.planning.queue import DeviceRound, TrunkOf, shared


def device_rounds(rows: Sequence[dict[str, Any]], *, trunk_s: float,
                  trunk_flops: Mapping[int, float] | None = None,
                  trunk_of: TrunkOf = shared, waits: bool = True) -> list[DeviceRound]:
    """Return the finished rows (status ``ok``) as device rounds, in node order.

    Parameters
    ----------
    rows : Sequence[dict]
        The round's ``clients.csv`` rows.
    trunk_s : float
        The trunk's busy seconds in the round (all workers together).
    trunk_flops : Mapping[int, float] | None
        The trunk's training FLOPs per example by cut (how its time is shared).
    trunk_of : TrunkOf
        Which trunk serves each device.
    waits : bool
        Whether devices wait for the trunk's answer to each batch (not with local loss).
    """
    done = sorted((r for r in rows if r.get("status") == "ok"),
                  key=lambda r: int(r.get("node_id", 0) or 0))
    work = [float(r.get("num_examples", 0)) * (float(r.get("steps", 0)) > 0) * (
        trunk_flops.get(int(r.get("cut", 0)), 1.0) if trunk_flops else 1.0) for r in done]
    total = sum(work)
    shares = [w / total if total > 0 else 1 / len(done) for w in work]
    return [replace(_device_round(row, trunk_s * share, trunk_of(i, str(row.get("node_id")))),
                    waits=waits)
            for i, (row, share) in enumerate(zip(done, shares, strict=True))]


def _device_round(row: dict[str, Any], trunk_s: float, trunk: int | str) -> DeviceRound:
    steps = int(float(row.get("steps", 0)))
    total = float(row["virtual_s"])
    if steps <= 0:
        return DeviceRound(0, total, 0.0, 0.0, 0.0, 0.0, trunk)
    compute = float(row.get("virtual_compute_s", 0.0))
    up, down = float(row.get("virtual_upload_s", 0.0)), float(row.get("virtual_download_s", 0.0))
    weights_up = up * _share(row, "weights_bytes_up", "bytes_up")
    weights_down = down * _share(row, "weights_bytes_down", "bytes_down")
    latency = float(row.get("virtual_latency_s", 0.0))
    forward = compute / TRAIN_TO_FORWARD_FLOPS
    return DeviceRound(
        steps, before_s=weights_down,
        up_s=(forward + up - weights_up + latency / 2) / steps,
        trunk_s=trunk_s / steps,
        down_s=(compute - forward + down - weights_down + latency / 2) / steps,
        after_s=weights_up, trunk=trunk)


def _share(row: dict[str, Any], part: str, whole: str) -> float:
    """Return ``part`` / ``whole`` of the row's bytes (0 without them)."""
    whole_bytes = float(row.get(whole, 0.0))
    return min(float(row.get(part, 0.0)) / whole_bytes, 1.0) if whole_bytes > 0 else 0.0
