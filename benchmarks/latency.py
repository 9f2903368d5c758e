"""Data-plane round trip per batch against a raw gRPC stream of the same bytes.

``python -m benchmarks latency [overrides ...]``

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

Both servers run in a process of their own, as deployed (a device and the
trunk never share an interpreter, so neither side's Python waits for the
other's), and then in the client's process, where both sides' Python takes
turns under one GIL. Both stacks are measured interleaved in blocks of 20; the
median per round trip is reported and the last line is JSON with the worst
ratio in each placement.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import queue
import statistics
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from multiprocessing.connection import Connection

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

    def __init__(self, cut_shape: tuple[int, ...], dataplane: DataPlaneConfig) -> None:
        self.cut_shape = cut_shape
        self.dataplane = dataplane

    def handle(self, session: object, request: AnyRequest) -> AnyReply:
        """Decode and check the activations and labels; reply with the activations."""
        part = request.forward
        acts = check_activations(present(part, "activations"), cut_shape=self.cut_shape,
                                 max_batch=self.dataplane.max_batch,
                                 max_bytes=self.dataplane.max_frame_bytes,
                                 max_abs=self.dataplane.max_abs_value)
        check_labels(present(part, "labels"), batch=len(acts), num_classes=10,
                     max_bytes=self.dataplane.max_frame_bytes)
        return reply("gradient", grad=encode_tensor(acts), loss=0.0, correct=0)

    def attach(self, session: object) -> None:
        """Nothing kept per stream."""

    def detach(self, session: object) -> None:
        """Nothing kept per stream."""


class RawEchoServer:
    """A bare gRPC server echoing every frame of a bidirectional stream."""

    def __init__(self, max_bytes: int) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2),
                                  options=message_limits(max_bytes))
        service, method = RAW_METHOD.strip("/").split("/")
        handler = grpc.stream_stream_rpc_method_handler(lambda frames, _: iter(frames))
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop(0)


class RawEchoClient:
    """One stream to a :class:`RawEchoServer`, one frame in flight at a time."""

    def __init__(self, address: str, max_bytes: int) -> None:
        self.channel = grpc.insecure_channel(address, options=message_limits(max_bytes))
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
        """End the stream."""
        self.requests.put(None)
        self.channel.close()


def message_limits(max_bytes: int) -> list[tuple[str, int]]:
    """Return the channel options for messages of up to ``max_bytes`` each way."""
    return [("grpc.max_receive_message_length", max_bytes),
            ("grpc.max_send_message_length", max_bytes)]


class Servers:
    """The shipped service (one echo session per payload) and the raw echo, side by side.

    ``addresses`` holds the data plane's and the raw server's, and one token per
    payload (protocol ``echo-I`` for ``PAYLOADS[I]``).
    """

    def __init__(self, dataplane: DataPlaneConfig) -> None:
        tokens = TokenRegistry()
        sessions = {f"echo-{i}": EchoSession(shape, dataplane)
                    for i, (_, shape) in enumerate(PAYLOADS)}
        self.service = TrunkService(TrunkEndpoint(sessions, tokens, dataplane=dataplane))
        self.service.start()
        self.raw = RawEchoServer(dataplane.max_frame_bytes)
        self.addresses = {
            "data_plane": self.service.address, "raw": self.raw.address,
            "tokens": [tokens.issue(client="bench", protocol=name, cut=1, server_round=1,
                                    ttl_s=3600) for name in sessions],
        }

    def stop(self) -> None:
        """Stop both servers."""
        self.service.stop(0)
        self.raw.stop()


def serve_in_child(conn: Connection) -> None:
    """Run a server process: start :class:`Servers`, send their addresses, wait."""
    torch.set_num_threads(1)
    servers = Servers(DataPlaneConfig())
    conn.send(servers.addresses)
    conn.recv()  # anything, or the parent gone (EOFError): stop
    servers.stop()


@contextlib.contextmanager
def running_servers(dataplane: DataPlaneConfig, *, own_process: bool) -> Iterator[dict]:
    """Start the servers here or in a process of their own; yield their addresses."""
    if not own_process:
        servers = Servers(dataplane)
        try:
            yield servers.addresses
        finally:
            servers.stop()
        return
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=serve_in_child, args=(child,), daemon=True)
    process.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the benchmark's server process did not start in 120 s")
        yield parent.recv()
    finally:
        with contextlib.suppress(OSError):  # a server process already gone has no pipe
            parent.send("stop")
        process.join(10)
        if process.is_alive():
            process.kill()


def timed(run, *, repeats: int) -> list[float]:  # noqa: ANN001 - a callable of no arguments
    """Wall seconds of ``repeats`` calls of ``run``."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return samples


def measure_payload(index: int, addresses: dict, dataplane: DataPlaneConfig, *, blocks: int,
                    block: int) -> tuple[int, float, float]:
    """Return payload ``index``'s request frame bytes and the median ms of both stacks."""
    shape = PAYLOADS[index][1]
    channel = TrunkChannel(GrpcTransport(addresses["data_plane"], addresses["tokens"][index]))
    acts, labels = torch.rand(BATCH, *shape), torch.randint(0, 10, (BATCH,))
    frame = build(pb.Request, seq=1, forward={
        "activations": encode_tensor(acts), "labels": encode_tensor(labels)}).SerializeToString()
    raw = RawEchoClient(addresses["raw"], dataplane.max_frame_bytes)
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
        raw.close()
    return len(frame), statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3


def bench_latency(overrides: Sequence[str], *, blocks: int = 25, block: int = 20) -> float:
    """Print each payload's medians and ratio; return the worst with the servers apart.

    The servers run in a process of their own first (as deployed: a device and the
    server never share an interpreter), then in the client's.
    """
    torch.set_num_threads(1)
    dataplane = DataPlaneConfig()
    rows = []
    for own_process in (True, False):
        placement = "two processes" if own_process else "one process"
        with running_servers(dataplane, own_process=own_process) as addresses:
            for index, (label, _) in enumerate(PAYLOADS):
                size, mine, bare = measure_payload(index, addresses, dataplane, blocks=blocks,
                                                   block=block)
                rows.append({"placement": placement, "payload": label, "frame_bytes": size,
                             "data_plane_ms": mine, "raw_grpc_ms": bare, "ratio": mine / bare})
                print(f"{placement:>13}, {label:>32}: {size / 2**20:5.2f} MiB a frame; data "
                      f"plane {mine:7.3f} ms, raw gRPC {bare:7.3f} ms per round trip "
                      f"({mine / bare:.2f}x)", flush=True)
    worst = {p: max(r["ratio"] for r in rows if r["placement"] == p)
             for p in ("two processes", "one process")}
    print(json.dumps({"worst_data_plane_over_raw_grpc": worst["two processes"],
                      "worst_in_one_process": worst["one process"], "payloads": rows}))
    return worst["two processes"]
