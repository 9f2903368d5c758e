"""The server side of the data plane, transport-free: sessions, limits and refusals.

:class:`TrunkEndpoint` turns request frames into reply frames. It never raises on
input: a frame that breaks a rule, or that its protocol's handler refuses, is
answered with a ``Refusal`` naming the reason, and the stream, the trunk and every
other client carry on. Each token is a :class:`Session`; the protocol named in its
grant picks the :class:`SessionHandler` that serves it. Transports (the gRPC
service, the in-process channel) attach a stream to a session, hand it frames and
detach it; the endpoint closes streams whose token is revoked, expired or idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from splitlearn.config import DataPlaneConfig
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import (
    AnyReply,
    AnyRequest,
    FrameError,
    Reason,
    decode_request,
    refusal,
)
from splitlearn.dataplane.node_keys import proof_nonce, proof_problem, verifies
from splitlearn.dataplane.tokens import SessionGrant, TokenRegistry

log = logging.getLogger(__name__)


#: Refusals that do not count against a session's ``dataplane.max_refusals``: back-pressure
#: and error-feedback restarts happen to honest devices, and a quarantined device's frames
#: were counted when it struck.
NOT_COUNTED = frozenset({Reason.BUSY, Reason.STALE_FEEDBACK, Reason.QUARANTINED})
#: Refused frames of one session logged one by one; past them, one line when it is closed.
LOGGED_REFUSALS = 8


class SessionRefused(Exception):
    """A stream may not start; ``code`` is the gRPC status name to end it with."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


@dataclass
class Session:
    """One token's state on the data plane (it outlives a single stream)."""

    token: str
    grant: SessionGrant
    last_seq: int = 0
    last_active: float = field(default_factory=time.monotonic)
    streams: dict[int, Callable[[], None]] = field(default_factory=dict)  # id -> cancel
    nonces: set[bytes] = field(default_factory=set)  # of the proofs its streams opened with
    refused: int = 0  # frames refused for what they were (see NOT_COUNTED)


class SessionHandler(Protocol):
    """A protocol's trunk side: answers the requests of the sessions it was granted."""

    def handle(self, session: Session, request: AnyRequest) -> AnyReply:
        """Answer one request; raise :class:`FrameError` to refuse it (changing nothing).

        The request reads like a ``pb.Request`` (a :class:`Frame` on the wire's path);
        build the reply with :func:`~splitlearn.dataplane.codec.build`.
        """
        ...

    def attach(self, session: Session) -> None:
        """Note that a stream of ``session`` opened."""
        ...

    def detach(self, session: Session) -> None:
        """Note that a stream of ``session`` ended (closed, vanished, revoked or idle)."""
        ...


class TrunkEndpoint:
    """Sessions, limits and refusals in front of the protocols' session handlers.

    Parameters
    ----------
    handlers : Mapping[str, SessionHandler]
        Protocol name (as in a grant) -> its handler.
    tokens : TokenRegistry
        Checked on every frame; revocation closes the round's streams.
    dataplane : DataPlaneConfig
        What is accepted: frame and batch size, value bound, streams per token,
        idle timeout (the ``dataplane`` config group).
    """

    def __init__(
        self, handlers: Mapping[str, SessionHandler], tokens: TokenRegistry, *,
        dataplane: DataPlaneConfig,
    ) -> None:
        self.handlers = dict(handlers)
        self.tokens = tokens
        self.dataplane = dataplane
        #: Refused frames per peer (who sent them, not whom the token names).
        self.refusals: Counter[str] = Counter()
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._next_stream = 0
        tokens.on_revoke(self._close_tokens)

    def attach(self, token: str | None, cancel: Callable[[], None], *,
               proof: bytes | None = None) -> tuple[Session, int]:
        """Open a stream on ``token``; return its session and stream id.

        A token bound to a node key needs ``proof``: a fresh nonce and that node's
        signature (see :mod:`.node_keys`).

        Raises
        ------
        SessionRefused
            ``UNAUTHENTICATED`` for a bad token, or a missing, malformed, wrong or replayed
            proof; ``PERMISSION_DENIED`` when the proof is another node's (the token
            belongs to another node); ``RESOURCE_EXHAUSTED`` when the token already
            holds its streams.
        """
        grant = self.tokens.lookup(token)
        if grant is None or grant.protocol not in self.handlers:
            raise SessionRefused(
                "UNAUTHENTICATED", "session token rejected: unknown, expired or revoked"
            )
        assert token is not None
        if grant.node_key is not None:
            self._check_proof(token, grant, proof)
        with self._lock:
            session = self._sessions.setdefault(token, Session(token, grant))
            if grant.node_key is not None:  # the proof was checked: it is there
                assert proof is not None
                if proof_nonce(proof) in session.nonces:
                    raise SessionRefused("UNAUTHENTICATED", "node proof replayed: this nonce "
                                         "already opened a stream on this token")
                session.nonces.add(proof_nonce(proof))
            if len(session.streams) >= self.dataplane.streams_per_token:
                raise SessionRefused(
                    "RESOURCE_EXHAUSTED", f"this token already holds "
                    f"{len(session.streams)} stream(s), the limit"
                )
            self._next_stream += 1
            stream = self._next_stream
            session.streams[stream] = cancel
            session.last_active = time.monotonic()
        self.handlers[grant.protocol].attach(session)
        return session, stream

    def _check_proof(self, token: str, grant: SessionGrant, proof: bytes | None) -> None:
        """Refuse the stream unless ``proof`` is the grantee's signature over ``token``."""
        assert grant.node_key is not None
        if (problem := proof_problem(proof)) is not None:
            raise SessionRefused("UNAUTHENTICATED", f"this token is bound to node "
                                 f"{grant.client}'s key: {problem}")
        assert proof is not None
        if verifies(grant.node_key, token, proof):
            return
        for other, key in self.tokens.keys_of_others(grant.client).items():
            if verifies(key, token, proof):
                raise SessionRefused(
                    "PERMISSION_DENIED", f"token belongs to another node: it was issued "
                    f"to node {grant.client}, and the stream's proof is node {other}'s")
        raise SessionRefused("UNAUTHENTICATED", f"node proof does not verify: the token "
                             f"was issued to node {grant.client}, which did not sign it")

    def detach(self, session: Session, stream: int) -> None:
        """End one stream of ``session`` (idempotent)."""
        with self._lock:
            if session.streams.pop(stream, None) is None:
                return
        self.handlers[session.grant.protocol].detach(session)

    def handle(self, session: Session, data: bytes, *, peer: str) -> bytes:
        """Answer one request frame of ``session``; never raises."""
        seq = 0
        try:
            if self.tokens.lookup(session.token) is None:
                raise FrameError(
                    Reason.TOKEN_REJECTED, "session token rejected: expired or revoked"
                )
            request = decode_request(data, max_bytes=self.dataplane.max_frame_bytes)
            seq = request.seq
            with self._lock:
                if seq <= session.last_seq:
                    raise FrameError(
                        Reason.REPLAYED, f"seq {seq} is not above {session.last_seq}, the "
                        "last seen on this session"
                    )
                session.last_seq = seq
                session.last_active = time.monotonic()
            reply = self.handlers[session.grant.protocol].handle(session, request)
        except FrameError as err:
            reply = self._refuse(seq, err, session, peer)
        except Exception as err:  # noqa: BLE001 - a bug must not end the stream or the trunk
            log.exception("data plane: the handler failed on a frame from %s", peer)
            reply = self._refuse(seq, FrameError(Reason.INTERNAL, repr(err)), session, peer)
        reply.seq = seq
        return reply.SerializeToString()

    def _refuse(self, seq: int, err: FrameError, session: Session, peer: str) -> pb.Reply:
        """Refuse a frame; a session past ``dataplane.max_refusals`` loses its token.

        A device sending frame after bad frame (each refused in milliseconds) still holds
        the interpreter for each and wrote a log line each: at 340 refused frames a second
        an honest device beside it fell from 75 to 22 steps a second. Its token is revoked
        once it has sent ``max_refusals`` refused frames (its streams close; it gets no
        other token this round), and only its first :data:`LOGGED_REFUSALS` are logged.
        """
        self.refusals[peer] += 1
        with self._lock:
            if err.reason not in NOT_COUNTED:
                session.refused += 1
            refused = session.refused
        if refused <= LOGGED_REFUSALS:
            log.warning(
                "data plane: refused a frame from %s (token of client %s): %s: %s",
                peer, session.grant.client, err.reason_name, err,
            )
        limit = self.dataplane.max_refusals
        if limit and refused == limit and err.reason not in NOT_COUNTED:
            log.warning("data plane: closing the session of client %s (%s): %d frames refused "
                        "(dataplane.max_refusals)", session.grant.client, peer, refused)
            self.tokens.revoke([session.token])
        return refusal(seq, err.reason, str(err))

    def close_idle(self) -> int:
        """Close the streams idle longer than the limit or whose token died; return how many."""
        now = time.monotonic()
        with self._lock:
            stale = [
                s for s in self._sessions.values()
                if s.streams and (now - s.last_active > self.dataplane.idle_timeout_s
                                  or self.tokens.lookup(s.token) is None)
            ]
        for session in stale:
            self._cancel(session)
        self._forget_dead_sessions()
        return len(stale)

    def _close_tokens(self, tokens: list[str]) -> None:
        with self._lock:
            sessions = [self._sessions[t] for t in tokens if t in self._sessions]
        for session in sessions:
            self._cancel(session)
        self._forget_dead_sessions()

    def _cancel(self, session: Session) -> None:
        with self._lock:
            streams = list(session.streams.items())
        for stream, cancel in streams:
            cancel()
            self.detach(session, stream)

    def _forget_dead_sessions(self) -> None:
        with self._lock:
            for token in [t for t, s in self._sessions.items()
                          if not s.streams and self.tokens.lookup(t) is None]:
                del self._sessions[token]

    @property
    def open_sessions(self) -> int:
        """Sessions with at least one open stream."""
        with self._lock:
            return sum(bool(s.streams) for s in self._sessions.values())
