"""The worst frames a device can send, timed through the trunk's decoder: ``bench parser``.

Each kind of frame is built at sizes up to the default frame limit (64 MiB) and decoded
as the endpoint decodes every request (:func:`splitlearn.dataplane.codec.decode_request`):
repeated shape entries (unpacked and packed: the 2026-12 attack took 13-21 s for 175 KiB),
unknown fields, a field seen again (merged), groups nested to protobuf's limit, and an
honest batch of the same size for comparison. Prints seconds per frame and per MiB, then
a JSON line. The reader visits at most ``MAX_FRAME_FIELDS`` fields, so time per frame
stays flat as frames grow, and an honest frame costs what its tensors' bytes cost.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from protocols.splitfed import SplitFedV2Options
from server.standalone import ServedTrunk, serve_trunk
from splitlearn.config import DataPlaneConfig
from splitlearn.dataplane import GrpcTransport, TrunkChannel, TrunkRejected
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import FrameError, decode_request, encode_tensor, request
from splitlearn.dataplane.frames import _varint
from splitlearn.models import build_model
from splitlearn.stages import split

SIZES_MIB = (0.17, 1, 8, 64)
LIMIT = 64 << 20


def _field(number: int, body: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def _forward(tensor: bytes) -> bytes:
    return b"\x08\x01" + _field(2, _field(1, tensor))


def repeated_entries(size: int) -> bytes:
    """Return a tensor whose shape repeats ``1`` until the frame is ``size`` bytes (unpacked)."""
    return _forward(b"\x08\x01" + b"\x10\x01" * (size // 2))


def packed_entries(size: int) -> bytes:
    """Return the repeated entries as one packed run of varints."""
    return _forward(b"\x08\x01" + _field(2, b"\x01" * size))


def unknown_fields(size: int) -> bytes:
    """Field 15 (unknown to Request), one byte each, until ``size``."""
    return b"\x08\x01" + b"\x78\x01" * (size // 2)


def merged_messages(size: int) -> bytes:
    """Return the forward field sent again and again, empty each time (protobuf merges them)."""
    return b"\x08\x01" + b"\x12\x00" * (size // 2)


def nested_groups(size: int) -> bytes:
    """Return groups nested to protobuf's limit of 100, repeated until ``size``."""
    group = b"\x7b" * 99 + b"\x7c" * 99
    return b"\x08\x01" + group * max(1, size // len(group))


def honest_batch(size: int) -> bytes:
    """Return a well-formed forward of float32 activations of about ``size`` bytes."""
    rows = max(1, size // (4 * 1024) - 1)  # under the limit with the framing
    acts = torch.randn(rows, 1024)
    frame = request(1, "forward", activations=encode_tensor(acts),
                    labels=encode_tensor(torch.zeros(rows, dtype=torch.int64)))
    return frame.SerializeToString()


KINDS: dict[str, Callable[[int], bytes]] = {
    "repeated entries": repeated_entries, "packed entries": packed_entries,
    "unknown fields": unknown_fields, "merged messages": merged_messages,
    "nested groups": nested_groups, "honest batch": honest_batch,
}


def decode_seconds(data: bytes, *, repeats: int) -> tuple[float, str]:
    """Median seconds to decode ``data`` as the endpoint does, and the outcome."""
    times, outcome = [], ""
    for _ in range(repeats):
        started = time.perf_counter()
        try:
            decode_request(data, max_bytes=LIMIT)
            outcome = "accepted"
        except FrameError as err:
            outcome = f"refused {pb.Refusal.Reason.Name(err.reason)}"
        times.append(time.perf_counter() - started)
    return statistics.median(times), outcome


def bench_parser(overrides: Sequence[str], *, repeats: int = 5) -> None:
    """Time every kind of frame at every size, then flood a live trunk with them.

    A line each and a JSON line; the floods are :func:`bench_flood`'s.
    """
    if overrides:
        raise ValueError(f"the parser benchmark takes no overrides (got {list(overrides)})")
    rows = []
    for kind, build in KINDS.items():
        for mib in SIZES_MIB:
            data = build(min(LIMIT - 64, int(mib * (1 << 20))))
            seconds, outcome = decode_seconds(data, repeats=repeats)
            per_mib = seconds / (len(data) / (1 << 20))
            rows.append({"kind": kind, "bytes": len(data), "seconds": seconds,
                         "seconds_per_mib": per_mib, "outcome": outcome})
            print(f"{kind:>17} {len(data) / (1 << 20):8.2f} MiB: {seconds * 1e3:8.2f} ms "
                  f"({per_mib * 1e3:8.3f} ms/MiB) {outcome}", flush=True)
    print(json.dumps({"parser": rows}))
    bench_flood()


# --- the same frames against a live trunk, while an honest device trains --------------------

#: Frames a flooding device sends, one after another on its own stream (each is refused).
FLOOD = {"repeated entries, 175 KiB (the 2026-12 attack)": lambda: repeated_entries(175 << 10),
         "repeated entries, 8 MiB": lambda: repeated_entries(8 << 20),
         "nested groups, 8 MiB": lambda: nested_groups(8 << 20)}


def honest_steps(served: ServedTrunk, seconds: float) -> float:
    """Return the steps a second of an honest SmallCNN device at cut 1 on digits (batch 32)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10, seed=0)
    bottom = split(model, 1)[0].requires_grad_(False)
    channel = TrunkChannel(GrpcTransport(served.address, served.grant("honest", cut=1),
                                         max_frame_bytes=LIMIT), max_frame_bytes=LIMIT)
    steps, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        at = (steps * 32) % (len(images) - 32)
        channel.forward(bottom(images[at:at + 32]), labels[at:at + 32])
        steps += 1
    elapsed = time.perf_counter() - started
    channel.close()
    return steps / elapsed


class Flood:
    """A device sending ``frame`` again and again on one stream until stopped or closed."""

    def __init__(self, served: ServedTrunk, frame: bytes) -> None:
        self.transport = GrpcTransport(served.address, served.grant("flood", cut=1),
                                       max_frame_bytes=LIMIT)
        self.frame, self.sent, self.refusals = frame, 0, Counter()
        self.started = time.perf_counter()
        self.closed_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.transport.send(self.frame)
                reply = pb.Reply.FromString(self.transport.receive(60.0))
            except TrunkRejected:  # the trunk closed the stream (revoked)
                self.closed_at = time.perf_counter()
                return
            self.sent += 1
            self.refusals[pb.Refusal.Reason.Name(reply.refusal.reason)] += 1

    def join(self) -> None:
        """Wait for the flood to end by itself (its stream closed)."""
        self._thread.join(timeout=60)

    def stop(self) -> None:
        """Stop sending; drop the stream."""
        self._stop.set()
        self._thread.join(timeout=60)
        self.transport.abort()


#: The trunk's settings a flood meets: as shipped, and never closing a session for refusals.
FLOOD_SETTINGS = {"shipped": DataPlaneConfig(), "max_refusals=0": DataPlaneConfig(max_refusals=0)}


def bench_flood(*, seconds: float = 8.0, repeats: int = 2) -> list[dict]:
    """Time an honest device beside each flood and without it, alternating, per setting.

    Also how long the flood lasted (shipped: until ``dataplane.max_refusals`` closed it),
    how soon revoking the flooding device's token ends its stream, and how long stopping
    the service takes while a flood runs. A line each and a JSON line.
    """
    rows = []
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10, seed=0)
    for kind, build in FLOOD.items():
        frame = build()
        for setting, dataplane in FLOOD_SETTINGS.items():
            alone, flooded, revokes, stops, lasted, sent = [], [], [], [], [], 0
            refusals: Counter[str] = Counter()
            for _ in range(repeats):
                served = serve_trunk(copy.deepcopy(model), SplitFedV2Options(lr=0.05), dataplane)
                alone.append(honest_steps(served, seconds))
                flood = Flood(served, frame)
                flooded.append(honest_steps(served, seconds))
                revoked = time.perf_counter()
                served.finish_round([])  # revokes the round's tokens, the flood's among them
                flood.join()
                closed = flood.closed_at or math.inf
                lasted.append(min(closed, revoked) - flood.started)
                if closed > revoked:  # still flooding when revoked
                    revokes.append(closed - revoked)
                sent += flood.sent
                refusals.update(flood.refusals)
                flood.stop()
                second = Flood(served, frame)  # stopping the service while one floods
                time.sleep(0.2)
                stopping = time.perf_counter()
                served.stop()
                stops.append(time.perf_counter() - stopping)
                second.stop()
            row = {"flood": kind, "setting": setting, "frame_bytes": len(frame),
                   "honest_steps_per_s_alone": statistics.median(alone),
                   "honest_steps_per_s_flooded": statistics.median(flooded),
                   "flood_frames": sent / repeats, "flood_lasted_s": max(lasted),
                   "refusals": dict(refusals),
                   "revoke_to_closed_s": max(revokes, default=None), "stop_s": max(stops)}
            rows.append(row)
            revoke = ("closed before" if row["revoke_to_closed_s"] is None
                      else f"{row['revoke_to_closed_s'] * 1e3:.0f} ms")
            print(f"{kind:>46} [{setting:>14}]: honest {row['honest_steps_per_s_alone']:5.1f} "
                  f"steps/s alone, {row['honest_steps_per_s_flooded']:5.1f} flooded; "
                  f"{row['flood_frames']:.0f} frames in {row['flood_lasted_s']:.2f} s; "
                  f"revoked -> closed {revoke}; stop {row['stop_s']:.2f} s", flush=True)
    print(json.dumps({"flood": rows}))
    return rows
