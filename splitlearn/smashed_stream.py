"""Client side of the one-way data plane of local-loss split learning.

A local-loss client never waits for the trunk per batch: it hands each batch's
activations and labels to a :class:`SmashedSink` and carries on training its
bottom against its auxiliary head. Three sinks share one interface:

* :class:`GrpcSmashedStream` sends ``smashed`` frames over the trunk's gRPC
  bidirectional stream without waiting for replies. A reader thread collects
  the trunk's ``ack`` (queued) or ``error`` frames; at most ``window`` frames
  are unacknowledged at a time, so a trunk that falls behind slows the client
  down (back-pressure) instead of letting frames pile up in memory.
  :meth:`~GrpcSmashedStream.flush` waits for every ack at the end of the round.
* :class:`InProcessSmashedStream` hands the same frames to a handler in this
  process (unit tests).
* :class:`SmashedBuffer` keeps the round's smashed data for the Flower reply
  (bulk mode, for devices that can reach only the SuperLink).

A refused frame fails the client's round (as a refused ``forward`` does in
SplitFed): the error is raised by the next :meth:`send` or by :meth:`flush`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Protocol

import grpc
import torch

from splitlearn.transport import DEFAULT_MAX_FRAME_BYTES, GrpcTrunkSession, TrunkRejected
from splitlearn.wire import FrameError, decode_frame, encode_frame, error_reason

#: Frames a streaming client may have sent but not yet seen acknowledged.
DEFAULT_WINDOW = 32
#: Key of the ArrayRecord that carries a round's smashed data in a bulk-mode reply.
SMASHED_RECORD_KEY = "smashed"


class SmashedSink(Protocol):
    """Where a local-loss client puts each batch's smashed data."""

    bytes_up: int
    bytes_down: int

    def send(self, activations: torch.Tensor, labels: torch.Tensor) -> None:
        """Hand over one batch (activations at the cut, labels) without waiting."""
        ...

    def flush(self) -> None:
        """Return once everything sent is accepted; raise TrunkRejected otherwise."""
        ...

    def close(self) -> None:
        """Release the connection (safe after a failure; does not wait)."""
        ...

    def abort(self) -> None:
        """Drop the connection without a clean close, as a vanishing device would."""
        ...


def smashed_frame(activations: torch.Tensor, labels: torch.Tensor) -> bytes:
    """Encode one batch of smashed data."""
    return encode_frame("smashed", {"activations": activations, "labels": labels})


class _AckCounter:
    """Counts frames sent and acknowledged; remembers the first refusal."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.sent = 0
        self.acked = 0
        self.refused = 0
        self.failure: str | None = None
        self.cond = threading.Condition()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            more = f" ({self.refused} frames refused)" if self.refused > 1 else ""
            raise TrunkRejected(self.failure + more)

    def record_reply(self, reply: bytes, max_bytes: int) -> None:
        try:
            frame = decode_frame(reply, max_bytes=max_bytes)
            reason = None
            if frame.kind == "error":
                reason = error_reason(frame)
            elif frame.kind != "ack":
                reason = f"unexpected reply of kind {frame.kind!r} to a 'smashed' frame"
        except FrameError as err:
            reason = f"undecodable reply: {err}"
        with self.cond:
            self.acked += 1
            if reason is not None:
                self.refused += 1
                self.failure = self.failure or reason
            self.cond.notify_all()

    def record_failure(self, reason: str) -> None:
        with self.cond:
            self.failure = self.failure or reason
            self.cond.notify_all()


class GrpcSmashedStream(GrpcTrunkSession):
    """One-way session over the trunk's gRPC stream: send now, collect acks later.

    Parameters
    ----------
    address : str
        ``host:port`` of the trunk service.
    token : str
        Session token for this client and round.
    max_frame_bytes : int
        Largest frame sent or received.
    window : int
        Most frames in flight (sent, not yet acknowledged); :meth:`send` blocks
        only when the trunk is this far behind.
    flush_timeout_s : float
        Longest :meth:`flush` waits for the outstanding acks.
    root_certificates : bytes, optional
        PEM root certificates; when given the channel uses TLS.
    """

    def __init__(
        self,
        address: str,
        token: str,
        *,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        window: int = DEFAULT_WINDOW,
        flush_timeout_s: float = 600.0,
        root_certificates: bytes | None = None,
    ) -> None:
        super().__init__(
            address, token, max_frame_bytes=max_frame_bytes, root_certificates=root_certificates
        )
        self.flush_timeout_s = flush_timeout_s
        self._acks = _AckCounter(window)
        self._closed = False
        self._reader = threading.Thread(target=self._read, name="smashed-acks", daemon=True)
        self._reader.start()

    @property
    def in_flight(self) -> int:
        """Frames sent but not yet acknowledged."""
        with self._acks.cond:
            return self._acks.sent - self._acks.acked

    def _read(self) -> None:
        try:
            for reply in self._responses:
                self.bytes_down += len(reply)
                self._acks.record_reply(reply, self.max_frame_bytes)
            reason = "trunk closed the stream"
        except grpc.RpcError as err:
            reason = f"{err.code().name}: {err.details()}"
        except Exception as err:  # noqa: BLE001 - the reader must always report, never die silently
            reason = f"ack reader failed: {err!r}"
        with self._acks.cond:
            if self._acks.acked < self._acks.sent or not self._closed:
                self._acks.record_failure(reason)

    def send(self, activations: torch.Tensor, labels: torch.Tensor) -> None:
        """Queue one batch on the stream; block only while ``window`` frames are unacked."""
        acks = self._acks
        with acks.cond:
            acks.raise_if_failed()
            acks.cond.wait_for(
                lambda: acks.sent - acks.acked < acks.window or acks.failure is not None
            )
            acks.raise_if_failed()
            acks.sent += 1
        data = smashed_frame(activations, labels)
        self.bytes_up += len(data)
        self._requests.put(data)

    def flush(self) -> None:
        """Wait until every frame sent is acknowledged; raise if any was refused."""
        acks = self._acks
        with acks.cond:
            done = acks.cond.wait_for(
                lambda: acks.acked >= acks.sent or acks.failure is not None,
                timeout=self.flush_timeout_s,
            )
            acks.raise_if_failed()
            if not done:
                raise TrunkRejected(
                    f"{acks.sent - acks.acked} smashed frames unacknowledged after "
                    f"{self.flush_timeout_s:g} s"
                )

    def exchange(self, activations: torch.Tensor, labels: torch.Tensor):  # noqa: ANN201
        """Not available: a one-way stream has no gradient to return."""
        raise TrunkRejected("a smashed-data stream is one way; open a GrpcTrunkSession")

    evaluate = exchange

    def close(self) -> None:
        """Half-close the stream and release the channel (idempotent, never waits)."""
        with self._acks.cond:
            if self._closed:
                return
            self._closed = True
        super().close()


class InProcessSmashedStream:
    """Same frames and checks as :class:`GrpcSmashedStream`, handled in this process.

    Parameters
    ----------
    handle : Callable[[bytes], bytes]
        The trunk side (e.g. ``lambda data: endpoint.handle(data, token)``).
    max_frame_bytes : int
        Largest reply accepted.
    """

    def __init__(
        self, handle: Callable[[bytes], bytes], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        self._handle = handle
        self.max_frame_bytes = max_frame_bytes
        self.bytes_up = 0
        self.bytes_down = 0
        self._acks = _AckCounter(window=1)

    def send(self, activations: torch.Tensor, labels: torch.Tensor) -> None:
        """Hand one batch to the trunk side (returns once it is queued there)."""
        self._acks.raise_if_failed()
        data = smashed_frame(activations, labels)
        self.bytes_up += len(data)
        self._acks.sent += 1
        reply = self._handle(data)
        self.bytes_down += len(reply)
        self._acks.record_reply(reply, self.max_frame_bytes)

    def flush(self) -> None:
        """Raise if any frame was refused."""
        self._acks.raise_if_failed()

    def close(self) -> None:
        """Nothing to release."""

    def abort(self) -> None:
        """Nothing to drop."""


class SmashedBuffer:
    """Keeps a round's smashed data for the Flower reply (bulk mode).

    ``bytes_up`` counts the tensor bytes the reply will carry (activations and
    labels); ``bytes_down`` stays 0, nothing comes back before the reply.
    """

    def __init__(self) -> None:
        self.bytes_up = 0
        self.bytes_down = 0
        self.activations: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def send(self, activations: torch.Tensor, labels: torch.Tensor) -> None:
        """Keep one batch (copied to the CPU, detached)."""
        acts = activations.detach().cpu().contiguous()
        labs = labels.detach().cpu().to(torch.int64)
        self.activations.append(acts)
        self.labels.append(labs)
        self.bytes_up += acts.numel() * acts.element_size() + labs.numel() * labs.element_size()

    def flush(self) -> None:
        """Nothing is in flight."""

    def close(self) -> None:
        """Nothing to release."""

    def abort(self) -> None:
        """Nothing to drop: the data leaves only with the reply."""

    @property
    def batch_sizes(self) -> list[int]:
        """Samples per kept batch, in the order they were trained."""
        return [len(labels) for labels in self.labels]

    def to_arrays(self) -> dict[str, torch.Tensor]:
        """Return the bulk payload: every kept batch, concatenated (see :func:`unpack_smashed`).

        Returns
        -------
        dict[str, torch.Tensor]
            ``activations`` (samples, *cut shape), ``labels`` (samples,) int64
            and ``batch-sizes`` (batches,) int64, in training order, so that the
            server can replay the client's batches as they were.
        """
        if not self.labels:
            raise ValueError("no smashed data: the client trained no batch")
        return {
            "activations": torch.cat(self.activations),
            "labels": torch.cat(self.labels),
            "batch-sizes": torch.tensor(self.batch_sizes, dtype=torch.int64),
        }


def unpack_smashed(
    arrays: Mapping[str, torch.Tensor],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Split a bulk payload back into its batches (structure only; values unchecked).

    Raises
    ------
    ValueError
        If a tensor is missing or the batch sizes do not add up to the samples.
    """
    missing = sorted({"activations", "labels", "batch-sizes"} - set(arrays))
    if missing:
        raise ValueError(f"smashed payload lacks {missing}")
    acts, labels, sizes = arrays["activations"], arrays["labels"], arrays["batch-sizes"]
    counts = [int(n) for n in sizes.reshape(-1).tolist()]
    if any(n <= 0 for n in counts) or sum(counts) != len(acts) or len(labels) != len(acts):
        raise ValueError(
            f"smashed payload: batch sizes sum to {sum(counts)} (all must be > 0) for "
            f"{len(acts)} activation rows and {len(labels)} labels"
        )
    return list(zip(acts.split(counts), labels.split(counts), strict=True))
