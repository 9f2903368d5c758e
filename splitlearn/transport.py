"""Client side of the data plane: one session per ``train`` message.

A session sends ``forward`` frames (activations at the cut and labels) and
receives ``gradient`` frames (the gradient at the cut, loss, correct count).
A U-shaped session (labels stay on the device) instead uses
:meth:`~_FrameSession.forward_features` / :meth:`~_FrameSession.backward_features`:
two exchanges per batch, no labels in any frame (:mod:`server.trunk_ushaped`).
Two transports share one interface: :class:`GrpcTrunkSession` talks to a trunk
service over a gRPC bidirectional stream; :class:`InProcessTrunkSession` calls
a frame handler directly, for unit tests and the "limit" benchmark. Both send
the same bytes, so validation and byte counts are identical.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from splitlearn.wire import Frame, decode_frame, encode_frame, error_reason

#: Full gRPC method name of the trunk's bidirectional stream.
EXCHANGE_METHOD = "/splitlearn.Trunk/Exchange"
#: gRPC metadata key carrying the session token.
TOKEN_METADATA_KEY = "x-splitlearn-token"
#: Largest reply a client accepts (gradients are the size of the activations).
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


class TrunkRejected(RuntimeError):
    """The trunk refused a frame or the session; the message says why."""


@dataclass(frozen=True)
class TrunkReply:
    """What the trunk returns for one batch.

    Parameters
    ----------
    grad : torch.Tensor | None
        Gradient of the loss w.r.t. the activations (None for ``evaluate``).
    loss : float
        Mean loss over the batch.
    correct : int
        Number of correctly classified samples.
    """

    grad: torch.Tensor | None
    loss: float
    correct: int


class TrunkSession(Protocol):
    """A client's connection to the trunk for the duration of one round."""

    bytes_up: int
    bytes_down: int

    def exchange(self, activations: torch.Tensor, labels: torch.Tensor) -> TrunkReply:
        """Send one batch of activations; return the trunk's gradient."""
        ...

    def evaluate(self, activations: torch.Tensor, labels: torch.Tensor) -> TrunkReply:
        """Send one batch for loss/accuracy only; the trunk does not update."""
        ...

    def close(self) -> None:
        """End the session."""
        ...


class _FrameSession:
    """Shared bookkeeping: encode, count bytes, decode, raise on ``error``."""

    def __init__(self, *, max_frame_bytes: int) -> None:
        self.bytes_up = 0
        self.bytes_down = 0
        self.max_frame_bytes = max_frame_bytes

    def _round_trip(self, data: bytes) -> bytes:
        raise NotImplementedError

    def _send(self, kind: str, activations: torch.Tensor, labels: torch.Tensor) -> TrunkReply:
        data = encode_frame(kind, {"activations": activations, "labels": labels})
        self.bytes_up += len(data)
        reply = self._round_trip(data)
        self.bytes_down += len(reply)
        return _to_reply(decode_frame(reply, max_bytes=self.max_frame_bytes))

    def exchange(self, activations: torch.Tensor, labels: torch.Tensor) -> TrunkReply:
        """Send one batch of activations; return the trunk's gradient."""
        return self._send("forward", activations, labels)

    def evaluate(self, activations: torch.Tensor, labels: torch.Tensor) -> TrunkReply:
        """Send one batch for loss/accuracy only; the trunk does not update."""
        return self._send("evaluate", activations, labels)

    # U-shaped protocol: nothing label-derived is ever put in a frame.

    def forward_features(self, activations: torch.Tensor) -> torch.Tensor:
        """U-shaped: send activations at the cut (no labels); return the trunk's features.

        The trunk keeps this batch's graph until :meth:`backward_features`.
        """
        expect = ("features", "features")
        return self._send_tensors("forward", "activations", activations, expect)

    def backward_features(self, grad: torch.Tensor) -> torch.Tensor:
        """U-shaped: send d loss / d features; return the gradient at the cut.

        The trunk backpropagates through the pending graph and steps its stages.
        """
        return self._send_tensors("backward", "grad", grad, ("gradient", "grad"))

    def evaluate_features(self, activations: torch.Tensor) -> torch.Tensor:
        """U-shaped: the trunk's features for one batch, without a graph or an update."""
        expect = ("features", "features")
        return self._send_tensors("evaluate", "activations", activations, expect)

    def _send_tensors(
        self, kind: str, name: str, tensor: torch.Tensor, expect: tuple[str, str]
    ) -> torch.Tensor:
        """Send one tensor; return the tensor named ``expect[1]`` of an ``expect[0]`` reply."""
        data = encode_frame(kind, {name: tensor})
        self.bytes_up += len(data)
        reply = self._round_trip(data)
        self.bytes_down += len(reply)
        frame = decode_frame(reply, max_bytes=self.max_frame_bytes)
        if frame.kind == "error":
            raise TrunkRejected(error_reason(frame))
        reply_kind, reply_name = expect
        if frame.kind != reply_kind or reply_name not in frame.tensors:
            raise TrunkRejected(
                f"unexpected reply of kind {frame.kind!r} carrying {sorted(frame.tensors)}; "
                f"expected {reply_kind!r} with {reply_name!r}"
            )
        return frame.tensors[reply_name]


class UShapedSession(Protocol):
    """A U-shaped client's connection to the trunk: two exchanges per batch, no labels."""

    bytes_up: int
    bytes_down: int

    def forward_features(self, activations: torch.Tensor) -> torch.Tensor:
        """Send activations at the cut; return the trunk's output at the tail cut."""
        ...

    def backward_features(self, grad: torch.Tensor) -> torch.Tensor:
        """Send the gradient w.r.t. the features; return the gradient at the cut."""
        ...

    def evaluate_features(self, activations: torch.Tensor) -> torch.Tensor:
        """Return the trunk's output for one batch, without an update."""
        ...

    def close(self) -> None:
        """End the session."""
        ...


def _to_reply(frame: Frame) -> TrunkReply:
    if frame.kind == "error":
        raise TrunkRejected(error_reason(frame))
    if frame.kind not in ("gradient", "metrics"):
        raise TrunkRejected(f"unexpected reply of kind {frame.kind!r}")
    return TrunkReply(
        grad=frame.tensors.get("grad"),
        loss=float(frame.meta["loss"]),
        correct=int(frame.meta["correct"]),
    )


class InProcessTrunkSession(_FrameSession):
    """Session that hands frames to a handler in the same process.

    Parameters
    ----------
    handle : Callable[[bytes], bytes]
        Takes a request frame, returns the reply frame (the trunk side).
    max_frame_bytes : int
        Largest reply accepted.
    on_close : Callable[[], None], optional
        Called by :meth:`close`, as the end of a gRPC stream would be noticed
        by the trunk (it drops per-session state such as a pending U-shaped graph).
    """

    def __init__(
        self,
        handle: Callable[[bytes], bytes],
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(max_frame_bytes=max_frame_bytes)
        self._handle = handle
        self._on_close = on_close

    def _round_trip(self, data: bytes) -> bytes:
        return self._handle(data)

    def close(self) -> None:
        """Tell the trunk side the session ended (if it asked to know)."""
        if self._on_close is not None:
            self._on_close()


_END = object()


class GrpcTrunkSession(_FrameSession):
    """Session over one gRPC bidirectional stream.

    Parameters
    ----------
    address : str
        ``host:port`` of the trunk service.
    token : str
        Session token issued by the ServerApp for this client and round.
    max_frame_bytes : int
        Largest frame sent or received.
    root_certificates : bytes, optional
        PEM root certificates; when given the channel uses TLS.
    """

    def __init__(
        self,
        address: str,
        token: str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        root_certificates: bytes | None = None,
    ) -> None:
        super().__init__(max_frame_bytes=max_frame_bytes)
        # Leave headroom above the frame limit so that an oversized frame reaches
        # the trunk's own check and is refused with a reason, not a transport error.
        options = [
            ("grpc.max_send_message_length", 2 * max_frame_bytes),
            ("grpc.max_receive_message_length", 2 * max_frame_bytes),
        ]
        if root_certificates is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates)
            self._channel = grpc.secure_channel(address, creds, options=options)
        stub = self._channel.stream_stream(EXCHANGE_METHOD)
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._responses: Iterator[bytes] = stub(
            self._request_iterator(), metadata=((TOKEN_METADATA_KEY, token),)
        )

    def _request_iterator(self) -> Iterator[bytes]:
        while (item := self._requests.get()) is not _END:
            yield item  # type: ignore[misc]

    def _round_trip(self, data: bytes) -> bytes:
        self._requests.put(data)
        try:
            return next(self._responses)
        except grpc.RpcError as err:
            raise TrunkRejected(f"{err.code().name}: {err.details()}") from None
        except StopIteration:
            raise TrunkRejected("trunk closed the stream") from None

    def close(self) -> None:
        """Half-close the stream and release the channel."""
        self._requests.put(_END)
        self._channel.close()

    def abort(self) -> None:
        """Drop the connection without a clean close, as a vanishing device would."""
        self._responses.cancel()  # type: ignore[attr-defined]
        self._channel.close()
