"""Row-wise compression of the tensors at the cut: int8 quantisation and top-k sparsity.

Pure tensor maths; :mod:`splitlearn.dataplane.codec` puts the results on the
wire (``trunk.proto``'s ``Tensor``: ``scales``, ``row_nnz``, ``indices``).

Every row, i.e. every example, is encoded from its own values only. A scale or
a threshold taken over the whole batch would make one example's release depend
on the others (as batch norm does), which the per-example privacy accounting
of activation noise does not allow; per row, compression is post-processing of
each released row and the privacy guarantee is unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from splitlearn.communication import kept_per_row

#: The int8 range used: symmetric, so that zero is exact and -x encodes as -q.
INT8_LEVELS = 127
#: The largest magnitude float16 holds; float16 encoding saturates beyond it.
FLOAT16_MAX = float(torch.finfo(torch.float16).max)


def as_rows(tensor: Tensor) -> Tensor:
    """View ``tensor`` (batch first) as ``(rows, entries per row)``."""
    return tensor.reshape(tensor.shape[0], -1)


def quantize_rows(tensor: Tensor) -> tuple[Tensor, Tensor]:
    """Quantise each row to int8 with its own scale.

    Returns
    -------
    tuple[Tensor, Tensor]
        ``(q, scales)``: int8 values shaped like ``tensor`` and one float32
        scale per row, ``max |row| / 127``, so that ``q * scale`` is within
        ``scale / 2`` of every entry. A row of zeros has scale 0; a row holding
        NaN or infinity gets a NaN or infinite scale (which the decoder refuses).
    """
    rows = as_rows(tensor).float()
    scales = rows.abs().amax(dim=1) / INT8_LEVELS
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / divisor[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS)
    return q.to(torch.int8).reshape(tensor.shape), scales


def nonzero_mask(q: Tensor) -> tuple[bytes, Tensor] | None:
    """Pack which entries of each row are non-zero, if that saves bytes over sending zeros.

    Returns
    -------
    tuple[bytes, Tensor] | None
        The mask (one bit per entry, least significant first, each row padded to a
        byte) and the non-zero values in row-major order; None when the zeros are
        too few to pay for the mask (one bit per entry against one byte per zero).
    """
    rows = as_rows(q)
    nonzero = rows != 0
    zeros = rows.numel() - int(nonzero.sum())
    if zeros * q.element_size() <= rows.shape[0] * math.ceil(rows.shape[1] / 8):
        return None
    mask = np.packbits(nonzero.numpy(), axis=1, bitorder="little")
    return mask.tobytes(), rows[nonzero]


def unpack_mask(mask: bytes, rows: int, row_length: int) -> np.ndarray:
    """Invert :func:`nonzero_mask`'s packing: a boolean ``(rows, row_length)`` array.

    Raises
    ------
    ValueError
        If a padding bit is set.
    """
    padded = np.unpackbits(np.frombuffer(mask, dtype=np.uint8).reshape(rows, -1), axis=1,
                           bitorder="little").astype(bool)
    if padded[:, row_length:].any():
        raise ValueError("padding bits of the mask are set")
    return padded[:, :row_length]


def top_k_rows(tensor: Tensor, fraction: float) -> tuple[Tensor, Tensor]:
    """Keep each row's largest entries by magnitude.

    Returns
    -------
    tuple[Tensor, Tensor]
        ``(indices, values)``, both ``(rows, k)``: positions within the row
        (int64) and the entries there, ``k = kept_per_row(...)``. NaN counts as
        the largest magnitude, so a NaN is always kept (and then refused).
    """
    rows = as_rows(tensor)
    k = kept_per_row(rows.shape[1], fraction)
    indices = torch.topk(rows.abs(), k, dim=1, sorted=False).indices
    return indices, rows.gather(1, indices)


def scatter_rows(indices: Tensor, values: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Rebuild a dense float32 tensor of ``shape`` from :func:`top_k_rows`' output."""
    rows = torch.zeros(shape[0], math.prod(shape[1:]), dtype=torch.float32)
    rows.scatter_(1, indices, values.float())
    return rows.reshape(shape)
