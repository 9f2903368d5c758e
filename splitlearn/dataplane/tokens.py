"""Session tokens: what the ServerApp grants a client for one round on the data plane."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SessionGrant:
    """What a token entitles its holder to.

    Parameters
    ----------
    client : str
        Client (Flower node) id the token was issued to.
    protocol : str
        The protocol whose session handler serves the token's streams.
    cut : int
        The client's cut: activations must have the shape of that cut.
    server_round : int
        Round the token belongs to; it is revoked when the round ends.
    expires_at : float
        ``time.monotonic()`` deadline.
    node_key : bytes, optional
        The client's Ed25519 public key (see :mod:`.node_keys`): every stream on the
        token must open with the client's proof. Without one the token is a bearer secret.
    """

    client: str
    protocol: str
    cut: int
    server_round: int
    expires_at: float
    node_key: bytes | None = None


class TokenRegistry:
    """Issues, checks and revokes per-round session tokens (thread-safe)."""

    def __init__(self) -> None:
        self._grants: dict[str, SessionGrant] = {}
        self._lock = threading.Lock()
        self._revoke_listeners: list[Callable[[list[str]], None]] = []

    def issue(
        self, *, client: str, protocol: str, cut: int, server_round: int, ttl_s: float,
        node_key: bytes | None = None,
    ) -> str:
        """Return a fresh random token for ``client`` valid for ``ttl_s`` seconds.

        With ``node_key`` the token is bound to it (see :class:`SessionGrant`).
        """
        token = secrets.token_urlsafe(24)
        grant = SessionGrant(client, protocol, cut, server_round, time.monotonic() + ttl_s,
                             node_key)
        with self._lock:
            self._grants[token] = grant
        return token

    def adopt(self, token: str, grant: SessionGrant) -> None:
        """Accept ``token`` as another registry issued it (a trunk worker's copy of a grant)."""
        with self._lock:
            self._grants[token] = grant

    def lookup(self, token: str | None) -> SessionGrant | None:
        """Return the grant of a valid token, or None if unknown, expired or revoked."""
        with self._lock:
            grant = self._grants.get(token) if token else None
        if grant is None or grant.expires_at < time.monotonic():
            return None
        return grant

    def keys_of_others(self, client: str) -> dict[str, bytes]:
        """Return the node keys of the live grants of every client but ``client``."""
        now = time.monotonic()
        with self._lock:
            return {g.client: g.node_key for g in self._grants.values()
                    if g.node_key is not None and g.client != client and g.expires_at >= now}

    def revoke_round(self, server_round: int) -> None:
        """Invalidate every token of ``server_round`` and older; tell the listeners."""
        with self._lock:
            revoked = [t for t, g in self._grants.items() if g.server_round <= server_round]
        self.revoke(revoked)

    def revoke(self, tokens: list[str]) -> None:
        """Invalidate ``tokens`` (unknown ones are ignored); tell the listeners."""
        with self._lock:
            for token in tokens:
                self._grants.pop(token, None)
            listeners = list(self._revoke_listeners)
        for listener in listeners:
            listener(tokens)

    def on_revoke(self, listener: Callable[[list[str]], None]) -> None:
        """Call ``listener`` with the tokens each :meth:`revoke_round` invalidates."""
        with self._lock:
            self._revoke_listeners.append(listener)
