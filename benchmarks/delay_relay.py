"""A TCP relay that delays every byte by a fixed time each way and limits nothing else.

``python -m benchmarks.delay_relay --listen HOST:PORT --to HOST:PORT --delay-ms D``
accepts connections on ``--listen``, opens one to ``--to`` for each, and forwards the
bytes in both directions, each chunk written ``D`` ms after it arrived. Reading goes on
while chunks wait out their delay, so the relay adds latency, not a bandwidth limit: it
holds up to :data:`HOLD_BYTES` per direction, which passes at least ``HOLD_BYTES / D``
(3.2 GB/s at 20 ms), far above any shaped link behind it. Order is kept (one delay line
per direction), and an end's half-close is forwarded after the same delay.

It stands in for ``tc netem delay`` where the kernel has no ``netem``: a latency in user
space, put in front of a link whose bandwidth the kernel shapes. It prints
``listening HOST:PORT`` (the port it got) once it accepts, then runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import tempfile
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: Bytes read at once.
CHUNK_BYTES = 64 * 1024
#: Bytes one direction may hold before it stops reading (TCP then pushes back as usual).
HOLD_BYTES = 64 * 1024 * 1024


class _Budget:
    """Bytes a direction may still take in; reading waits while none are left."""

    def __init__(self, limit: int) -> None:
        self.free = limit
        self._changed = asyncio.Condition()

    async def take(self, n: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.free > 0)
            self.free -= n

    async def give(self, n: int) -> None:
        async with self._changed:
            self.free += n
            self._changed.notify_all()


async def _take_in(reader: asyncio.StreamReader, line: asyncio.Queue, budget: _Budget,
                   delay_s: float) -> None:
    """Stamp each chunk on arrival with the time it is due; the EOF too (as ``b""``)."""
    loop = asyncio.get_running_loop()
    while data := await reader.read(CHUNK_BYTES):
        line.put_nowait((loop.time() + delay_s, data))
        await budget.take(len(data))
    line.put_nowait((loop.time() + delay_s, b""))


async def _give_out(line: asyncio.Queue, writer: asyncio.StreamWriter,
                    budget: _Budget) -> None:
    """Write each chunk once it is due, in order; forward the half-close at the end."""
    loop = asyncio.get_running_loop()
    while True:
        due, data = await line.get()
        if (wait := due - loop.time()) > 0:
            await asyncio.sleep(wait)  # the loop's timers never fire early
        if not data:
            if writer.can_write_eof():
                writer.write_eof()
            return
        writer.write(data)
        await writer.drain()
        await budget.give(len(data))


async def _together(*coros: Coroutine[Any, Any, None]) -> None:
    """Run ``coros`` until all are done; if one fails, cancel the rest and raise its error."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()  # raises the first failure
    finally:
        for task in tasks:
            task.cancel()


async def _direction(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     delay_s: float) -> None:
    """One way of a connection: a reader and a writer joined by a delay line."""
    line: asyncio.Queue = asyncio.Queue()
    budget = _Budget(HOLD_BYTES)
    await _together(_take_in(reader, line, budget, delay_s), _give_out(line, writer, budget))


def _no_delay(writer: asyncio.StreamWriter) -> None:
    # Nagle's algorithm would hold small frames back for an ACK: a second, unasked delay.
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, *,
                 target: tuple[str, int], delay_s: float) -> None:
    """Serve one accepted connection until both ways are done or one end fails."""
    try:
        server_r, server_w = await asyncio.open_connection(*target)
    except OSError:
        client_w.close()  # the far end is not there: refuse, as a direct dial would
        return
    for writer in (client_w, server_w):
        _no_delay(writer)
    try:
        await _together(_direction(client_r, server_w, delay_s),
                        _direction(server_r, client_w, delay_s))
    except OSError:
        pass  # a reset end: close the other too, as the connection is gone
    finally:
        for writer in (client_w, server_w):
            writer.close()


async def serve(listen: tuple[str, int], target: tuple[str, int], delay_s: float) -> None:
    """Relay connections on ``listen`` to ``target`` with ``delay_s`` each way, forever."""
    server = await asyncio.start_server(
        lambda r, w: _relay(r, w, target=target, delay_s=delay_s), *listen)
    host, port = server.sockets[0].getsockname()[:2]
    print(f"listening {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def start_relay(listen: str, target: str, *, delay_s: float,
                prefix: Sequence[str] = ()) -> tuple[subprocess.Popen, int]:
    """Start the relay as a process (``prefix``: e.g. ``ip netns exec NS``); return it and its port.

    Returns once it accepts connections. The caller kills it (it runs until then).
    """
    argv = [*prefix, sys.executable, "-m", "benchmarks.delay_relay", "--listen", listen,
            "--to", target, "--delay-ms", repr(delay_s * 1e3)]
    # Its errors go to a file: a pipe nobody reads could fill and stall the relay.
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errors, text=True,
                                cwd=ROOT)
        ready = proc.stdout.readline()  # its first line, or "" if it died
        if not ready.startswith("listening "):
            proc.kill()
            proc.wait(timeout=30)
            errors.seek(0)
            raise RuntimeError(f"the delay relay did not start: {errors.read()[-2000:]}")
    return proc, _address(ready.split()[1])[1]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse ``--listen``, ``--to`` and ``--delay-ms``; relay until killed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept on (port 0: any)")
    parser.add_argument("--to", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, ms")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error("--delay-ms must be >= 0")
    asyncio.run(serve(_address(args.listen), _address(args.to), args.delay_ms / 1e3))


if __name__ == "__main__":
    main()
