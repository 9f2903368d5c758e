"""The delay relay on localhost: it adds its delay each way, keeps order, and reads ahead.

The relay runs as its own process (as in the netns benchmark) in front of a small TCP
server in this process. Timing is only bounded from below: a slow host can only add.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from benchmarks.delay_relay import HOLD_BYTES, start_relay

DELAY_S = 0.05


def _serve_once(handle: Callable[[socket.socket], None]) -> tuple[int, threading.Thread]:
    """Accept one connection on a free localhost port and hand it to ``handle``."""
    listener = socket.create_server(("127.0.0.1", 0))
    # A small receive buffer, inherited by the accepted socket: the kernel may not hold
    # much of what the relay forwards, so what the sender got rid of is in the relay.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)

    def run() -> None:
        with listener, listener.accept()[0] as conn:
            handle(conn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


def _echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


@pytest.fixture
def relay_to() -> Iterator[Callable[[int], int]]:
    """Start a relay with ``DELAY_S`` each way to a localhost port; return its port."""
    procs = []

    def start(port: int) -> int:
        proc, relay_port = start_relay("127.0.0.1:0", f"127.0.0.1:{port}", delay_s=DELAY_S)
        procs.append(proc)
        return relay_port

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=30)


def test_every_round_trip_pays_the_delay_both_ways(relay_to):
    port, server = _serve_once(_echo)
    with socket.create_connection(("127.0.0.1", relay_to(port)), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i in range(5):
            start = time.perf_counter()
            sock.sendall(bytes([i]) * 100)
            echoed = b""
            while len(echoed) < 100:
                echoed += sock.recv(100 - len(echoed))
            assert time.perf_counter() - start >= 2 * DELAY_S
            assert echoed == bytes([i]) * 100
        sock.shutdown(socket.SHUT_WR)  # the half-close crosses too: the echo server ends
        assert sock.recv(1) == b""
    server.join(timeout=30)
    assert not server.is_alive()


def test_a_large_transfer_is_read_ahead_not_held_to_the_delay(relay_to):
    # The far end reads nothing until the sender is done, so whatever the sender got rid
    # of beyond the kernel's buffers is held by the relay while it waits out its delay:
    # it keeps reading rather than taking a chunk per delay (which would pass 64 KiB per
    # 50 ms, 1.3 MB/s). It may hold HOLD_BYTES, so it passes >= HOLD_BYTES / delay.
    payload = os.urandom(HOLD_BYTES)
    sent, digest = threading.Event(), []

    def sink(conn: socket.socket) -> None:
        assert sent.wait(timeout=60)
        received = hashlib.sha256()
        while data := conn.recv(1 << 20):
            received.update(data)
        digest.append(received.hexdigest())

    port, server = _serve_once(sink)
    with socket.create_connection(("127.0.0.1", relay_to(port)), timeout=60) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        start = time.perf_counter()
        sock.sendall(payload)
        sent.set()
        sock.shutdown(socket.SHUT_WR)
        server.join(timeout=60)
        elapsed = time.perf_counter() - start
    assert digest == [hashlib.sha256(payload).hexdigest()]  # every byte, in order
    assert elapsed >= DELAY_S
