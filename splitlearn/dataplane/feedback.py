"""Per-example error feedback for lossy compression at the cut.

A tensor at the cut is one row per example, so what compression drops from a row can
only be made up on a later row of the *same* example: its next visit, in this round's
next epoch or in a later round. Both directions key their memory by the example's id
(its index in the device's data, the same every round), which the device sends with
each training batch (``Forward.example_ids``):

* **uplink** (activations; as in AQ-SGD, Wang et al. 2022): device and trunk each hold
  a reference per example, zero until the example is first sent. The device sends the
  compressed difference between the row and its reference; both sides add the decoded
  difference to the reference, and the trunk trains on that sum. What compression
  dropped stays in the next difference, so the error does not accumulate, and as the
  model settles the differences shrink.
* **downlink** (the gradient at the cut; error feedback as in EF-SGD): the trunk adds
  what compression dropped from the example's previous gradient to this one before
  compressing it, and keeps what it drops now. The device's weights get the dropped
  part one visit later instead of never.

U-shaped sessions (:mod:`server.sessions.ushaped`) also send the trunk's features as
differences from references that both sides keep (the uplink rule, the other way).
Local-loss sessions (:mod:`server.sessions.local_loss`) use the uplink rule alone, with the
references moving as a frame is sent and as it is queued, ahead of its ack.

Both sides decode the same bytes with the same code, so their references agree bit
for bit; a version (the batches the references absorbed since they were zero) and a
lineage (a random number the device draws each time it starts them from zero) tell
when they do not (a round the device did not finish), and the device then starts both
over from zero. The device keeps its references across rounds in its Flower context;
the trunk keeps every client's in a :class:`FeedbackBook`, within one memory budget.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from splitlearn.config import CompressionConfig

#: Turns a tensor into what the receiver will decode (encode, then decode the frame).
RoundTrip = Callable[[Tensor], tuple[object, Tensor]]


class FeedbackFull(ValueError):
    """The rows of a client's examples would exceed the memory bound."""


class StaleFeedback(ValueError):
    """A batch was encoded against references the trunk does not hold."""


class ExampleRows:
    """One float32 row per example id, zero for an id not stored yet.

    Parameters
    ----------
    max_bytes : int
        Most bytes the rows may take; storing more raises :class:`FeedbackFull`.
    """

    def __init__(self, *, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._slots: dict[int, int] = {}
        self._rows = torch.zeros(0)

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        """Bytes the stored rows take (allocated capacity included)."""
        return self._rows.numel() * self._rows.element_size()

    def holds(self, row_shape: tuple[int, ...]) -> bool:
        """Whether rows of ``row_shape`` may be stored (none are yet, or theirs is the same)."""
        return not self._slots or tuple(self._rows.shape[1:]) == tuple(row_shape)

    def rows(self, ids: Tensor, row_shape: tuple[int, ...]) -> Tensor:
        """Return a copy of the rows of ``ids``, zeros for ids not stored.

        Raises
        ------
        FeedbackFull
            If the rows were stored with another shape.
        """
        self._check_shape(row_shape)
        slots = [self._slots.get(i, -1) for i in ids.tolist()]
        out = torch.zeros(len(slots), *row_shape)
        known = [n for n, s in enumerate(slots) if s >= 0]
        if known:
            out[known] = self._rows[[slots[n] for n in known]]
        return out

    def admit(self, ids: Tensor, row_shape: tuple[int, ...]) -> None:
        """Make room for ``ids`` (a new row is zero, as before), so that storing them cannot fail.

        Raises
        ------
        FeedbackFull
            If the rows would take more than ``max_bytes``, or have another shape than the
            rows already stored (nothing changes then).
        """
        self._check_shape(row_shape)
        new = [i for i in dict.fromkeys(ids.tolist()) if i not in self._slots]
        row_bytes = 4 * max(1, torch.Size(row_shape).numel())
        count = len(self._slots) + len(new)
        if count * row_bytes > self.max_bytes:
            raise FeedbackFull(f"{count} examples of {row_bytes} bytes exceed the bound of "
                               f"{self.max_bytes} bytes (dataplane.compression.feedback_max_mib)")
        if not len(self._slots):
            self._rows = torch.zeros(0, *row_shape)
        if count > len(self._rows):
            capacity = min(max(count, 2 * len(self._rows)), self.max_bytes // row_bytes)
            grown = torch.zeros(capacity, *row_shape)
            grown[: len(self._rows)] = self._rows
            self._rows = grown
        for key in new:
            self._slots[key] = len(self._slots)

    def _check_shape(self, row_shape: tuple[int, ...]) -> None:
        if not self.holds(row_shape):
            raise FeedbackFull(f"rows of shape {tuple(row_shape)} against the stored "
                               f"{tuple(self._rows.shape[1:])}")

    def state(self) -> dict[str, Tensor]:
        """Return the stored ids and their rows (for keeping them between rounds)."""
        return {"ids": torch.tensor(list(self._slots), dtype=torch.int64),
                "rows": self._rows[: len(self._slots)].clone()}

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Replace the rows by those of :meth:`state` (raises :class:`FeedbackFull`)."""
        self._slots, self._rows = {}, torch.zeros(0)
        if len(state["ids"]):
            self.store(state["ids"], state["rows"])

    def store(self, ids: Tensor, values: Tensor) -> None:
        """Set the rows of ``ids`` (distinct) to ``values``, making room first (:meth:`admit`)."""
        self.admit(ids, tuple(values.shape[1:]))
        self._rows[[self._slots[i] for i in ids.tolist()]] = values.float()


class ReferenceFeedback:
    """Rows sent as compressed differences from per-example references both sides keep.

    The activations a device sends; U-shaped, also the features the trunk sends.

    Parameters
    ----------
    max_bytes : int
        Bound on the references' memory.
    lineage : int, optional
        Names this start from zero (the trunk's: the one its device sent); a device's
        draws a random one, so that two starts never pass for each other.
    """

    def __init__(self, *, max_bytes: int, lineage: int | None = None) -> None:
        self.references = ExampleRows(max_bytes=max_bytes)
        #: Batches the references absorbed since they were zero (0: none).
        self.version = 0
        self.lineage = secrets.randbits(63) if lineage is None else lineage

    def encode(self, ids: Tensor, activations: Tensor, round_trip: RoundTrip
               ) -> tuple[object, Tensor]:
        """Return the frame the device sends and the activations both sides then agree on.

        The frame encodes each row minus its reference (``round_trip`` encodes it and
        decodes the frame, as the trunk will); the agreed rows are reference + that
        decoding, what the trunk's :meth:`reconstruct` gives.
        """
        reference = self.references.rows(ids, tuple(activations.shape[1:]))
        frame, sent = round_trip(activations - reference)
        return frame, reference + sent

    def reconstruct(self, ids: Tensor, received: Tensor) -> Tensor:
        """Return the activations both sides agree on: reference + the decoded difference."""
        return self.references.rows(ids, tuple(received.shape[1:])) + received

    def commit(self, ids: Tensor, activations: Tensor) -> None:
        """Make ``activations`` (from :meth:`reconstruct`) the references, once the step is done."""
        self.references.store(ids, activations)
        self.version += 1

    def state(self) -> dict[str, Tensor]:
        """Return the references, their version and lineage (for the device's Flower context)."""
        return {**self.references.state(), "version": torch.tensor(self.version),
                "lineage": torch.tensor(self.lineage)}

    def load(self, state: Mapping[str, Tensor]) -> None:
        """Take the references, version and lineage of :meth:`state` (or :class:`FeedbackFull`)."""
        self.references.load(state)
        self.version, self.lineage = int(state["version"]), int(state["lineage"])

    @classmethod
    def from_state(cls, state: Mapping[str, Tensor], *, max_bytes: int) -> ReferenceFeedback:
        """Rebuild what :meth:`state` returned; from zero if it no longer fits ``max_bytes``."""
        feedback = cls(max_bytes=max_bytes)
        try:
            feedback.load(state)
        except (FeedbackFull, KeyError):  # a smaller bound, or kept without a lineage: start over
            return cls(max_bytes=max_bytes)
        return feedback


class ResidualFeedback:
    """Gradients compressed with what their example's previous compression dropped.

    The gradient at the cut the trunk sends (kept by the trunk alone).

    Parameters
    ----------
    max_bytes : int
        Bound on the residuals' memory.
    """

    def __init__(self, *, max_bytes: int) -> None:
        self.residuals = ExampleRows(max_bytes=max_bytes)

    def compress(self, ids: Tensor, grad: Tensor, round_trip: RoundTrip) -> object:
        """Return the frame of ``grad`` plus the residuals; keep what it drops.

        ``round_trip`` encodes a tensor and returns the frame and its decoding.
        """
        corrected = grad.float() + self.residuals.rows(ids, tuple(grad.shape[1:]))
        frame, sent = round_trip(corrected)
        self.residuals.store(ids, corrected - sent)
        return frame

    def state(self) -> dict[str, Tensor]:
        """Return the residuals (to move them to another trunk)."""
        return self.residuals.state()


class ClientFeedback:
    """One client's error feedback on the trunk.

    ``uplink``: references of the activations it receives; ``downlink``: residuals of the
    gradients at the cut it sends; ``features`` (U-shaped): references of the features it
    sends. ``max_bytes`` bounds them together (each gets an equal share). The references
    absorb each batch together, so their versions agree.
    """

    def __init__(self, *, uplink: bool, downlink: bool, max_bytes: int,
                 features: bool = False, lineage: int = 0) -> None:
        share = max_bytes // max(1, uplink + downlink + features)
        self.uplink = ReferenceFeedback(max_bytes=share, lineage=lineage) if uplink else None
        self.downlink = ResidualFeedback(max_bytes=share) if downlink else None
        self.features = ReferenceFeedback(max_bytes=share, lineage=lineage) if features else None

    @property
    def nbytes(self) -> int:
        """Bytes its rows take."""
        return sum(store.nbytes for store, _ in self._stores())

    @property
    def version(self) -> int | None:
        """Batches its references absorbed since they were zero (None: it keeps none)."""
        references = self.uplink or self.features
        return None if references is None else references.version

    @property
    def lineage(self) -> int | None:
        """The start from zero its references come from (None: it keeps none)."""
        references = self.uplink or self.features
        return None if references is None else references.lineage

    def holds(self, row_shape: tuple[int, ...], feature_shape: tuple[int, ...] | None = None
              ) -> bool:
        """Whether its rows are of these shapes (at the cut; features'), or none are stored."""
        return all(store.holds(feature_shape if at_features else row_shape)
                   for store, at_features in self._stores())

    def admit(self, ids: Tensor, row_shape: tuple[int, ...],
              feature_shape: tuple[int, ...] | None = None) -> None:
        """Make room for ``ids`` in every store (raises :class:`FeedbackFull`)."""
        for store, at_features in self._stores():
            store.admit(ids, feature_shape if at_features else row_shape)  # type: ignore[arg-type]

    def _stores(self) -> list[tuple[ExampleRows, bool]]:
        """Each store and whether its rows are features (else rows at the cut)."""
        return ([(self.uplink.references, False)] if self.uplink else []) + (
            [(self.downlink.residuals, False)] if self.downlink else []) + (
            [(self.features.references, True)] if self.features else [])

    def state(self) -> dict[str, dict[str, Tensor]]:
        """Return each store's rows (and the references' version), to move them elsewhere."""
        stores = {"uplink": self.uplink, "downlink": self.downlink, "features": self.features}
        return {name: store.state() for name, store in stores.items() if store is not None}

    @classmethod
    def from_state(cls, state: Mapping[str, Mapping[str, Tensor]], *, uplink: bool,
                   downlink: bool, max_bytes: int, features: bool = False) -> ClientFeedback:
        """Rebuild what :meth:`state` returned (raises :class:`FeedbackFull` past the bound)."""
        memory = cls(uplink=uplink, downlink=downlink, max_bytes=max_bytes, features=features)
        for references, name in ((memory.uplink, "uplink"), (memory.features, "features")):
            if references is not None:
                references.load(state[name])
        if memory.downlink is not None:
            memory.downlink.residuals.load(state["downlink"])
        return memory


class FeedbackBook:
    """Every client's error feedback on the trunk, across rounds, within one memory budget.

    When the clients' rows outgrow ``max_bytes``, clients' rows are dropped, the least
    recently served first, among those holding more than an equal share of the budget
    (``max_bytes`` over the clients held). So a client within its share is never dropped
    to make room for another, and one that sends many distinct ids can only push out its
    own rows. A dropped client starts over from zero: told so in the reply if it was the
    one served (:meth:`keep`), else by a stale refusal of its next batch.

    Parameters
    ----------
    uplink, downlink : bool
        Which directions feed back (:attr:`CompressionConfig.uplink_feedback`, ...).
    max_bytes : int
        Bound on all clients' rows together.
    features : bool
        U-shaped sessions with a lossy downlink: the features sent are references too.
    """

    def __init__(self, *, uplink: bool, downlink: bool, max_bytes: int,
                 features: bool = False) -> None:
        self.uplink, self.downlink, self.max_bytes = uplink, downlink, max_bytes
        self.features = features
        self._clients: OrderedDict[str, ClientFeedback] = OrderedDict()
        self._sizes: dict[str, int] = {}  # each kept client's bytes, as of its last keep
        self._bytes = 0  # their sum
        self._lock = threading.Lock()

    @classmethod
    def for_compression(cls, compression: CompressionConfig, *, features: bool = False,
                        gradient: bool = True) -> FeedbackBook | None:
        """Return the book a trunk keeps under ``compression`` (None: nothing to feed back).

        ``features``: U-shaped sessions, whose features (sent down) are references too.
        ``gradient``: whether the trunk sends a gradient at the cut (local loss: none, so
        only the activations' references are kept).
        """
        downlink = gradient and compression.downlink_feedback
        if not (compression.error_feedback and (compression.uplink_feedback or downlink)):
            return None
        return cls(uplink=compression.uplink_feedback, downlink=downlink,
                   features=features and compression.downlink_feedback,
                   max_bytes=compression.feedback_max_bytes)

    def __contains__(self, client: str) -> bool:
        return client in self._clients

    def __getitem__(self, client: str) -> ClientFeedback:
        return self._clients[client]

    @property
    def nbytes(self) -> int:
        """Bytes all clients' rows take (as of each one's last batch)."""
        return self._bytes

    def prepare(self, client: str, ids: Tensor, row_shape: tuple[int, ...], *, version: int,
                lineage: int = 0, feature_shape: tuple[int, ...] | None = None
                ) -> ClientFeedback:
        """Return ``client``'s feedback for a batch, with room for its ``ids``.

        Version 0 (with references) starts the client from zero, in ``lineage``, as
        does a batch at another cut than the kept rows'; any other version must come with
        the version and lineage the references hold. The fresh memory replaces the old
        one only at :meth:`keep`, so a refused batch changes nothing, except a stale one:
        that drops the client's memory. A device behind the trunk (it lost a round's
        references) may have more frames in flight (local loss sends without waiting),
        and one of them could carry the trunk's version by chance; dropped, none can until
        the device starts over from version 0. ``feature_shape``: a row of the features a
        U-shaped trunk sends.

        Raises
        ------
        StaleFeedback
            If the batch's version or lineage is not the references' (with references).
        FeedbackFull
            If this client's rows alone would exceed the budget.
        """
        with self._lock:
            memory = self._clients.get(client)
        references = self.uplink or self.features
        if (memory is None or (references and version == 0)
                or not memory.holds(row_shape, feature_shape)):
            memory = ClientFeedback(uplink=self.uplink, downlink=self.downlink,
                                    max_bytes=self.max_bytes, features=self.features,
                                    lineage=lineage)
        if memory.version is not None and (memory.version, memory.lineage) != (version, lineage):
            with self._lock:
                if self._clients.get(client) is memory:
                    self._drop(client)
            raise StaleFeedback(f"this batch was encoded against version {version} of client "
                                f"{client}'s references (lineage {lineage}); the trunk holds "
                                f"version {memory.version} (lineage {memory.lineage}): send it "
                                "again from version 0")
        memory.admit(ids, row_shape, feature_shape)
        return memory

    def keep(self, client: str, memory: ClientFeedback) -> bool:
        """Hold ``memory`` as ``client``'s (after its batch was applied); evict to the budget.

        Returns whether ``client``'s own memory was dropped (it held more than its share,
        and no less recently served client did): its device should start over from zero.
        """
        with self._lock:
            self._clients[client] = memory
            self._clients.move_to_end(client)
            size = memory.nbytes
            self._bytes += size - self._sizes.get(client, 0)
            self._sizes[client] = size
            while self._bytes > self.max_bytes:
                self._drop(self._over_share())
            return client not in self._clients

    def release(self, client: str) -> dict[str, dict[str, Tensor]] | None:
        """Stop holding ``client``'s memory and return its :meth:`ClientFeedback.state`.

        None if none is held. For another trunk that will serve the client (:meth:`adopt`).
        """
        with self._lock:
            if client not in self._clients:
                return None
            memory = self._clients[client]
            self._drop(client)
        return memory.state()

    def adopt(self, client: str, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Hold the memory another trunk released (:meth:`release`), as if it had served it."""
        memory = ClientFeedback.from_state(state, uplink=self.uplink, downlink=self.downlink,
                                           max_bytes=self.max_bytes, features=self.features)
        self.keep(client, memory)

    def _over_share(self) -> str:
        """Return the least recently served client holding more than an equal share.

        One exists while the book is over budget: were every client within its share,
        together they would be within the budget.
        """
        share = self.max_bytes / len(self._clients)
        return next(c for c in self._clients if self._sizes[c] > share)

    def _drop(self, client: str) -> None:
        del self._clients[client]
        self._bytes -= self._sizes.pop(client)
