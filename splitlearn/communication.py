"""Closed-form bytes per training sample, one form per shape of traffic (pure Python).

What a protocol moves per training sample, on the data plane (smashed data up,
gradients down, labels) and in the Flower messages (weights down and up once a
round per client), from the model's sizes and the data per client. With ``n``
samples per client, ``e`` local epochs, ``q`` encoded bytes of one example's
activation at the cut (``g`` of its gradient), ``W`` the whole model's weight
bytes and ``W_c`` the client side's:

* :func:`whole_model_bytes` (FedAvg): ``2 W / (n e)``;
* :func:`split_bytes`: ``q + 8 + g + 2 W_c / (n e)`` (8: the int64 label);
* :func:`split_with_tail_bytes`: ``q + g + f_up + f_down + 2 W_c / (n e)`` (``f``: the
  features at the tail cut, down, and their gradient, up);
* :func:`upload_only_bytes`: ``q + 8 + 2 W_c / (n e)`` (nothing comes back per batch).

Each protocol's registry entry names its form (``Capabilities.bytes_per_sample``).

For ``int8`` these are upper bounds: ReLU's zeros at the cut cost a bit, not a
byte (:func:`encoded_row_bytes`' ``zero_fraction``). Per-batch framing (a few
dozen bytes of protobuf per frame) is left out: under 1% of a batch of 32 rows
of 64 values or more. Weight bytes include Flower's 128-byte header per array.
Hence FedAvg moves fewer bytes than split learning once
``n e > 2 (W - W_c) / (q + g + 8)``: split learning wins with big models and
little data per device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

#: Bytes of one example's label on the data plane (int64).
LABEL_BYTES = 8
#: Bytes of the ``.npy`` header Flower's ``Array`` carries before a tensor's values.
ARRAY_HEADER_BYTES = 128
#: Entries a row may have for top-k positions to be 16-bit (see trunk.proto).
UINT16_ROW_LIMIT = 1 << 16


def kept_per_row(row_length: int, fraction: float) -> int:
    """Entries top-k keeps of a row: ``ceil(fraction * row_length)``, at least 1."""
    return max(1, min(row_length, math.ceil(fraction * row_length)))


def encoded_row_bytes(entries: int, method: str = "none", *, topk_fraction: float = 0.1,
                      zero_fraction: float = 0.0) -> int:
    """Bytes one example's float tensor of ``entries`` values takes on the wire.

    ``none`` 4 per value; ``float16``/``bfloat16`` 2; ``int8`` 1 plus a float32
    scale, or, when ``zero_fraction`` of the quantised values are 0 and that
    pays, a bit per value plus a byte per non-zero one (the encoder decides per
    tensor, this per row); ``topk`` 2 (bfloat16) plus 2 or 4 (position) per
    kept value.
    """
    if method == "none":
        return 4 * entries
    if method in ("float16", "bfloat16"):
        return 2 * entries
    if method == "int8":
        masked = math.ceil(entries / 8) + math.ceil((1 - zero_fraction) * entries)
        return min(entries, masked) + 4
    if method == "topk":
        return kept_per_row(entries, topk_fraction) * (2 + (2 if entries <= UINT16_ROW_LIMIT
                                                              else 4))
    raise ValueError(f"unknown compression {method!r}")


@dataclass(frozen=True)
class Sizes:
    """What the closed forms need of a model at a cut.

    Parameters
    ----------
    cut_entries : int
        Values of one example's activation at the cut.
    client_param_bytes, model_param_bytes : int
        Weight bytes of the client's stages and of the whole model.
    tail_entries : int
        U-shaped only: values of one example's features at the tail cut.
    client_arrays, model_arrays : int
        Tensors in those states: Flower ships each with a header of
        :data:`ARRAY_HEADER_BYTES` (NumPy's ``.npy`` format).
    """

    cut_entries: int
    client_param_bytes: int
    model_param_bytes: int
    tail_entries: int = 0
    client_arrays: int = 0
    model_arrays: int = 0

    @property
    def client_shipped_bytes(self) -> int:
        """Bytes of the client's state in one Flower message, headers included."""
        return self.client_param_bytes + ARRAY_HEADER_BYTES * self.client_arrays

    @property
    def model_shipped_bytes(self) -> int:
        """Bytes of the whole model's state in one Flower message, headers included."""
        return self.model_param_bytes + ARRAY_HEADER_BYTES * self.model_arrays


#: Encoded bytes of one example's tensor of ``entries`` values sent ``"up"`` or ``"down"``.
RowBytes = Callable[[int, str], int]
#: A protocol's closed form (its registry entry names one): (sizes, row bytes) ->
#: (data-plane bytes per sample, bytes of the state one Flower message carries).
ClosedForm = Callable[[Sizes, RowBytes], tuple[int, int]]


def whole_model_bytes(sizes: Sizes, row: RowBytes) -> tuple[int, int]:
    """FedAvg's form: no data plane; the whole model travels each way once a round."""
    return 0, sizes.model_shipped_bytes


def split_bytes(sizes: Sizes, row: RowBytes) -> tuple[int, int]:
    """Activations and labels up, the gradient at the cut down; the device side travels."""
    cut = sizes.cut_entries
    return row(cut, "up") + LABEL_BYTES + row(cut, "down"), sizes.client_shipped_bytes


def split_with_tail_bytes(sizes: Sizes, row: RowBytes) -> tuple[int, int]:
    """As :func:`split_bytes` without labels; the tail's features down, their gradient up."""
    cut, tail = sizes.cut_entries, sizes.tail_entries
    data = row(cut, "up") + row(cut, "down") + row(tail, "down") + row(tail, "up")
    return data, sizes.client_shipped_bytes


def upload_only_bytes(sizes: Sizes, row: RowBytes) -> tuple[int, int]:
    """Activations and labels up, nothing down per batch; the device side travels."""
    return row(sizes.cut_entries, "up") + LABEL_BYTES, sizes.client_shipped_bytes


def bytes_per_sample(closed_form: ClosedForm, sizes: Sizes, *, samples_per_client: float,
                     local_epochs: int = 1, uplink: str = "none", downlink: str = "none",
                     topk_fraction: float = 0.1) -> dict[str, float]:
    """Bytes per training sample (an example seen once), by plane.

    Parameters
    ----------
    closed_form : ClosedForm
        The protocol's (its registry entry's ``bytes_per_sample``).
    sizes : Sizes
        The model's sizes at the cut.
    samples_per_client : float
        Training examples per device.
    local_epochs : int, optional
        Passes over them per round.
    uplink, downlink : str, optional
        Compression per direction (:data:`splitlearn.config.COMPRESSION_METHODS`).
    topk_fraction : float, optional
        Share of a row top-k keeps.

    Returns
    -------
    dict[str, float]
        ``data_plane``, ``weights`` and their ``total``.

    Raises
    ------
    ValueError
        For an unknown compression, or no training samples.
    """
    seen = samples_per_client * local_epochs
    if not seen > 0:
        raise ValueError(f"need training samples, got {samples_per_client} x {local_epochs}")
    methods = {"up": uplink, "down": downlink}

    def row(entries: int, direction: str) -> int:
        return encoded_row_bytes(entries, methods[direction], topk_fraction=topk_fraction)

    data, shipped = closed_form(sizes, row)
    weights = 2 * shipped / seen
    return {"data_plane": float(data), "weights": weights, "total": data + weights}


def fedavg_break_even(sizes: Sizes, *, uplink: str = "none", downlink: str = "none") -> float:
    """Return the samples per client and round (``n e``) above which FedAvg moves fewer bytes.

    Against SplitFed at the same cut, from the closed forms above.
    """
    per_sample = (encoded_row_bytes(sizes.cut_entries, uplink) + LABEL_BYTES
                  + encoded_row_bytes(sizes.cut_entries, downlink))
    return 2 * (sizes.model_shipped_bytes - sizes.client_shipped_bytes) / per_sample
