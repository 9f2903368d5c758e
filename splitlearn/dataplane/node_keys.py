"""Node keys: a session token that only the node it was granted to can use.

A token alone is a bearer secret: whoever holds it may open its session. With node keys
each node keeps an Ed25519 key pair for the run and gives the ServerApp its public key in
a reply to a Flower message (``query.node_key``), which Flower's node authentication
vouches came from that node. Tokens are then bound to the key of the node they are issued
to, and every stream on them must open with a *proof*: a fresh nonce and the node's
signature over the token and that nonce. A token used by another node (its signature, not
the grantee's) or replayed with an old proof is refused when the stream opens.

This module is the pure part (keys, proofs, checks); the strategy learns the keys and the
endpoint checks the proofs.
"""

from __future__ import annotations

import secrets

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

#: Flower message type by which the ServerApp asks a node for its public key.
NODE_KEY_QUERY = "query.node_key"
#: The reply's record, and its field holding the raw public key.
NODE_KEY_RECORD, PUBLIC_KEY_FIELD = "node-key", "public-key"
#: gRPC metadata key of a stream's proof (binary: gRPC wants the ``-bin`` suffix).
PROOF_METADATA_KEY = "x-splitlearn-proof-bin"
#: Bytes of a proof's nonce; the signature (64 bytes) follows it.
NONCE_BYTES = 16
#: Bytes of an Ed25519 signature, of a raw public key and of a raw private key.
SIGNATURE_BYTES = 64
PUBLIC_KEY_BYTES = 32
PRIVATE_KEY_BYTES = 32
#: What a proof signs before the token and the nonce, so that no other signature the key
#: makes can pass for one.
_DOMAIN = b"splitlearn.dataplane.v1/stream\x00"


def new_private_key() -> bytes:
    """Return a fresh Ed25519 private key (32 raw bytes)."""
    return Ed25519PrivateKey.generate().private_bytes_raw()


def public_key_of(private_key: bytes) -> bytes:
    """Return the raw 32-byte public key of ``private_key``."""
    return Ed25519PrivateKey.from_private_bytes(private_key).public_key().public_bytes_raw()


def signed_bytes(token: str, nonce: bytes) -> bytes:
    """Return what a proof signs: the domain, the token and the nonce."""
    return _DOMAIN + token.encode() + b"\x00" + nonce


def prove(private_key: bytes, token: str, *, nonce: bytes | None = None) -> bytes:
    """Return a proof for one stream on ``token``: a nonce, then the node's signature.

    Parameters
    ----------
    private_key : bytes
        The node's Ed25519 private key (raw).
    token : str
        The session token the stream opens with.
    nonce : bytes, optional
        ``NONCE_BYTES`` bytes; a fresh random one when None (reuse gets the stream refused).
    """
    nonce = secrets.token_bytes(NONCE_BYTES) if nonce is None else nonce
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce has {NONCE_BYTES} bytes, got {len(nonce)}")
    key = Ed25519PrivateKey.from_private_bytes(private_key)
    return nonce + key.sign(signed_bytes(token, nonce))


def proof_nonce(proof: bytes) -> bytes:
    """Return the nonce of a well-formed proof."""
    return proof[:NONCE_BYTES]


def proof_problem(proof: bytes | None) -> str | None:
    """Return why ``proof`` is not even shaped like one, or None when it is."""
    if proof is None:
        return "no proof (metadata x-splitlearn-proof-bin)"
    if len(proof) != NONCE_BYTES + SIGNATURE_BYTES:
        return (f"a proof has {NONCE_BYTES + SIGNATURE_BYTES} bytes (nonce, then an Ed25519 "
                f"signature), got {len(proof)}")
    return None


def verifies(public_key: bytes, token: str, proof: bytes) -> bool:
    """Whether ``proof`` (well-formed) is the holder of ``public_key``'s for ``token``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            proof[NONCE_BYTES:], signed_bytes(token, proof_nonce(proof)))
    except (InvalidSignature, ValueError):
        return False
    return True


def public_key_problem(public_key: object) -> str | None:
    """Return why ``public_key`` is not a usable Ed25519 public key, or None."""
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
        return f"a node key is {PUBLIC_KEY_BYTES} raw bytes (Ed25519), got {public_key!r:.60}"
    try:
        Ed25519PublicKey.from_public_bytes(public_key)
    except ValueError as err:
        return f"not an Ed25519 public key: {err}"
    return None
