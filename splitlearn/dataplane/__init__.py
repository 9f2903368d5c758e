"""The data plane: per-batch tensors between devices and the server's trunk.

``trunk.proto`` is the contract (compiled to ``trunk_pb2``); :mod:`.frames` writes and
reads its messages without copying tensor bytes, :mod:`.codec` encodes tensors and checks
frames, :mod:`.tokens` grants sessions, :mod:`.endpoint` serves them without a
transport, :mod:`.service` over gRPC and :mod:`.websocket` over WebSocket (for
browsers: the same frames), and :mod:`.channel` is the client side.

What a client of another language needs beside ``trunk.proto``: the stream's full method
name (:data:`EXCHANGE_METHOD`), and the gRPC metadata keys of the session token
(:data:`TOKEN_METADATA_KEY`) and of a node's proof of its key (:data:`PROOF_METADATA_KEY`).
The server side in a few lines is :func:`server.standalone.serve_trunk`.
"""

from splitlearn.dataplane.channel import (
    GrpcTransport,
    InProcessTransport,
    TrunkChannel,
    TrunkRejected,
)
from splitlearn.dataplane.codec import FrameError, Reason
from splitlearn.dataplane.endpoint import Session, SessionHandler, TrunkEndpoint
from splitlearn.dataplane.node_keys import PROOF_METADATA_KEY
from splitlearn.dataplane.service import EXCHANGE_METHOD, TOKEN_METADATA_KEY, TrunkService
from splitlearn.dataplane.tokens import SessionGrant, TokenRegistry
from splitlearn.dataplane.websocket import (
    WEBSOCKET_SCHEMES,
    TrunkWebSocketService,
    WebSocketTransport,
)

__all__ = [
    "EXCHANGE_METHOD",
    "PROOF_METADATA_KEY",
    "TOKEN_METADATA_KEY",
    "WEBSOCKET_SCHEMES",
    "FrameError",
    "GrpcTransport",
    "InProcessTransport",
    "Reason",
    "Session",
    "SessionGrant",
    "SessionHandler",
    "TokenRegistry",
    "TrunkChannel",
    "TrunkEndpoint",
    "TrunkRejected",
    "TrunkService",
    "TrunkWebSocketService",
    "WebSocketTransport",
]
