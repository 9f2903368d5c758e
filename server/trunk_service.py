"""The data plane: a gRPC streaming service in front of the trunk.

The ServerApp issues a short-lived token per client and round
(:class:`TokenRegistry`) and sends it in the Flower ``train`` message. The
client opens one bidirectional stream with the token in its metadata and
exchanges frames per batch. :class:`TrunkEndpoint` turns request frames into
reply frames: every frame is decoded and validated (size, dtype, shape against
the client's cut, finite values, labels, token still valid) before the trunk
sees it, and a bad frame gets an ``error`` frame naming the problem while the
stream, the trunk and the other clients carry on.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc

from server.async_trunk import AsyncTrunkTrainer, QueueFull
from server.trunk import Trunk
from server.trunk_modes import BatchingTrunk, SharedTrunk, TrunkPerClient
from server.trunk_ushaped import UShapedTrunk
from splitlearn.transport import (
    DEFAULT_MAX_FRAME_BYTES,
    EXCHANGE_METHOD,
    TOKEN_METADATA_KEY,
    InProcessTrunkSession,
)
from splitlearn.wire import (
    Frame,
    FrameError,
    check_forward_frame,
    decode_frame,
    encode_frame,
)

log = logging.getLogger(__name__)

TrunkMode = SharedTrunk | TrunkPerClient | BatchingTrunk


@dataclass(frozen=True)
class SessionGrant:
    """What a token entitles its holder to.

    Parameters
    ----------
    client : str
        Client (Flower node) id the token was issued to.
    cut : int
        The client's cut: activations must have the shape of that cut.
    server_round : int
        Round the token belongs to; tokens are revoked when it ends.
    expires_at : float
        ``time.monotonic()`` deadline.
    tail_cut : int | None
        U-shaped sessions only: the trunk runs stages ``[cut, tail_cut)`` and
        the device keeps the rest and the loss (frames carry no labels).
    """

    client: str
    cut: int
    server_round: int
    expires_at: float
    tail_cut: int | None = None


class TokenRegistry:
    """Issues, checks and revokes per-round session tokens (thread-safe)."""

    def __init__(self) -> None:
        self._grants: dict[str, SessionGrant] = {}
        self._lock = threading.Lock()
        #: Called with the revoked tokens (to drop per-session state such as graphs).
        self._revoke_listeners: list[Callable[[list[str]], None]] = []

    def issue(
        self, *, client: str, cut: int, server_round: int, ttl_s: float,
        tail_cut: int | None = None,
    ) -> str:
        """Return a fresh random token for ``client`` valid for ``ttl_s`` seconds.

        ``tail_cut`` makes the session U-shaped (see :mod:`server.trunk_ushaped`).
        """
        token = secrets.token_urlsafe(24)
        grant = SessionGrant(client, cut, server_round, time.monotonic() + ttl_s, tail_cut)
        with self._lock:
            self._grants[token] = grant
        return token

    def lookup(self, token: str | None) -> SessionGrant | None:
        """Return the grant of a valid token, or None if unknown or expired."""
        with self._lock:
            grant = self._grants.get(token) if token else None
        if grant is None or grant.expires_at < time.monotonic():
            return None
        return grant

    def revoke_round(self, server_round: int) -> None:
        """Invalidate every token of ``server_round`` (and any older one)."""
        with self._lock:
            revoked = [t for t, g in self._grants.items() if g.server_round <= server_round]
            self._grants = {
                t: g for t, g in self._grants.items() if g.server_round > server_round
            }
            listeners = list(self._revoke_listeners)
        for listener in listeners:
            listener(revoked)

    def on_revoke(self, listener: Callable[[list[str]], None]) -> None:
        """Call ``listener`` with the tokens each :meth:`revoke_round` invalidates."""
        with self._lock:
            self._revoke_listeners.append(listener)


class TrunkEndpoint:
    """Turns request frames into reply frames; never raises on bad input.

    Parameters
    ----------
    trunk : Trunk
        The shared trunk.
    tokens : TokenRegistry
        Checked again on every frame, so a revoked session stops at once.
    max_frame_bytes : int
        Largest accepted request frame.
    max_batch : int
        Largest accepted batch.
    """

    def __init__(
        self,
        trunk: Trunk,
        tokens: TokenRegistry,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_batch: int = 4096,
    ) -> None:
        self.trunk = trunk
        #: Which trunk a session trains (shared, per client, batched); see trunk_modes.
        self.mode: TrunkMode = SharedTrunk(trunk)
        self.tokens = tokens
        self.max_frame_bytes = max_frame_bytes
        self.max_batch = max_batch
        self.rejected: Counter[str] = Counter()
        self._num_classes = trunk.model.num_classes
        #: Set by the local_loss protocol: ``smashed`` frames are queued on it.
        self.smashed: AsyncTrunkTrainer | None = None
        #: U-shaped sessions (grant with a ``tail_cut``): their pending graphs.
        self.ushaped = UShapedTrunk(max_batch=max_batch)
        tokens.on_revoke(self.ushaped.drop)

    def handle(self, data: bytes, token: str | None) -> bytes:
        """Answer one request frame with a ``gradient``, ``metrics``, ``ack`` or ``error`` frame."""
        grant = self.tokens.lookup(token)
        if grant is None:
            return self._refuse("?", "session token rejected: unknown, expired or revoked")
        try:
            frame = decode_frame(data, max_bytes=self.max_frame_bytes)
            if grant.tail_cut is not None:  # U-shaped: labels never reach the server
                return self.ushaped.handle(
                    frame, session=str(token), cut=grant.cut, tail_cut=grant.tail_cut,
                    trunk=self.mode.trunk_for(grant.client),
                )
            if frame.kind == "smashed" and self.smashed is not None:
                return self._queue_smashed(grant, frame, self.smashed)
            if frame.kind not in ("forward", "evaluate"):
                raise FrameError(f"clients may send 'forward' or 'evaluate', not {frame.kind!r}")
            acts, labels = check_forward_frame(
                frame,
                cut_shape=self.trunk.cut_shape(grant.cut),
                num_classes=self._num_classes,
                max_batch=self.max_batch,
            )
        except FrameError as err:
            return self._refuse(grant.client, str(err))
        assert labels is not None  # check_forward_frame demanded them
        trunk = self.mode.trunk_for(grant.client)
        if frame.kind == "evaluate":
            result = trunk.evaluate_batch(grant.cut, acts, labels)
            return encode_frame("metrics", meta={"loss": result.loss, "correct": result.correct})
        result = trunk.train_step(grant.cut, acts, labels)
        return encode_frame(
            "gradient",
            {"grad": result.grad},
            {"loss": result.loss, "correct": result.correct},
        )

    def _queue_smashed(
        self, grant: SessionGrant, frame: Frame, trainer: AsyncTrunkTrainer
    ) -> bytes:
        """Validate a ``smashed`` frame like ``forward``, queue it, ``ack`` at once."""
        acts, labels = check_forward_frame(  # a FrameError reaches handle's refusal
            frame,
            cut_shape=self.trunk.cut_shape(grant.cut),
            num_classes=self._num_classes,
            max_batch=self.max_batch,
        )
        assert labels is not None
        try:
            queued = trainer.submit(
                grant.client, self.mode.trunk_for(grant.client), grant.cut, acts, labels
            )
        except QueueFull as err:
            return self._refuse(grant.client, str(err))
        return encode_frame("ack", meta={"queued": queued})

    def _refuse(self, client: str, reason: str) -> bytes:
        self.rejected[client] += 1
        log.warning("data plane: refused a frame from client %s: %s", client, reason)
        return encode_frame("error", meta={"reason": reason})

    def local_session(self, token: str) -> InProcessTrunkSession:
        """Open an in-process session: same frames and checks, no network."""
        return InProcessTrunkSession(
            lambda data: self.handle(data, token), max_frame_bytes=self.max_frame_bytes,
            on_close=lambda: self.end_session(token),
        )

    def end_session(self, token: str | None) -> None:
        """Drop what the trunk keeps for a session whose stream ended."""
        if token:
            self.ushaped.drop([token])


class TrunkService:
    """gRPC server exposing a :class:`TrunkEndpoint` as a bidirectional stream.

    Parameters
    ----------
    endpoint : TrunkEndpoint
        Handles the frames.
    host : str
        Interface to bind.
    port : int
        Port to bind; 0 picks a free one.
    advertise_host : str, optional
        Host clients should dial (e.g. a public name when clients are remote);
        defaults to ``host``.
    server_credentials : grpc.ServerCredentials, optional
        TLS credentials; insecure when None.
    max_workers : int
        Concurrent streams served.
    """

    def __init__(
        self,
        endpoint: TrunkEndpoint,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        server_credentials: grpc.ServerCredentials | None = None,
        max_workers: int = 32,
    ) -> None:
        self.endpoint = endpoint
        #: Streams open right now (the batching barrier waits for this many).
        self.open_streams = 0
        self._streams_lock = threading.Lock()
        limit = 2 * endpoint.max_frame_bytes  # headroom: oversize gets a reasoned refusal
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="trunk"),
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
            ],
        )
        handler = grpc.stream_stream_rpc_method_handler(self._exchange)
        service, method = EXCHANGE_METHOD.strip("/").split("/")
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),)
        )
        bind = f"{host}:{port}"
        if server_credentials is None:
            self.port = self._server.add_insecure_port(bind)
        else:
            self.port = self._server.add_secure_port(bind, server_credentials)
        if self.port == 0:
            raise OSError(f"trunk service could not bind {bind}")
        self.address = f"{advertise_host or host}:{self.port}"

    def _exchange(self, requests, context: grpc.ServicerContext):  # noqa: ANN001, ANN202
        token = dict(context.invocation_metadata()).get(TOKEN_METADATA_KEY)
        if self.endpoint.tokens.lookup(token) is None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "session token rejected: unknown, expired or revoked",
            )
        with self._streams_lock:
            self.open_streams += 1
        try:
            for data in requests:
                yield self.endpoint.handle(data, token)
        except grpc.RpcError:
            # The client vanished mid-stream. Every trunk step is atomic, so
            # there is nothing to undo; its partial round is simply not replied.
            log.info("data plane: a client stream ended abruptly")
        finally:
            self.endpoint.end_session(token)  # e.g. a U-shaped graph whose backward never came
            with self._streams_lock:
                self.open_streams -= 1

    def start(self) -> str:
        """Start serving; return the address clients should dial."""
        self._server.start()
        log.info("trunk service listening on %s", self.address)
        return self.address

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving, letting open streams finish for ``grace_s`` seconds."""
        self._server.stop(grace_s).wait()
