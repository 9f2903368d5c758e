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

import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import FrameError, decode_request, encode_tensor, request
from splitlearn.dataplane.frames import _varint

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
    """Time every kind of frame at every size; print a line each and a JSON line."""
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
