"""The data plane: per-batch tensors between devices and the server's trunk.

``trunk.proto`` is the contract (compiled to ``trunk_pb2``); :mod:`.frames` writes and
reads its messages without copying tensor bytes, :mod:`.codec` encodes tensors and checks
frames, :mod:`.tokens` grants sessions, :mod:`.endpoint` serves them without a
transport, :mod:`.service` over gRPC, and :mod:`.channel` is the client side.
"""

from splitlearn.dataplane.channel import (
    GrpcTransport,
    InProcessTransport,
    TrunkChannel,
    TrunkRejected,
)
from splitlearn.dataplane.codec import FrameError, Reason
from splitlearn.dataplane.endpoint import Session, SessionHandler, TrunkEndpoint
from splitlearn.dataplane.service import TrunkService
from splitlearn.dataplane.tokens import SessionGrant, TokenRegistry

__all__ = [
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
]
