"""Phones join from a browser: ``python -m clients.gateway --superlink H:P --phones N``.

A browser cannot be a Flower SuperNode, so the gateway holds one for each phone: it
serves the page a person opens (``web/public/index.html`` with the web runtime,
``web/dist/page.js``), lets a phone in with a join token, gives it a place (a *slot*), and
starts that slot's SuperNode (``flower-supernode``, as :mod:`clients.connect` starts one)
the first time a phone takes it. The SuperNode's node config says the node is a phone
(``device-runtime="web"``) and where its phone is; each message's ClientApp hands the round
to the phone through the gateway (:mod:`clients.relay`), the phone trains against the trunk
over its WebSocket service, and the ClientApp replies as any device's does. The ServerApp
therefore samples, reports and accounts for a phone as for any node, under the node id of
its slot's SuperNode, which stays up while the gateway runs: a phone that reloads its page
or loses its network rejoins as the same node, with the place the page keeps. A phone trains
its slot's partition of the run's data, or its person's own labelled pictures, which stay on
it (the page says which it holds; see :mod:`clients.steps.web`).

Join tokens are signed by the gateway (HMAC-SHA256 with a secret it draws at start) and
expire after ``--token-ttl`` seconds; a forged or expired one is refused, and so is a
phone when every slot is taken. With ``--auth-key`` (one per slot, the keys an operator
registers with ``flwr supernode register`` as for any device) the SuperNodes authenticate to
the SuperLink; with ``--root-certificates`` they verify it, and the ClientApps the trunk,
by those roots. ``--certificate``/``--key`` serve the page and its WebSocket over TLS
(phones' browsers require it beyond localhost for some sensors; the trunk needs ``wss`` then).

It prints the join URL and writes it as a QR code (``--qr``, PNG). The paths it serves:

``/``, ``/page.js``
    The page.
``/phone``
    A phone's WebSocket: ``{"join": token}`` or ``{"rejoin": place}`` first, then the
    JSON of :mod:`clients.relay` and :mod:`clients.steps.web`.
``/relay``
    A ClientApp's WebSocket (:func:`clients.relay.delegate`), with the gateway's secret.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import hashlib
import hmac
import json
import os
import queue
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response
from websockets.sync.server import Server, ServerConnection, serve

from clients import connect
from clients.relay import (
    MAX_FRAME_BYTES,
    RELAY_KEY,
    RUNTIME_KEY,
    SECRET_KEY,
    SLOT_KEY,
    WEB_RUNTIME,
)

WEB = Path(__file__).resolve().parents[1] / "web"
#: What the gateway serves over HTTP: path -> (file, content type).
FILES = {"/": (WEB / "public" / "index.html", "text/html; charset=utf-8"),
         "/index.html": (WEB / "public" / "index.html", "text/html; charset=utf-8"),
         "/page.js": (WEB / "dist" / "page.js", "text/javascript; charset=utf-8")}
#: The close code of a phone the gateway turns away (join refused): the page starts over.
REFUSED = 4401
#: Largest hello or small message a phone sends before it holds a place.
MAX_HELLO_BYTES = 4096
#: Longest data id a phone may say it holds (a hash, or ``own:<n>:<hash>``).
MAX_HELD_ID = 64


@functools.lru_cache(maxsize=8)
def _file_body(file: Path, mtime_ns: int, *, gzipped: bool) -> bytes:
    """Return a served file's bytes, gzipped where the browser takes them.

    The page's bundle is 1.7 MB, 0.48 MB gzipped. Cached by modification time: compressed
    once per build, not once per phone.
    """
    del mtime_ns  # part of the cache key only
    body = file.read_bytes()
    return gzip.compress(body, mtime=0) if gzipped else body


class JoinRefused(Exception):
    """A phone may not join (the message is the reason it is told)."""


class JoinTokens:
    """Join tokens signed with the gateway's secret: ``<expiry>.<nonce>.<mac>``.

    Parameters
    ----------
    ttl_s : float
        How long a token lets phones join.
    secret : bytes, optional
        The signing key (drawn when not given).
    """

    def __init__(self, ttl_s: float, secret: bytes | None = None) -> None:
        self.ttl_s = ttl_s
        self._secret = secret or secrets.token_bytes(32)

    def _mac(self, body: str) -> str:
        return hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()[:32]

    def issue(self, now: float | None = None) -> str:
        """Return a token valid for ``ttl_s`` from ``now``."""
        expiry = int((time.time() if now is None else now) + self.ttl_s)
        body = f"{expiry}.{secrets.token_hex(8)}"
        return f"{body}.{self._mac(body)}"

    def check(self, token: object, now: float | None = None) -> None:
        """Refuse (JoinRefused) a token this gateway did not sign, or one that expired."""
        parts = token.split(".") if isinstance(token, str) else []
        if len(parts) != 3 or not hmac.compare_digest(self._mac(f"{parts[0]}.{parts[1]}"),
                                                      parts[2]):
            raise JoinRefused("the join token is not this gateway's")
        if int(parts[0]) < (time.time() if now is None else now):
            raise JoinRefused("the join token expired: ask the operator for a new link")


@dataclass
class Slot:
    """One phone's place: its partition, key, SuperNode, and the phone holding it."""

    index: int
    partition: int
    auth_key: Path | None = None
    place: str | None = None  # the secret the phone rejoins with
    phone: ServerConnection | None = None
    holds: str | None = None  # the data id the phone's page holds
    supernode: subprocess.Popen | None = None
    answers: queue.Queue = field(default_factory=queue.Queue)  # the phone's to the relay
    busy: bool = False


class Gateway:
    """The gateway's state and its WebSocket/HTTP service (see the module docstring).

    Parameters
    ----------
    args : argparse.Namespace
        :func:`parse_args`'s.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokens = JoinTokens(args.token_ttl)
        self.relay_secret = secrets.token_hex(16)
        keys: list[Path | None] = list(args.auth_key) or [None] * args.phones
        self.slots = [Slot(i, args.first_partition + i, key) for i, key in enumerate(keys)]
        self.lock = threading.Lock()
        self.logs = Path(args.logs)
        self.logs.mkdir(parents=True, exist_ok=True)
        self._server: Server | None = None

    # --- the service ----------------------------------------------------------------

    def start(self) -> None:
        """Serve on ``--host``/``--port`` in a background thread."""
        context = None
        if self.args.certificate is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(self.args.certificate, self.args.key)
        self._server = serve(self._serve, self.args.host, self.args.port, ssl=context,
                             process_request=self._http, max_size=MAX_FRAME_BYTES,
                             compression=None)
        threading.Thread(target=self._server.serve_forever, daemon=True,
                         name="gateway").start()

    @property
    def port(self) -> int:
        """The port it serves on."""
        assert self._server is not None
        return int(self._server.socket.getsockname()[1])

    def join_url(self, token: str) -> str:
        """Return the URL a phone opens to join with ``token``."""
        scheme = "https" if self.args.certificate is not None else "http"
        base = self.args.public_url or f"{scheme}://{self.args.host}:{self.port}"
        return f"{base.rstrip('/')}/?token={token}"

    def stop(self) -> None:
        """Stop serving and stop every SuperNode this gateway started."""
        if self._server is not None:
            self._server.shutdown()
        stop_groups([s.supernode for s in self.slots if s.supernode is not None])

    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.partition("?")[0]
        if path in ("/phone", "/relay"):
            return None  # the WebSocket handshake goes on
        if path not in FILES:
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        file, kind = FILES[path]
        gzipped = "gzip" in request.headers.get("Accept-Encoding", "")
        try:
            body = _file_body(file, file.stat().st_mtime_ns, gzipped=gzipped)
        except OSError:
            return connection.respond(HTTPStatus.INTERNAL_SERVER_ERROR,
                                      f"{file.name} is missing: run `make web`\n")
        headers = Headers([("Content-Type", kind), ("Content-Length", str(len(body))),
                           ("Cache-Control", "no-store"), ("Vary", "Accept-Encoding")])
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        return Response(HTTPStatus.OK, "OK", headers, body)

    def _serve(self, connection: ServerConnection) -> None:
        path = connection.request.path.partition("?")[0] if connection.request else ""
        try:
            if path == "/phone":
                self._phone(connection)
            elif path == "/relay":
                self._relay(connection)
        except ConnectionClosed:
            pass
        except (TimeoutError, ValueError) as err:  # a relay's hello or task: late or not JSON
            connection.close(1008, f"the relay reads a JSON hello, then a task ({err})"[:120])

    # --- phones ---------------------------------------------------------------------

    def _phone(self, connection: ServerConnection) -> None:
        try:
            slot = self._admit(json.loads(connection.recv(timeout=30)))
        except (JoinRefused, ValueError, TypeError, TimeoutError) as err:
            reason = str(err) if isinstance(err, JoinRefused) else "a hello is {\"join\": token}"
            connection.close(REFUSED, reason[:120])
            return
        with self.lock:
            previous, slot.phone, slot.holds = slot.phone, connection, None
        if previous is not None:  # the same phone again (a reload): the newer page wins
            previous.close(1000, "replaced by a newer page of this phone")
        connection.send(json.dumps({"joined": {"device": slot.place, "slot": slot.index,
                                                "partition": slot.partition}}))
        self._ensure_supernode(slot)
        try:
            for message in connection:
                if not self._from_phone(slot, connection, message):
                    break
        finally:
            with self.lock:
                if slot.phone is connection:
                    slot.phone = None
                    slot.answers.put({"failed": "the phone left mid-round (its page closed "
                                                "or lost its network)", "kind": "lost"})

    def _admit(self, hello: Any) -> Slot:
        """Return the slot a hello gets; JoinRefused with the reason otherwise."""
        if not isinstance(hello, dict):
            raise ValueError("not an object")
        with self.lock:
            if "rejoin" in hello:
                for slot in self.slots:
                    if slot.place is not None and hmac.compare_digest(
                            slot.place, str(hello["rejoin"])):
                        return slot
                raise JoinRefused("this gateway does not know this phone's place (it restarted "
                                  "or the phone left): join again with the link")
            self.tokens.check(hello.get("join"))
            for slot in self.slots:
                if slot.place is None:
                    slot.place = secrets.token_urlsafe(24)
                    return slot
        raise JoinRefused(f"all {len(self.slots)} places are taken")

    def _from_phone(self, slot: Slot, connection: ServerConnection, message: str | bytes
                    ) -> bool:
        """Handle one message of a phone that holds ``slot``; False: it is done."""
        try:
            answer = json.loads(message)
            if not isinstance(answer, dict):
                raise ValueError("not an object")
        except ValueError:
            connection.close(1003, "the gateway reads JSON objects")
            return False
        if answer.get("leave"):
            with self.lock:
                slot.place = None  # the place is free for another phone
            connection.close(1000, "left")
            return False
        if "holds" in answer:  # an id the ClientApp reads (clients.steps.web.own_examples)
            held = answer["holds"]
            slot.holds = held if isinstance(held, str) and len(held) <= MAX_HELD_ID else None
        elif "result" in answer or "failed" in answer:
            slot.answers.put(answer)
        return True

    def _ensure_supernode(self, slot: Slot) -> None:
        """Start ``slot``'s SuperNode unless it runs (its node id stays the slot's)."""
        with self.lock:
            if slot.supernode is not None and slot.supernode.poll() is None:
                return
            command = self.supernode_command(slot)
            log = open(self.logs / f"supernode-{slot.index}.log", "ab")  # noqa: SIM115
            env = os.environ | {"PATH": connect.with_own_tools(os.environ.get("PATH", ""))}
            slot.supernode = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True, env=env)
            log.close()

    def supernode_command(self, slot: Slot) -> list[str]:
        """Return the ``flower-supernode`` command of ``slot`` (as clients.connect builds it)."""
        a = self.args
        argv = ["--superlink", a.superlink, "--profile", a.profile,
                "--partition-id", str(slot.partition), "--num-partitions", str(a.num_partitions),
                "--cache-dir", str(Path(a.cache_dir) / f"slot{slot.index}")]
        argv += (["--root-certificates", str(a.root_certificates)] if a.root_certificates
                 else ["--insecure"])
        argv += ["--auth-key", str(slot.auth_key)] if slot.auth_key else []
        extra = {RUNTIME_KEY: WEB_RUNTIME, RELAY_KEY: f"ws://127.0.0.1:{self.port}/relay",
                 SLOT_KEY: slot.index, SECRET_KEY: self.relay_secret}
        return connect.supernode_command(connect.parse_args(argv), port=runtime_port(),
                                         extra=extra)

    # --- ClientApps -----------------------------------------------------------------

    def _relay(self, connection: ServerConnection) -> None:
        hello = json.loads(connection.recv(timeout=30))
        if not (isinstance(hello, dict) and hmac.compare_digest(
                str(hello.get("secret", "")), self.relay_secret)):
            connection.close(1008, "not this gateway's relay secret")
            return
        index = hello.get("slot")
        if not (isinstance(index, int) and 0 <= index < len(self.slots)):
            connection.close(1008, f"no slot {index!r}")
            return
        slot = self.slots[index]
        if slot.phone is None:  # known at once: the ClientApp need not build its task
            connection.send(json.dumps({"failed": f"no phone holds place {slot.index} now",
                                        "kind": "unavailable"}))
            return
        connection.send(json.dumps({"holds": slot.holds}))
        if hello.get("ask") == "holds":  # only what the phone holds (clients.relay.holding)
            return
        task = json.loads(connection.recv(timeout=60))
        connection.send(json.dumps(self._hand_over(slot, task)))

    def _hand_over(self, slot: Slot, task: dict[str, Any]) -> dict[str, Any]:
        """Give ``task`` to the slot's phone and wait for its answer."""
        with self.lock:
            phone = slot.phone
            if phone is None:
                return {"failed": f"no phone holds place {slot.index} now", "kind": "unavailable"}
            if slot.busy:
                return {"failed": "the phone is still training another round", "kind": "failed"}
            slot.busy = True
            while not slot.answers.empty():  # a stale answer of a phone that left
                slot.answers.get_nowait()
        try:
            data = task.get("data", {})
            if slot.holds == data.get("id"):
                task["data"] = {k: v for k, v in data.items() if k not in ("inputs", "labels")}
            elif "inputs" not in data:  # the phone rejoined since the hello, without its data
                return {"failed": "the phone lost its data since the round started",
                        "kind": "lost"}
            phone.send(json.dumps({"task": task}))
            answer = slot.answers.get(timeout=self.args.round_timeout)
            if "result" in answer:
                return {"result": answer["result"]}
            return {"failed": str(answer.get("failed", "")),
                    "kind": str(answer.get("kind", "failed"))}
        except ConnectionClosed:
            return {"failed": "the phone left as the round started", "kind": "lost"}
        except queue.Empty:
            return {"failed": f"no answer within {self.args.round_timeout:.0f} s", "kind": "lost"}
        finally:
            slot.busy = False


def stop_groups(processes: Sequence[subprocess.Popen], timeout_s: float = 15) -> None:
    """Stop processes each started in a session of its own, with whatever they started.

    SIGTERM to every process group first (they stop in parallel), SIGKILL to a group still
    there after ``timeout_s``.
    """
    for proc in processes:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in processes:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)


def runtime_port() -> int:
    """Return a free port for a SuperNode's runtime API (the kernel's pick: none repeats soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((connect.RUNTIME_HOST, 0))
        return int(probe.getsockname()[1])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Read the command line (argparse exits with a message naming a bad flag)."""
    parser = argparse.ArgumentParser(
        prog="python -m clients.gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--superlink", required=True, metavar="HOST:PORT",
                        help="the SuperLink's Fleet API address")
    places = parser.add_mutually_exclusive_group()
    places.add_argument("--phones", type=int, default=4,
                        help="how many phones may join (default: %(default)s)")
    places.add_argument("--auth-key", type=Path, action="append", default=[], metavar="FILE",
                        help="a registered SuperNode key, one per phone (repeat)")
    security = parser.add_mutually_exclusive_group(required=True)
    security.add_argument("--root-certificates", type=Path, metavar="FILE",
                          help="PEM roots that verify the SuperLink and the trunk (TLS)")
    security.add_argument("--insecure", action="store_true",
                          help="no TLS to the SuperLink (testing only)")
    parser.add_argument("--first-partition", type=int, default=0, metavar="K",
                        help="phone i trains data partition K + i (default: %(default)s)")
    parser.add_argument("--num-partitions", type=int, default=None, metavar="M",
                        help="partitions of the run's data (default: K + phones)")
    parser.add_argument("--profile", default="mid_range_phone",
                        choices=sorted(connect.preset_profiles()),
                        help="the device preset the phones declare (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve the page on")
    parser.add_argument("--port", type=int, default=8800, help="port (0: a free one)")
    parser.add_argument("--public-url", default=None, metavar="URL",
                        help="the address phones reach this gateway by (default: host:port)")
    parser.add_argument("--certificate", type=Path, metavar="FILE",
                        help="serve the page over TLS with this certificate (PEM)")
    parser.add_argument("--key", type=Path, metavar="FILE", help="... and its private key")
    parser.add_argument("--token-ttl", type=float, default=3600.0, metavar="S",
                        help="seconds a join token lets phones join (default: %(default)s)")
    parser.add_argument("--round-timeout", type=float, default=600.0, metavar="S",
                        help="longest a phone's round may take (default: %(default)s)")
    parser.add_argument("--qr", type=Path, default=connect.default_cache_dir() / "join.png",
                        metavar="FILE",
                        help="where to write the join URL's QR code (default: %(default)s)")
    parser.add_argument("--logs", type=Path, default=connect.default_cache_dir() / "gateway",
                        metavar="FOLDER",
                        help="where the SuperNodes' logs go (default: %(default)s)")
    parser.add_argument("--cache-dir", type=Path, default=connect.default_cache_dir() / "phones",
                        metavar="FOLDER", help="where the phones' nodes keep their data")
    args = parser.parse_args(argv)
    phones = len(args.auth_key) or args.phones
    if phones < 1:
        parser.error(f"--phones {phones}: at least 1")
    if args.num_partitions is None:
        args.num_partitions = args.first_partition + phones
    if not 0 <= args.first_partition <= args.num_partitions - phones:
        parser.error(f"--first-partition {args.first_partition} with {phones} phones needs "
                     f"--num-partitions >= {args.first_partition + phones}")
    if (args.certificate is None) != (args.key is None):
        parser.error("--certificate and --key go together")
    for path in [*args.auth_key, args.root_certificates, args.certificate, args.key]:
        if path is not None and not path.exists():
            parser.error(f"{path}: no such file")
    return args


def write_qr(url: str, path: Path) -> None:
    """Write ``url`` as a QR code (PNG) to ``path``."""
    import segno

    segno.make(url, error="m").save(str(path), scale=8, border=4)


def main(argv: Sequence[str] | None = None) -> None:
    """Serve phones until interrupted; print the join URL, write its QR code."""
    args = parse_args(argv)
    gateway = Gateway(args)
    gateway.start()
    url = gateway.join_url(gateway.tokens.issue())
    args.qr.parent.mkdir(parents=True, exist_ok=True)
    write_qr(url, args.qr)
    print(f"phones join at {url}\n(QR code: {args.qr.resolve()}; the link expires in "
          f"{args.token_ttl:.0f} s; {len(gateway.slots)} places; the phones' SuperNodes log "
          f"to {gateway.logs.resolve()})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    gateway.stop()
    sys.exit(0)


if __name__ == "__main__":
    main()
