"""The data plane over WebSocket: the same ``trunk.proto`` frames, for browsers.

A browser cannot open a gRPC stream, but it can open a WebSocket. This service accepts the
same request frames as :class:`~splitlearn.dataplane.service.TrunkService`'s ``Exchange``
stream, as binary WebSocket messages, and answers each with the reply frame as a binary
message, through the same :class:`~splitlearn.dataplane.endpoint.TrunkEndpoint`: the same
tokens, node-key proofs, limits, validation and refusals. With the trunk's TLS files it
serves ``wss://`` on the same certificate.

The exchange, on ``ws[s]://host:port/trunk``:

1. The device sends one text message, the *hello*: ``{"token": "...", "proof": "..."}``
   (``proof`` base64, only for a token bound to a node key). A browser cannot set the
   headers gRPC carries them in, and a query string would write the token into logs.
2. The service answers ``{"attached": true}``, or closes with a code naming why
   (:data:`CLOSE_CODES`: 4401 unauthenticated, 4403 another node's token, 4429 too many
   streams, 4400 a malformed hello) and the reason as text.
3. Then each binary message is a ``Request`` and is answered by one ``Reply``; a request
   that breaks a rule gets a ``Refusal`` as over gRPC, and the session carries on. A text
   message after the hello is a malformed frame, refused the same way.

When the token is revoked or expires, or the stream is idle, the endpoint closes it (4408).
Streams count against the same ``dataplane.max_streams`` as gRPC's do: each service holds at
most that many.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import ssl
import threading
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import connect
from websockets.sync.server import Server, ServerConnection, serve

from splitlearn.dataplane.channel import TrunkRejected
from splitlearn.dataplane.endpoint import SessionRefused, TrunkEndpoint

log = logging.getLogger(__name__)

#: The path devices dial.
PATH = "/trunk"
#: Close codes (RFC 6455 leaves 4000-4999 to applications): the gRPC status each mirrors.
CLOSE_CODES = {"INVALID_ARGUMENT": 4400, "UNAUTHENTICATED": 4401, "PERMISSION_DENIED": 4403,
               "NOT_FOUND": 4404, "CANCELLED": 4408, "RESOURCE_EXHAUSTED": 4429}
#: Seconds a device has to send its hello once connected.
HELLO_TIMEOUT_S = 10.0
#: A close reason is at most 123 bytes (RFC 6455, 5.5).
REASON_BYTES = 123


def _reason(text: str) -> str:
    return text.encode()[:REASON_BYTES].decode(errors="ignore")


def parse_hello(message: str | bytes) -> tuple[str, bytes | None]:
    """Return the token and proof of a hello message.

    Raises
    ------
    ValueError
        For anything but a JSON object with a string ``token`` and, optionally, a base64
        string ``proof``.
    """
    if not isinstance(message, str):
        raise ValueError("the hello is a text message")
    try:
        hello: Any = json.loads(message)
    except json.JSONDecodeError as err:
        raise ValueError(f"the hello is not JSON: {err.msg}") from None
    if not isinstance(hello, dict) or not isinstance(hello.get("token"), str):
        raise ValueError('the hello is {"token": "...", "proof": "..."}')
    proof = hello.get("proof")
    if proof is None:
        return hello["token"], None
    if not isinstance(proof, str):
        raise ValueError("the hello's proof is a base64 string")
    try:
        return hello["token"], base64.b64decode(proof, validate=True)
    except binascii.Error:
        raise ValueError("the hello's proof is not base64") from None


class TrunkWebSocketService:
    """WebSocket server exposing a :class:`TrunkEndpoint` (see the module docstring).

    Parameters
    ----------
    endpoint : TrunkEndpoint
        Handles the frames (the gRPC service's own, when both run).
    host, port : str, int
        Where to listen; port 0 picks a free one.
    advertise_host : str, optional
        Host devices should dial; defaults to ``host``.
    ssl_context : ssl.SSLContext, optional
        TLS (``wss://``); plain ``ws://`` when None.
    max_streams : int
        Streams served at once; more are closed at once (4429), never queued.
    watchdog_s : float
        How often idle and revoked streams are looked for.
    """

    def __init__(self, endpoint: TrunkEndpoint, *, host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, ssl_context: ssl.SSLContext | None = None,
                 max_streams: int = 64, watchdog_s: float = 1.0) -> None:
        self.endpoint = endpoint
        self.max_streams = max_streams
        self._open = 0
        self._lock = threading.Lock()
        self._server: Server = serve(
            self._serve, host, port, ssl=ssl_context, compression=None,
            # Headroom above the frame limit: an oversized frame gets a reasoned refusal.
            max_size=2 * endpoint.dataplane.max_frame_bytes, open_timeout=HELLO_TIMEOUT_S,
        )
        self.port = self._server.socket.getsockname()[1]
        scheme = "wss" if ssl_context is not None else "ws"
        self.url = f"{scheme}://{advertise_host or host}:{self.port}{PATH}"
        self._watchdog_s = watchdog_s
        self._stopping = threading.Event()
        self._threads = [
            threading.Thread(target=self._server.serve_forever, name="trunk-ws", daemon=True),
            threading.Thread(target=self._watch, name="trunk-ws-watchdog", daemon=True),
        ]

    def _serve(self, connection: ServerConnection) -> None:
        if connection.request is None or connection.request.path != PATH:
            connection.close(CLOSE_CODES["NOT_FOUND"], f"the trunk is at {PATH}")
            return
        with self._lock:
            full = self._open >= self.max_streams
            self._open += not full
        if full:
            connection.close(CLOSE_CODES["RESOURCE_EXHAUSTED"],
                             f"RESOURCE_EXHAUSTED: {self.max_streams} streams are open")
            return
        try:
            self._exchange(connection)
        finally:
            with self._lock:
                self._open -= 1

    def _exchange(self, connection: ServerConnection) -> None:
        peer = "ws:{}:{}".format(*connection.remote_address[:2])
        try:
            token, proof = parse_hello(connection.recv(timeout=HELLO_TIMEOUT_S))
        except (TimeoutError, ValueError) as err:
            detail = str(err) if isinstance(err, ValueError) else (
                f"no hello within {HELLO_TIMEOUT_S:g} s")
            connection.close(CLOSE_CODES["INVALID_ARGUMENT"],
                             _reason(f"INVALID_ARGUMENT: {detail}"))
            return
        except ConnectionClosed:
            return
        try:
            session, stream = self.endpoint.attach(
                token, lambda: connection.close(CLOSE_CODES["CANCELLED"], _reason(
                    "CANCELLED: the trunk closed the session (token revoked or expired, "
                    "or idle)")), proof=proof)
        except SessionRefused as refused:
            connection.close(CLOSE_CODES.get(refused.code, 1008),
                             _reason(f"{refused.code}: {refused}"))
            return
        try:
            connection.send(json.dumps({"attached": True}))
            for message in connection:
                data = message.encode() if isinstance(message, str) else message
                connection.send(self.endpoint.handle(session, data, peer=peer))
        except ConnectionClosed:
            pass  # the device left, or the session was closed (revoked, idle)
        finally:
            self.endpoint.detach(session, stream)

    def _watch(self) -> None:
        while not self._stopping.wait(self._watchdog_s):
            closed = self.endpoint.close_idle()
            if closed:
                log.info("data plane (WebSocket): closed %d idle or revoked session(s)", closed)

    def start(self) -> str:
        """Start serving; return the URL devices should dial."""
        for thread in self._threads:
            thread.start()
        log.info("trunk WebSocket service listening on %s", self.url)
        return self.url

    def stop(self) -> None:
        """Stop accepting, close every open stream and wait for the server's thread."""
        self._stopping.set()
        self._server.shutdown()
        self._threads[0].join(timeout=5.0)


#: Address prefixes that name the WebSocket service rather than the gRPC one.
WEBSOCKET_SCHEMES = ("ws://", "wss://")


class WebSocketTransport:
    """One WebSocket to the trunk's :class:`TrunkWebSocketService` (a device's side).

    The same frames as :class:`~splitlearn.dataplane.channel.GrpcTransport`, for devices
    (and tests) that reach the trunk as a browser does.

    Parameters
    ----------
    url : str
        ``ws://host:port/trunk`` or ``wss://...``.
    token : str
        Session token from the round's Flower message.
    max_frame_bytes : int
        Largest frame sent or received.
    root_certificates : bytes, optional
        PEM roots to verify a ``wss://`` trunk by; the system's when None.
    proof : bytes, optional
        This node's proof for the token, which a token bound to its key needs.
    """

    def __init__(self, url: str, token: str, *, max_frame_bytes: int,
                 root_certificates: bytes | None = None, proof: bytes | None = None) -> None:
        context = None
        if url.startswith("wss://"):
            context = ssl.create_default_context(
                cadata=root_certificates.decode() if root_certificates else None)
        hello: dict[str, str] = {"token": token}
        if proof is not None:
            hello["proof"] = base64.b64encode(proof).decode()
        try:
            self._connection = connect(url, ssl=context, compression=None,
                                       max_size=2 * max_frame_bytes,
                                       open_timeout=HELLO_TIMEOUT_S)
        except (OSError, InvalidHandshake) as err:
            raise TrunkRejected(f"UNAVAILABLE: cannot open {url}: {err}") from None
        try:
            self._connection.send(json.dumps(hello))
            self._connection.recv(timeout=HELLO_TIMEOUT_S)  # {"attached": true}
        except ConnectionClosed as closed:
            raise TrunkRejected(_closed(closed)) from None
        except TimeoutError:
            self.abort()
            raise TrunkRejected(f"no answer to the hello within {HELLO_TIMEOUT_S:g} s") from None

    def send(self, data: bytes) -> None:
        """Send one request frame."""
        try:
            self._connection.send(data)
        except ConnectionClosed as closed:
            raise TrunkRejected(_closed(closed)) from None

    def receive(self, timeout_s: float) -> bytes:
        """Return the next reply frame; close the socket if none comes within ``timeout_s``."""
        try:
            reply = self._connection.recv(timeout=timeout_s)
        except TimeoutError:
            self.abort()
            raise TrunkRejected(f"no reply from the trunk within {timeout_s:g} s") from None
        except ConnectionClosed as closed:
            raise TrunkRejected(_closed(closed)) from None
        if isinstance(reply, str):
            raise TrunkRejected("the trunk sent text where a reply frame belongs")
        return reply

    def close(self) -> None:
        """Close the WebSocket with the closing handshake."""
        self._connection.close()

    def abort(self) -> None:
        """Drop the connection without a closing handshake, as a vanishing device would."""
        self._connection.socket.close()
        self._connection.close()


def _closed(closed: ConnectionClosed) -> str:
    """Describe how the trunk closed the socket: its reason names the refusal."""
    frame = closed.rcvd
    if frame is None:
        return "the connection to the trunk was lost"
    return frame.reason or f"the trunk closed the session (code {frame.code})"
