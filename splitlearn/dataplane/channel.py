"""The client side of the data plane: one :class:`TrunkChannel` per session.

A channel sends typed requests (``trunk.proto``) and returns the trunk's answers as
tensors; a ``Refusal`` becomes :class:`TrunkRejected` with its reason. It counts the
bytes each way and the seconds spent waiting for the trunk, so the client loop can
tell its own compute from the wait. Two transports move the bytes:
:class:`GrpcTransport` (a bidirectional stream, with a deadline on the stream and
on every reply) and :class:`InProcessTransport` (calls a :class:`TrunkEndpoint`
directly: the same frames and checks, no network), for tests and local runs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import grpc
import torch
from torch.utils._python_dispatch import _disable_current_modes

from splitlearn.config import CompressionConfig
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import decode_tensor, encode_tensor, encoder, request
from splitlearn.dataplane.endpoint import SessionRefused, TrunkEndpoint
from splitlearn.dataplane.feedback import ExampleRows, FeedbackFull, ReferenceFeedback
from splitlearn.dataplane.frames import Frame, read
from splitlearn.dataplane.node_keys import PROOF_METADATA_KEY
from splitlearn.dataplane.service import EXCHANGE_METHOD, TOKEN_METADATA_KEY

#: Largest reply a client accepts (gradients are the size of the activations).
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
#: One-way frames (smashed data) a client may have sent but not seen acknowledged.
DEFAULT_WINDOW = 32
#: How often a stream's watchdog looks for an overdue reply (its deadline's precision).
WATCHDOG_PERIOD_S = 0.05
#: Seconds a closing device waits for the trunk to end the stream after its half-close.
CLOSE_TIMEOUT_S = 2.0
#: Times a one-way batch refused as stale is sent again (each after the references restart).
MAX_STALE_RESENDS = 2
_END = object()


class TrunkRejected(RuntimeError):
    """The trunk refused a request or the session ended; the message says why.

    ``reason`` is the refusal's reason name (``"OUT_OF_RANGE"``, ...) when the trunk
    answered with a ``Refusal``; None when the session ended otherwise.
    """

    #: Reply status of a client whose round the trunk refused.
    kind = "refused"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason


class Transport(Protocol):
    """Moves frames to the trunk and its replies back, in order."""

    def send(self, data: bytes) -> None:
        """Send one request frame."""
        ...

    def receive(self, timeout_s: float) -> bytes:
        """Return the next reply frame; raise TrunkRejected if none comes in time."""
        ...

    def close(self) -> None:
        """End the session cleanly."""
        ...

    def abort(self) -> None:
        """Drop the connection without a clean close, as a vanishing device would."""
        ...


class GrpcTransport:
    """One gRPC bidirectional stream to the trunk service.

    Parameters
    ----------
    address : str
        ``host:port`` of the trunk service.
    token : str
        Session token from the round's Flower message.
    max_frame_bytes : int
        Largest frame sent or received.
    stream_timeout_s : float
        Deadline of the whole stream (the session's lifetime).
    tls : bool
        Dial with TLS (also implied by ``root_certificates``).
    root_certificates : bytes, optional
        PEM roots to verify the trunk's certificate by; the system's when None.
    proof : bytes, optional
        This node's proof for the token (:func:`~splitlearn.dataplane.node_keys.prove`),
        which a token bound to the node's key needs.
    """

    def __init__(
        self,
        address: str,
        token: str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        stream_timeout_s: float = 3600.0,
        tls: bool = False,
        root_certificates: bytes | None = None,
        proof: bytes | None = None,
    ) -> None:
        # Headroom above the frame limit: an oversized frame reaches the trunk's own
        # check and is refused with a reason, not a transport error.
        options = [
            ("grpc.max_send_message_length", 2 * max_frame_bytes),
            ("grpc.max_receive_message_length", 2 * max_frame_bytes),
        ]
        if not tls and root_certificates is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates)
            self._channel = grpc.secure_channel(address, creds, options=options)
        self._requests: queue.SimpleQueue[object] = queue.SimpleQueue()
        metadata: tuple[tuple[str, str | bytes], ...] = ((TOKEN_METADATA_KEY, token),)
        if proof is not None:
            metadata += ((PROOF_METADATA_KEY, proof),)
        self._call = self._channel.stream_stream(EXCHANGE_METHOD)(
            self._request_iterator(), metadata=metadata,
            timeout=stream_timeout_s,
        )
        # Replies are read on the caller's thread (a reader thread would add a hand-off
        # per batch); a watchdog cancels the stream when a reply is overdue.
        self._deadline: float | None = None
        self._overdue = False
        self._failure: TrunkRejected | None = None
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="trunk-deadline", daemon=True).start()

    def _request_iterator(self) -> Iterator[bytes]:
        while (item := self._requests.get()) is not _END:
            yield item  # type: ignore[misc]

    def _watch(self) -> None:
        while not self._done.wait(WATCHDOG_PERIOD_S):
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self._overdue = True
                self._call.cancel()
                return

    def send(self, data: bytes) -> None:
        """Queue one frame on the stream."""
        self._requests.put(data)

    def receive(self, timeout_s: float) -> bytes:
        """Return the next reply; cancel the stream if none comes within ``timeout_s``."""
        if self._failure is not None:  # every later receive fails the same way
            raise self._failure
        self._deadline = time.monotonic() + timeout_s
        try:
            return next(self._call)
        except grpc.RpcError as err:
            self._failure = TrunkRejected(
                f"no reply from the trunk within {timeout_s:g} s" if self._overdue
                else _describe(err)
            )
        except StopIteration:
            self._failure = TrunkRejected("the trunk closed the stream")
        finally:
            self._deadline = None
        self._done.set()
        raise self._failure

    def close(self) -> None:
        """Half-close the stream, let the trunk end it, and release the channel.

        Closing the channel straight away would cancel the stream before the trunk saw
        the half-close: to the trunk, a device that vanished. So the trunk ends it
        first (replies nobody waits for, such as local loss's acks, are dropped); one
        that does not within :data:`CLOSE_TIMEOUT_S` is cut off by the watchdog.
        """
        self._requests.put(_END)
        if self._failure is None:
            self._deadline = time.monotonic() + CLOSE_TIMEOUT_S
            try:
                for _ in self._call:
                    pass
            except grpc.RpcError:
                pass  # cut off (the watchdog, or the trunk went): released either way
            finally:
                self._deadline = None
        self._done.set()
        self._channel.close()

    def abort(self) -> None:
        """Cancel the stream and release the channel."""
        self._done.set()
        self._call.cancel()
        self._channel.close()


def _describe(err: grpc.RpcError) -> str:
    code = err.code()  # type: ignore[attr-defined]
    if code == grpc.StatusCode.CANCELLED:
        return "CANCELLED: the trunk closed the session (token revoked or expired, or idle)"
    return f"{code.name}: {err.details()}"  # type: ignore[attr-defined]


class InProcessTransport:
    """Hands frames to a :class:`TrunkEndpoint` in this process (same frames, same checks).

    Parameters
    ----------
    endpoint : TrunkEndpoint
        The trunk side.
    token : str
        Session token.
    peer : str
        How refusals name this client in the endpoint's books.
    proof : bytes, optional
        This node's proof for the token, as for :class:`GrpcTransport`.
    """

    def __init__(self, endpoint: TrunkEndpoint, token: str, *, peer: str = "in-process",
                 proof: bytes | None = None) -> None:
        self._endpoint = endpoint
        self._peer = peer
        self._replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        try:
            self._session, self._stream = endpoint.attach(token, self._cancelled.set, proof=proof)
        except SessionRefused as refused:
            raise TrunkRejected(f"{refused.code}: {refused}") from None

    def send(self, data: bytes) -> None:
        """Let the endpoint answer the frame now."""
        if self._cancelled.is_set():
            raise TrunkRejected("CANCELLED: the trunk closed the session")
        # The trunk's work runs on the device's thread here, and is the trunk's: a mode
        # that watches the device's compute (its FLOP count) must not see it.
        with _disable_current_modes():
            reply = self._endpoint.handle(self._session, data, peer=self._peer)
        self._replies.put(reply)

    def receive(self, timeout_s: float) -> bytes:
        """Return the next reply (already computed)."""
        try:
            return self._replies.get_nowait()
        except queue.Empty:
            raise TrunkRejected("no reply pending") from None

    def close(self) -> None:
        """Detach from the endpoint, as the end of a stream would."""
        self._endpoint.detach(self._session, self._stream)

    abort = close


def _checked_ids(ids: torch.Tensor | None) -> torch.Tensor:
    """Return the batch's example ids as sent (int64, on the CPU); error feedback needs them."""
    if ids is None:
        raise ValueError("error feedback needs each training batch's example_ids")
    return ids.detach().cpu().to(torch.int64)


def _admit(rows: ExampleRows, ids: torch.Tensor, row_shape: tuple[int, ...]) -> None:
    """Make room for ``ids`` before sending: past the device's bound, stop with a reason."""
    try:
        rows.admit(ids, row_shape)
    except FeedbackFull as err:
        raise ValueError(f"error feedback: {err}") from None


@dataclass(frozen=True)
class _InFlight:
    """A one-way batch sent with error feedback, kept until its ack (to send it again)."""

    activations: torch.Tensor
    labels: torch.Tensor
    ids: torch.Tensor
    generation: int  # of the device's references it was encoded against
    resends: int = 0


class TrunkChannel:
    """Typed requests to the trunk over a transport, with byte and wait accounting.

    Parameters
    ----------
    transport : Transport
        Moves the frames.
    reply_timeout_s : float
        Longest wait for any one reply.
    max_frame_bytes : int
        Largest reply accepted.
    window : int
        One-way requests (``smashed``) in flight before :meth:`send_smashed` waits.
    compression : CompressionConfig | None
        Its ``uplink`` method encodes the floats this device sends (None: as computed).
        With ``error_feedback``, training batches name their examples and, for a lossy
        uplink, travel as differences from per-example references
        (:mod:`~splitlearn.dataplane.feedback`): :attr:`feedback`, which a device keeps
        between rounds.
    last_seq : int
        The sequence number the token's previous stream ended at (0: a new session). The
        trunk refuses a request whose ``seq`` is not above the last it saw for the token
        (``REPLAYED``), so a fresh channel that resumes a session starts above it; read it
        off the previous channel's :attr:`last_seq`.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        reply_timeout_s: float = 600.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        window: int = DEFAULT_WINDOW,
        compression: CompressionConfig | None = None,
        last_seq: int = 0,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if last_seq < 0:
            raise ValueError(f"last_seq must be >= 0, got {last_seq}")
        self.transport = transport
        compression = compression or CompressionConfig()
        # The floats this device sends (activations; U-shaped: also the head's gradient).
        self._encode = encoder(compression, "uplink")
        self.error_feedback = compression.error_feedback
        self._feedback_max_bytes = compression.feedback_max_bytes
        #: The device's per-example references (lossy uplink with error feedback), or None.
        self.feedback = (ReferenceFeedback(max_bytes=self._feedback_max_bytes)
                         if compression.uplink_feedback else None)
        #: U-shaped with error feedback and a lossy downlink: references of the trunk's
        #: features, which the trunk keeps too (made at the first batch).
        self.feature_feedback: ReferenceFeedback | None = None
        self._features_feedback = compression.downlink_feedback
        self.reply_timeout_s = reply_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.window = window
        self.bytes_up = 0
        self.bytes_down = 0
        #: Seconds spent waiting for the trunk (sending, and for replies).
        self.wait_s = 0.0
        self._seq = last_seq
        #: One-way requests sent and not acknowledged, oldest first (None: no error feedback).
        self._unacked: deque[_InFlight | None] = deque()
        #: Restarts of the references (a batch encoded before the last one is stale anyway).
        self._generation = 0
        #: Moves of the current references the trunk has not acknowledged (local loss).
        self._unconfirmed_moves = 0

    @property
    def in_flight(self) -> int:
        """One-way requests sent and not yet acknowledged."""
        return len(self._unacked)

    @property
    def feedback_settled(self) -> bool:
        """Whether the trunk acknowledged every move of the references this device holds.

        Local loss moves them as a frame is sent; one the trunk never acknowledged (lost with
        the link, or refused) leaves them at a version the trunk may reach later by another
        batch. Kept for a later round they could then pass for the trunk's, so a device
        keeps only settled references (the trunk's version tells it the rest).
        """
        return self._unconfirmed_moves == 0

    @property
    def restarts(self) -> int:
        """Times the references shared with the trunk started over from zero on this channel.

        Each time the trunk found them stale or dropped them, or the cut moved.
        """
        return self._generation

    @property
    def last_seq(self) -> int:
        """The sequence number of the last request sent (a resuming channel starts above it)."""
        return self._seq

    def next_seq(self) -> int:
        """Take the next request sequence number (every request needs a fresh one)."""
        self._seq += 1
        return self._seq

    def _send(self, kind: str, **fields: Frame | int) -> None:
        data = request(self.next_seq(), kind, **fields).SerializeToString()
        started = time.perf_counter()
        self.transport.send(data)
        self.wait_s += time.perf_counter() - started
        self.bytes_up += len(data)

    def _receive(self, expect: str) -> Frame | pb.Reply:
        started = time.perf_counter()
        data = self.transport.receive(self.reply_timeout_s)
        self.wait_s += time.perf_counter() - started
        self.bytes_down += len(data)
        try:
            reply = read(pb.Reply, data)  # a large reply's tensors are views of ``data``
        except ValueError as err:  # a broken reply fails the session
            raise TrunkRejected(f"undecodable reply: {err}") from None
        kind = reply.WhichOneof("kind")
        if kind == "refusal":
            name = pb.Refusal.Reason.Name(reply.refusal.reason)
            raise TrunkRejected(f"{name}: {reply.refusal.detail}", reason=name)
        if kind != expect:
            raise TrunkRejected(f"unexpected reply {kind!r}; expected {expect!r}")
        return reply

    def _call(self, expect: str, kind: str, **fields: Frame | int) -> Frame | pb.Reply:
        self.flush()  # replies come in order: collect the acks of earlier one-way frames
        self._send(kind, **fields)
        return self._receive(expect)

    def _tensor(self, msg: Frame | pb.Tensor, name: str) -> torch.Tensor:
        try:
            return decode_tensor(msg, name=name, max_bytes=self.max_frame_bytes)
        except ValueError as err:
            raise TrunkRejected(f"bad {name} in the trunk's reply: {err}") from None

    # --- split: the trunk holds the loss -------------------------------------------

    def forward(
        self, activations: torch.Tensor, labels: torch.Tensor, *,
        example_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, float, int]:
        """Train on one batch; return the gradient at the cut, the mean loss and hits.

        With error feedback, ``example_ids`` (each row's index in the device's data,
        distinct) are required.
        """
        if not self.error_feedback:
            reply = self._call("gradient", "forward", activations=self._encode(activations),
                               labels=encode_tensor(labels))
        else:
            reply = self._forward_with_feedback(activations, labels, example_ids)
        grad = self._tensor(reply.gradient.grad, "grad")
        return grad, reply.gradient.loss, int(reply.gradient.correct)

    def _forward_with_feedback(self, activations: torch.Tensor, labels: torch.Tensor,
                               ids: torch.Tensor | None) -> Frame | pb.Reply:
        """Send the batch's ids, and for a lossy uplink each row's difference from its reference.

        A batch the trunk finds stale (its references are not the device's: a round the
        device did not finish, or a trunk that dropped them) is sent again from zero.
        """
        ids = _checked_ids(ids)
        if self.feedback is None:
            return self._call("gradient", "forward", activations=self._encode(activations),
                              labels=encode_tensor(labels), example_ids=encode_tensor(ids))
        try:
            return self._forward_difference(activations, labels, ids)
        except TrunkRejected as err:
            if err.reason != "STALE_FEEDBACK":
                raise
        self._restart_references()
        return self._forward_difference(activations, labels, ids)

    def _restart_references(self) -> None:
        """Zero the references this device shares with the trunk (its next batch: version 0)."""
        self._generation += 1
        self._unconfirmed_moves = 0
        if self.feedback is not None:
            self.feedback = ReferenceFeedback(max_bytes=self._feedback_max_bytes)
        if self.feature_feedback is not None:
            self.feature_feedback = ReferenceFeedback(max_bytes=self._feedback_max_bytes)

    @property
    def _shared(self) -> ReferenceFeedback | None:
        """The references whose version and lineage the frames carry (U-shaped: both move)."""
        return self.feedback or self.feature_feedback

    @property
    def feedback_version(self) -> int:
        """Batches the shared references absorbed since they were zero."""
        return 0 if self._shared is None else self._shared.version

    @property
    def feedback_lineage(self) -> int:
        """The start from zero the shared references come from (0 before the first)."""
        return 0 if self._shared is None else self._shared.lineage

    def _difference(self, activations: torch.Tensor, ids: torch.Tensor
                    ) -> tuple[ReferenceFeedback, Frame, torch.Tensor]:
        """Encode the rows as differences from their references (zeroed first at another cut).

        Returns the references, the frame and ``agreed``: what the trunk trains on, since it
        decodes the same bytes onto the same references.
        """
        shape = tuple(activations.shape[1:])
        assert self.feedback is not None
        if not self.feedback.references.holds(shape):  # another cut now
            self._restart_references()
        feedback = self.feedback
        _admit(feedback.references, ids, shape)
        frame, agreed = feedback.encode(ids, activations.detach().float(), self._round_trip)
        return feedback, frame, agreed

    def _forward_difference(self, activations: torch.Tensor, labels: torch.Tensor,
                            ids: torch.Tensor) -> Frame | pb.Reply:
        feedback, frame, agreed = self._difference(activations, ids)
        reply = self._call("gradient", "forward", activations=frame,
                           labels=encode_tensor(labels), example_ids=encode_tensor(ids),
                           feedback_version=feedback.version, feedback_lineage=feedback.lineage)
        feedback.commit(ids, agreed)  # the trunk took the batch: both references moved
        if reply.gradient.feedback_dropped:  # then dropped its side: start over, in step
            self._restart_references()
        return reply

    def _round_trip(self, activations: torch.Tensor) -> tuple[Frame, torch.Tensor]:
        """Encode ``activations``; return the frame and what the trunk will decode from it."""
        frame = self._encode(activations)
        return frame, decode_tensor(frame, name="activations",
                                    max_bytes=self.max_frame_bytes).float()

    def evaluate(self, activations: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
        """Mean loss and hits of one batch, without an update."""
        reply = self._call("metrics", "evaluate", activations=self._encode(activations),
                           labels=encode_tensor(labels))
        return reply.metrics.loss, int(reply.metrics.correct)

    # --- U-shaped: labels stay on the device ----------------------------------------

    def forward_features(self, activations: torch.Tensor, *,
                         example_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Send activations (no labels); return the trunk's features (it keeps the graph).

        With error feedback, ``example_ids`` are required (as for :meth:`forward`), and the
        features are those both sides agree on (reference + the decoded difference).
        """
        if not self.error_feedback:
            reply = self._call("features", "forward", activations=self._encode(activations))
            return self._tensor(reply.features.features, "features")
        ids = _checked_ids(example_ids)
        try:
            return self._features_difference(activations, ids)
        except TrunkRejected as err:
            if err.reason != "STALE_FEEDBACK":
                raise
        self._restart_references()
        return self._features_difference(activations, ids)

    def _features_difference(self, activations: torch.Tensor, ids: torch.Tensor
                             ) -> torch.Tensor:
        """One U-shaped forward with error feedback: both references move together."""
        if self.feedback is None:
            frame, agreed = self._encode(activations), None
        else:
            _, frame, agreed = self._difference(activations, ids)
        if self._features_feedback and self.feature_feedback is None:  # its lineage goes now
            self.feature_feedback = ReferenceFeedback(max_bytes=self._feedback_max_bytes)
        reply = self._call("features", "forward", activations=frame,
                           example_ids=encode_tensor(ids), feedback_version=self.feedback_version,
                           feedback_lineage=self.feedback_lineage)
        features = self._tensor(reply.features.features, "features")
        if self._features_feedback:
            references = self.feature_feedback
            assert references is not None
            _admit(references.references, ids, tuple(features.shape[1:]))
            features = references.reconstruct(ids, features.float())
            references.commit(ids, features)
        if self.feedback is not None:
            self.feedback.commit(ids, agreed)
        if reply.features.feedback_dropped:
            self._restart_references()
        return features

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        """Send d loss / d features of the pending batch; return the gradient at the cut.

        Not fed back under error feedback: what compression drops from an example's row
        would reach the trunk an epoch later, through another trunk (measured: U-shaped
        on digits with top-k then stayed at chance, where plain top-k trained).
        """
        reply = self._call("gradient", "backward", grad=self._encode(grad))
        return self._tensor(reply.gradient.grad, "grad")

    def evaluate_features(self, activations: torch.Tensor) -> torch.Tensor:
        """Return the trunk's features for one batch, without a graph or an update."""
        reply = self._call("features", "evaluate", activations=self._encode(activations))
        return self._tensor(reply.features.features, "features")

    # --- local loss: one way ---------------------------------------------------------

    def send_smashed(self, activations: torch.Tensor, labels: torch.Tensor, *,
                     example_ids: torch.Tensor | None = None) -> None:
        """Send one batch of smashed data without waiting, unless ``window`` are unacked.

        With error feedback and a lossy uplink, ``example_ids`` are required and the rows
        go as differences from the references, which move as the batch is sent. Until its
        ack the batch is kept, to be sent again from zero should the trunk find it stale.
        """
        while self.in_flight >= self.window:
            self._collect_ack()
        if self.feedback is None:
            self._send("smashed", activations=self._encode(activations),
                       labels=encode_tensor(labels))
            self._unacked.append(None)
            return
        self._send_difference(_InFlight(activations.detach().float(), labels,
                                        _checked_ids(example_ids), self._generation))

    def _send_difference(self, batch: _InFlight) -> None:
        feedback, frame, agreed = self._difference(batch.activations, batch.ids)
        self._send("smashed", activations=frame, labels=encode_tensor(batch.labels),
                   example_ids=encode_tensor(batch.ids), feedback_version=feedback.version,
                   feedback_lineage=feedback.lineage)
        feedback.commit(batch.ids, agreed)  # the trunk's move as it queues the batch
        self._unconfirmed_moves += 1
        self._unacked.append(replace(batch, generation=self._generation))

    def flush(self) -> None:
        """Wait for every one-way frame's ack; raise if the trunk refused one."""
        while self._unacked:
            self._collect_ack()

    def _collect_ack(self) -> None:
        """Take the oldest frame's ack; a stale batch goes again from zero, other refusals raise.

        Stale: the device's references were not the trunk's (it lost a round's, or the
        trunk dropped them). The trunk then dropped its own, so every frame behind it in
        flight comes back stale too: the first restarts the references, and each is sent
        again from the new ones.
        """
        batch = self._unacked.popleft()
        try:
            reply = self._receive("ack")
        except TrunkRejected as err:
            stale = err.reason == "STALE_FEEDBACK"
            if batch is None or not stale or batch.resends >= MAX_STALE_RESENDS:
                raise
            if batch.generation == self._generation:
                self._restart_references()
            self._send_difference(replace(batch, resends=batch.resends + 1))
            return
        current = batch is not None and batch.generation == self._generation
        if current:
            self._unconfirmed_moves -= 1
        if reply.ack.feedback_dropped and current:  # as in _forward_difference
            self._restart_references()

    def close(self) -> None:
        """End the session cleanly."""
        self.transport.close()

    def abort(self) -> None:
        """Vanish: drop the connection without a clean close."""
        self.transport.abort()
