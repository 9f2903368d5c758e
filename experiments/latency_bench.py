"""Data-plane round trip per batch against a raw gRPC stream of the same bytes.

``python -m experiments.bench latency [overrides ...]``

For each payload (a batch of activations: 32 rows of 1 KiB, 8 KiB (the SmallCNN at
cut 1), 64 KiB (the ResNet-style network at 32x32, cut 1) and 256 KiB):

* **data plane**: the shipped client channel (``TrunkChannel`` over
  ``GrpcTransport``) sends ``Forward`` requests to the shipped service
  (``TrunkService`` and ``TrunkEndpoint``: token, sequence and size checks,
  decoding and every value check of the activations and labels), whose session
  answers with a ``Gradient`` of the same shape (the activations themselves, so
  that the trunk's own compute is left out: it is the same on both sides);
* **raw gRPC**: a bidirectional stream on a bare ``grpc.server`` that echoes
  bytes, sent the same number of bytes as the data plane's request frame, one
  at a time, on the same loopback.

Both are measured interleaved in blocks of 20; the median per round trip is
reported and the last line is JSON with the worst ratio.
"""

from __future__ import annotations

import json
import queue
import statistics
import time
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import torch

from splitlearn.config import DataPlaneConfig
from splitlearn.dataplane import (
    GrpcTransport,
    TokenRegistry,
    TrunkChannel,
    TrunkEndpoint,
    TrunkService,
)
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import (
    AnyReply,
    AnyRequest,
    build,
    check_activations,
    check_labels,
    encode_tensor,
    present,
    reply,
)

#: Per-row activation shapes of the payloads (float32, batch 32).
PAYLOADS = (("1 KiB/row", (16, 4, 4)), ("8 KiB/row (SmallCNN, cut 1)", (32, 8, 8)),
            ("64 KiB/row (ResNet 32x32, cut 1)", (16, 32, 32)), ("256 KiB/row", (64, 32, 32)))
BATCH = 32
RAW_METHOD = "/bench.Raw/Echo"


class EchoSession:
    """A session handler that checks a batch like a trunk and sends it back as the gradient."""

    def __init__(self, cut_shape: tuple[int, ...], limits: DataPlaneConfig) -> None:
        self.cut_shape = cut_shape
        self.limits = limits

    def handle(self, session: object, request: AnyRequest) -> AnyReply:
        """Decode and check the activations and labels; reply with the activations."""
        part = request.forward
        acts = check_activations(present(part, "activations"), cut_shape=self.cut_shape,
                                 max_batch=self.limits.max_batch,
                                 max_bytes=self.limits.max_frame_bytes,
                                 max_abs=self.limits.max_abs_value)
        check_labels(present(part, "labels"), batch=len(acts), num_classes=10,
                     max_bytes=self.limits.max_frame_bytes)
        return reply("gradient", grad=encode_tensor(acts), loss=0.0, correct=0)

    def attach(self, session: object) -> None:
        """Nothing kept per stream."""

    def detach(self, session: object) -> None:
        """Nothing kept per stream."""


class RawEcho:
    """A bare gRPC server echoing every frame of a bidirectional stream, and one client."""

    def __init__(self, max_bytes: int) -> None:
        options = [("grpc.max_receive_message_length", max_bytes),
                   ("grpc.max_send_message_length", max_bytes)]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=options)
        service, method = RAW_METHOD.strip("/").split("/")
        handler = grpc.stream_stream_rpc_method_handler(lambda frames, _: iter(frames))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        self.requests: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.replies = self.channel.stream_stream(RAW_METHOD)(self._frames())

    def _frames(self) -> Iterator[bytes]:
        while (frame := self.requests.get()) is not None:
            yield frame

    def round_trip(self, frame: bytes) -> bytes:
        """Send one frame and wait for its echo."""
        self.requests.put(frame)
        return next(self.replies)

    def close(self) -> None:
        """End the stream and stop the server."""
        self.requests.put(None)
        self.channel.close()
        self.server.stop(0)


def timed(run, *, repeats: int) -> list[float]:  # noqa: ANN001 - a callable of no arguments
    """Wall seconds of ``repeats`` calls of ``run``."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return samples


def measure_payload(shape: tuple[int, ...], limits: DataPlaneConfig, *, blocks: int, block: int
                    ) -> tuple[int, float, float]:
    """Return the request frame's bytes and the median ms of the data plane and of raw gRPC."""
    tokens = TokenRegistry()
    endpoint = TrunkEndpoint({"echo": EchoSession(shape, limits)}, tokens, limits=limits)
    service = TrunkService(endpoint)
    service.start()
    token = tokens.issue(client="bench", protocol="echo", cut=1, server_round=1, ttl_s=3600)
    channel = TrunkChannel(GrpcTransport(service.address, token))
    acts, labels = torch.rand(BATCH, *shape), torch.randint(0, 10, (BATCH,))
    frame = build(pb.Request, seq=1, forward={
        "activations": encode_tensor(acts), "labels": encode_tensor(labels)}).SerializeToString()
    raw = RawEcho(4 * len(frame))
    ours, theirs = [], []
    try:
        for _ in range(2):  # warm-up: connections, first allocations
            channel.forward(acts, labels)
            raw.round_trip(frame)
        for _ in range(blocks):
            ours += timed(lambda: channel.forward(acts, labels), repeats=block)
            theirs += timed(lambda: raw.round_trip(frame), repeats=block)
    finally:
        channel.close()
        service.stop(0)
        raw.close()
    return len(frame), statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3


def bench_latency(overrides: Sequence[str], *, blocks: int = 25, block: int = 20) -> float:
    """Print each payload's medians and ratio; return the worst ratio (data plane / raw)."""
    torch.set_num_threads(1)
    limits = DataPlaneConfig()
    rows = []
    for label, shape in PAYLOADS:
        size, mine, bare = measure_payload(shape, limits, blocks=blocks, block=block)
        rows.append({"payload": label, "frame_bytes": size, "data_plane_ms": mine,
                     "raw_grpc_ms": bare, "ratio": mine / bare})
        print(f"{label:>34}: {size / 2**20:6.2f} MiB a frame; data plane {mine:7.3f} ms, "
              f"raw gRPC {bare:7.3f} ms per round trip ({mine / bare:.2f}x)", flush=True)
    worst = max(r["ratio"] for r in rows)
    print(json.dumps({"worst_data_plane_over_raw_grpc": worst, "payloads": rows}))
    return worst
