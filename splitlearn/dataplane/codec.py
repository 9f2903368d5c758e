"""Tensors and requests on the wire, and the rules every frame must pass.

The wire contract is ``trunk.proto`` (compiled to :mod:`trunk_pb2`); requests and
replies travel as :class:`~splitlearn.dataplane.frames.Frame` objects, whose tensor
bytes are never copied through protobuf (the encoding is protobuf's). Decoding is
defensive: the size is checked before parsing, every dtype, shape and byte count
before a tensor is allocated, and every value before a model sees it. Whatever goes
wrong while decoding becomes a :class:`FrameError` carrying one of the proto's
refusal reasons, so the server answers with a ``Refusal`` and never crashes a stream.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np
import torch
from google.protobuf.message import Message as _Message

from splitlearn.communication import UINT16_ROW_LIMIT
from splitlearn.config import COMPRESSION_METHODS, CompressionConfig
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.compression import (
    FLOAT16_MAX,
    as_rows,
    nonzero_mask,
    quantize_rows,
    scatter_rows,
    top_k_rows,
    unpack_mask,
)
from splitlearn.dataplane.frames import (
    SMALL_FRAME_BYTES,
    Frame,
    FrameDecodeError,
    flat_bytes,
    holds_buffers,
    read,
)

Reason = pb.Refusal.Reason
_M = TypeVar("_M", bound=_Message)
#: A tensor as it arrives: a frame's (views of the received bytes) or a generated message.
TensorMessage = Frame | pb.Tensor
#: A request or reply as a session handler sees it (a frame, or a test's generated message).
AnyRequest = Frame | pb.Request
AnyReply = Frame | pb.Reply

#: Wire dtypes and their torch counterparts; nothing else is accepted.
DTYPES: dict[int, torch.dtype] = {
    pb.FLOAT32: torch.float32,
    pb.FLOAT16: torch.float16,
    pb.BFLOAT16: torch.bfloat16,
    pb.INT64: torch.int64,
    pb.INT8: torch.int8,  # quantised floats only, with their scales
}
#: What a dense tensor may be sent as (int8 only comes from quantisation).
_WIRE_DTYPES = {v: k for k, v in DTYPES.items() if k != pb.INT8}
#: NumPy's counterparts of the wire dtypes that NumPy has (bfloat16 travels as int16).
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16,
                 torch.int64: np.int64, torch.int8: np.int8}
#: More dimensions than any activation here needs; bounds the work a header can ask for.
MAX_DIMS = 8


class FrameError(ValueError):
    """A frame broke the data-plane contract; ``reason`` is the proto's refusal code.

    Parameters
    ----------
    reason : int
        A ``Refusal.Reason`` value.
    detail : str
        What was wrong, naming the offending value and what is accepted.
    """

    def __init__(self, reason: int, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason

    @property
    def reason_name(self) -> str:
        """The reason's name in the proto (e.g. ``"BAD_TENSOR"``)."""
        return Reason.Name(self.reason)


def build(cls: type[_M], **fields: object) -> _M | Frame:
    """Build a message: a :class:`Frame` where it carries bytes (requests, replies, tensors).

    Other messages are generated ones, where a dict fills a nested message in
    place and a message is copied in (the generated constructor copies nested
    messages about 20x slower than ``CopyFrom``).
    """
    if holds_buffers(cls.DESCRIPTOR):
        return Frame(cls, **fields)
    message = cls()
    _fill(message, fields)
    return message


def _parts(message: type[_Message]) -> dict[str, type[_Message]]:
    return {f.name: getattr(pb, f.message_type.name)
            for f in message.DESCRIPTOR.oneofs_by_name["kind"].fields}


_REQUEST_PARTS = _parts(pb.Request)
_REPLY_PARTS = _parts(pb.Reply)


def request(seq: int, kind: str, **fields: Frame | int) -> AnyRequest:
    """Build the request ``kind`` (``forward``, ...) carrying tensor frames (hot path).

    The encoder made the tensors, so no field is checked again (nor the scalars: in
    range for their fields); use :func:`build` for anything else. A small request is a
    generated message (see :func:`_small`).
    """
    if _small(v for v in fields.values() if isinstance(v, Frame)):
        return pb.Request(seq=seq, **{kind: _plain(fields)})
    return Frame.unchecked(pb.Request, seq=seq,
                           **{kind: Frame.unchecked(_REQUEST_PARTS[kind], **fields)})


def reply(kind: str, **fields: object) -> AnyReply:
    """Build the reply ``kind`` (``gradient``, ...) from tensor frames and plain values."""
    part = _REPLY_PARTS[kind]
    tensors = [v for v in fields.values() if isinstance(v, Frame)]
    if not holds_buffers(part.DESCRIPTOR) or _small(tensors):
        return pb.Reply(**{kind: _plain(fields)})
    return Frame.unchecked(pb.Reply, **{kind: Frame.unchecked(part, **fields)})


def _plain(fields: dict[str, object]) -> dict[str, object]:
    """Fields for a generated constructor: each tensor frame as a dict, copied in once."""
    return {k: v.as_fields() if isinstance(v, Frame) else v for k, v in fields.items()}


def _small(tensors: Iterable[Frame]) -> bool:
    """Whether a message of these tensors is below the size where frames pay.

    Writing a small message through protobuf's generated classes costs less
    (a 32 KiB request: 13 us against 35 us) than their copies save.
    """
    return sum(t.buffer_bytes for t in tensors) < SMALL_FRAME_BYTES


def _fill(message: _Message, fields: dict[str, object]) -> None:
    for name, value in fields.items():
        if isinstance(value, dict):
            _fill(getattr(message, name), value)
        elif isinstance(value, _Message):
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)


def encode_tensor(tensor: torch.Tensor, method: str = "none", *, topk_fraction: float = 0.1
                  ) -> Frame:
    """Return the wire form of ``tensor`` (detached, on the CPU, contiguous).

    The frame refers to the tensor's memory (or to its compressed form's) until it
    is written; ``.to_proto()`` gives the generated ``pb.Tensor``. ``method`` (see
    :class:`~splitlearn.config.CompressionConfig`) applies to float tensors with a
    batch dimension and at least one entry per row; any other tensor (labels,
    scalars, empty batches) is sent as it is.
    """
    t = tensor.detach().cpu().contiguous()
    if method == "none" or not t.is_floating_point() or t.dim() == 0 or not t[:1].numel():
        return _dense(t)
    if method == "float16":  # saturate rather than turn large activations into inf
        return _dense(t.float().clamp(-FLOAT16_MAX, FLOAT16_MAX).half())
    if method == "bfloat16":
        return _dense(t.bfloat16())
    if method == "int8":
        q, scales = quantize_rows(t)
        if (masked := nonzero_mask(q)) is not None:  # ReLU's zeros cost a bit, not a byte
            mask, values = masked
            return _tensor(pb.INT8, t.shape, data=values.numpy(), scales=scales.numpy(),
                           mask=mask)
        return _tensor(pb.INT8, t.shape, data=q.numpy(), scales=scales.numpy())
    if method == "topk":
        indices, values = top_k_rows(t, topk_fraction)
        width = np.uint16 if as_rows(t).shape[1] <= UINT16_ROW_LIMIT else np.uint32
        return _tensor(pb.BFLOAT16, t.shape, row_nnz=indices.shape[1],
                       data=values.bfloat16().view(torch.int16).contiguous().numpy(),
                       indices=indices.numpy().astype(width))
    raise ValueError(f"unknown compression {method!r}; expected one of {COMPRESSION_METHODS}")


def _dense(t: torch.Tensor) -> Frame:
    if t.dtype not in _WIRE_DTYPES:
        raise ValueError(f"dtype {t.dtype} cannot be sent; accepted: {list(_WIRE_DTYPES)}")
    # bfloat16 has no numpy dtype: ship its raw 16-bit patterns.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return _tensor(_WIRE_DTYPES[t.dtype], t.shape, data=raw.numpy())


def _tensor(dtype: int, shape: Sequence[int], *, row_nnz: int = 0, **buffers: object) -> Frame:
    """Build a tensor frame whose byte fields are the arrays' memory (no copy).

    Nothing is checked again: the encoder made every value.
    """
    fields = {name: flat_bytes(b) for name, b in buffers.items()}  # type: ignore[arg-type]
    if row_nnz:
        fields["row_nnz"] = int(row_nnz)
    return Frame.unchecked(pb.Tensor, dtype=dtype, shape=tuple(shape), **fields)


def encoder(compression: CompressionConfig, direction: str):  # noqa: ANN201 - a partial
    """Return ``encode_tensor`` with the method for ``direction`` ("uplink" or "downlink")."""
    return functools.partial(encode_tensor, method=getattr(compression, direction),
                             topk_fraction=compression.topk_fraction)


def decode_tensor(msg: TensorMessage, *, name: str, max_bytes: int) -> torch.Tensor:
    """Check a wire tensor's header against its bytes and return it as a tensor it owns.

    Compressed tensors (int8 with scales, or top-k sparse) come back dense, float32.

    Raises
    ------
    FrameError
        ``BAD_TENSOR`` for an unknown dtype, ``TOO_LARGE`` for too many or too
        large dimensions, ``MALFORMED`` when the bytes do not match the header,
        ``NOT_FINITE`` for a non-finite scale.
    """
    if msg.dtype not in DTYPES:
        accepted = [pb.DType.Name(d) for d in DTYPES]
        raise FrameError(Reason.BAD_TENSOR, f"{name} has dtype {msg.dtype}; accepted: {accepted}")
    shape = tuple(msg.shape)
    # A zero dimension makes any other dimensions hold no bytes, and large ones then
    # overflow numpy's and torch's size arithmetic (found by hypothesis: (0, 1.7e6, 1.7e6,
    # 1.7e6)). No tensor within the limit has more than max_bytes elements besides its
    # zeros: refuse the rest before anything else.
    if len(shape) > MAX_DIMS or math.prod(d for d in shape if d) > max_bytes:
        raise FrameError(
            Reason.TOO_LARGE, f"{name} has shape {shape}: more than {MAX_DIMS} dimensions "
            f"or more than {max_bytes} elements in its non-zero dimensions"
        )
    if msg.dtype == pb.INT8 or msg.row_nnz or msg.indices or msg.mask:
        return _decode_compressed(msg, shape, name=name, max_bytes=max_bytes)
    if msg.scales:
        raise FrameError(Reason.MALFORMED, f"{name} carries scales but is not INT8")
    dtype = DTYPES[msg.dtype]
    data = msg.data  # every read of a bytes field copies it: read it once
    if math.prod(shape) * _itemsize(dtype) != len(data):
        raise FrameError(
            Reason.MALFORMED, f"{name} of shape {shape} and dtype {pb.DType.Name(msg.dtype)} "
            f"needs {math.prod(shape) * _itemsize(dtype)} bytes, the frame holds {len(data)}"
        )
    return _values(data, dtype, shape)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def _values(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bfloat16:
        array = np.frombuffer(data, dtype=np.int16).copy().reshape(shape)
        return torch.from_numpy(array).view(torch.bfloat16)
    np_dtype = _NUMPY_DTYPES[dtype]
    # copy(): the tensor owns writable memory (autograd leaves need it).
    return torch.from_numpy(np.frombuffer(data, dtype=np_dtype).copy().reshape(shape))


def _decode_compressed(msg: TensorMessage, shape: tuple[int, ...], *, name: str, max_bytes: int
                       ) -> torch.Tensor:
    """Decode an int8 and/or top-k tensor into dense float32, checking every field."""
    dtype = DTYPES[msg.dtype]
    if not shape or (not dtype.is_floating_point and dtype != torch.int8):
        raise FrameError(Reason.BAD_TENSOR, f"{name}: only float tensors with a batch "
                         f"dimension are sent compressed (dtype {pb.DType.Name(msg.dtype)}, "
                         f"shape {shape})")
    # The dense result is what gets allocated: a small frame must not ask for a huge one.
    if math.prod(shape) * 4 > max_bytes:
        raise FrameError(Reason.TOO_LARGE, f"{name} of shape {shape} decodes to "
                         f"{math.prod(shape) * 4} bytes, above the limit of {max_bytes}")
    rows, row_length = shape[0], math.prod(shape[1:])
    sparse = bool(msg.row_nnz or msg.indices)
    if msg.mask:
        if sparse:
            raise FrameError(Reason.MALFORMED, f"{name} is both masked and top-k sparse")
        return _decode_masked(msg, shape, dtype, name=name)
    k = msg.row_nnz if sparse else row_length
    if sparse and not 1 <= k <= row_length:
        raise FrameError(Reason.MALFORMED, f"{name} keeps {k} entries per row of "
                         f"{row_length}; expected 1 to {row_length}")
    data = msg.data
    if rows * k * _itemsize(dtype) != len(data):
        raise FrameError(Reason.MALFORMED, f"{name}: {rows} rows of {k} "
                         f"{pb.DType.Name(msg.dtype)} values need {rows * k * _itemsize(dtype)} "
                         f"bytes, the frame holds {len(data)}")
    values = _values(data, dtype, (rows, k)).float()
    if dtype == torch.int8:
        values = values * _scales(msg, rows, name=name)[:, None]
    elif msg.scales:
        raise FrameError(Reason.MALFORMED, f"{name} carries scales but is not INT8")
    if not sparse:
        return values.reshape(shape)
    return scatter_rows(_indices(msg, rows, k, row_length, name=name), values, shape)


def _decode_masked(msg: TensorMessage, shape: tuple[int, ...], dtype: torch.dtype, *, name: str
                   ) -> torch.Tensor:
    rows, row_length = shape[0], math.prod(shape[1:])
    if len(msg.mask) != rows * math.ceil(row_length / 8):
        raise FrameError(Reason.MALFORMED, f"{name}: a mask of {rows} rows of {row_length} "
                         f"bits needs {rows * math.ceil(row_length / 8)} bytes, the frame holds "
                         f"{len(msg.mask)}")
    try:
        nonzero = unpack_mask(msg.mask, rows, row_length)
    except ValueError as err:
        raise FrameError(Reason.MALFORMED, f"{name}: {err}") from None
    count = int(nonzero.sum())
    data = msg.data
    if count * _itemsize(dtype) != len(data):
        raise FrameError(Reason.MALFORMED, f"{name}: the mask sets {count} entries, which need "
                         f"{count * _itemsize(dtype)} bytes, the frame holds {len(data)}")
    dense = torch.zeros(rows, row_length, dtype=torch.float32)
    dense[torch.from_numpy(nonzero)] = _values(data, dtype, (count,)).float()
    if dtype == torch.int8:
        dense *= _scales(msg, rows, name=name)[:, None]
    elif msg.scales:
        raise FrameError(Reason.MALFORMED, f"{name} carries scales but is not INT8")
    return dense.reshape(shape)


def _scales(msg: TensorMessage, rows: int, *, name: str) -> torch.Tensor:
    if len(msg.scales) != rows * 4:
        raise FrameError(Reason.MALFORMED, f"{name}: INT8 needs one float32 scale per row "
                         f"({rows * 4} bytes), the frame holds {len(msg.scales)}")
    scales = torch.from_numpy(np.frombuffer(msg.scales, dtype=np.float32).copy())
    if not bool(torch.isfinite(scales).all()):
        raise FrameError(Reason.NOT_FINITE, f"{name} has NaN or infinite scales")
    if bool((scales < 0).any()):
        raise FrameError(Reason.MALFORMED, f"{name} has negative scales")
    return scales


def _indices(msg: TensorMessage, rows: int, k: int, row_length: int, *, name: str) -> torch.Tensor:
    width = np.uint16 if row_length <= UINT16_ROW_LIMIT else np.uint32
    size = np.dtype(width).itemsize
    if len(msg.indices) != rows * k * size:
        raise FrameError(Reason.MALFORMED, f"{name}: {rows} rows of {k} positions as "
                         f"{np.dtype(width).name} need {rows * k * size} bytes, the frame "
                         f"holds {len(msg.indices)}")
    indices = np.frombuffer(msg.indices, dtype=width).astype(np.int64).reshape(rows, k)
    if indices.size and int(indices.max()) >= row_length:
        raise FrameError(Reason.MALFORMED, f"{name} has a position beyond its rows of "
                         f"{row_length} entries")
    return torch.from_numpy(indices)


def decode_request(data: bytes, *, max_bytes: int) -> AnyRequest:
    """Parse a request frame; any failure is a :class:`FrameError`, never a crash.

    A large request's tensors are views of ``data``: decoding a tensor copies them once.
    """
    if len(data) > max_bytes:
        raise FrameError(
            Reason.TOO_LARGE, f"frame of {len(data)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        message = read(pb.Request, data)
    except FrameDecodeError as err:
        raise FrameError(Reason.MALFORMED, f"not a Request frame: {err}") from None
    if message.WhichOneof("kind") is None:
        raise FrameError(Reason.MALFORMED, "request carries no kind")
    return message


def refusal(seq: int, reason: int, detail: str) -> pb.Reply:
    """Build a ``Refusal`` reply (the detail is cut to 500 characters)."""
    return pb.Reply(seq=seq, refusal=pb.Refusal(reason=reason, detail=detail[:500]))


def magnitude(tensor: torch.Tensor) -> float:
    """Largest absolute value of ``tensor`` (NaN if it holds a NaN); one pass, no copy."""
    if not tensor.numel():
        return 0.0
    low, high = (v.item() for v in torch.aminmax(tensor))  # NaN propagates into both
    return max(-low, high)  # NaN if low is NaN (max keeps its first argument then)


def check_finite(tensor: torch.Tensor, *, name: str, max_abs: float) -> None:
    """Refuse NaN and infinite values, and finite ones beyond ``max_abs``.

    Values near float32's limit are finite but overflow the first layer that
    touches them, so the bound is checked too.
    """
    largest = magnitude(tensor)
    if not math.isfinite(largest):
        raise FrameError(Reason.NOT_FINITE, f"{name} contain NaN or infinite values")
    if largest > max_abs:
        raise FrameError(
            Reason.OUT_OF_RANGE, f"{name} reach |x| = {largest:.3g}, above the bound "
            f"{max_abs:g} (dataplane.max_abs_value)",
        )


def present(parent: object, field: str) -> TensorMessage | None:
    """Return the tensor ``field`` of a request part, or None if it was not sent."""
    return getattr(parent, field) if parent.HasField(field) else None  # type: ignore[attr-defined]


def check_activations(
    msg: TensorMessage | None, *, cut_shape: Sequence[int], max_batch: int, max_bytes: int,
    max_abs: float, name: str = "activations",
) -> torch.Tensor:
    """Decode activations at a cut and check them; return them as float32.

    Raises
    ------
    FrameError
        Naming the first violated rule.
    """
    if msg is None:
        raise FrameError(Reason.BAD_TENSOR, f"frame carries no {name}")
    acts = decode_tensor(msg, name=name, max_bytes=max_bytes)
    if not acts.is_floating_point():
        raise FrameError(Reason.BAD_TENSOR, f"{name} have dtype {acts.dtype}; expected a float")
    if acts.dim() != len(cut_shape) + 1 or tuple(acts.shape[1:]) != tuple(cut_shape):
        raise FrameError(
            Reason.BAD_TENSOR, f"{name} have shape {tuple(acts.shape)}; expected (batch, "
            f"{', '.join(map(str, cut_shape))}) for this client's cut"
        )
    if not 1 <= len(acts) <= max_batch:
        raise FrameError(Reason.TOO_LARGE, f"batch of {len(acts)} rows outside [1, {max_batch}]")
    check_finite(acts, name=name, max_abs=max_abs)
    return acts.float()


def check_labels(
    msg: TensorMessage | None, *, batch: int, num_classes: int, max_bytes: int
) -> torch.Tensor:
    """Decode the labels of a batch of ``batch`` rows and check their range."""
    if msg is None:
        raise FrameError(Reason.BAD_TENSOR, "frame carries no labels")
    labels = decode_tensor(msg, name="labels", max_bytes=max_bytes)
    if labels.dtype != torch.int64 or tuple(labels.shape) != (batch,):
        raise FrameError(
            Reason.BAD_TENSOR, f"labels have dtype {labels.dtype} and shape "
            f"{tuple(labels.shape)}; expected int64 of shape ({batch},)"
        )
    low, high = (v.item() for v in torch.aminmax(labels))
    if low < 0 or high >= num_classes:
        raise FrameError(Reason.OUT_OF_RANGE, f"labels outside [0, {num_classes})")
    return labels


def check_example_ids(msg: TensorMessage | None, *, batch: int, max_bytes: int) -> torch.Tensor:
    """Decode a batch's example ids: int64, one per row, distinct, none negative."""
    if msg is None:
        raise FrameError(Reason.BAD_TENSOR, "frame carries no example_ids (this trunk runs "
                         "with error feedback: every training batch names its examples)")
    ids = decode_tensor(msg, name="example_ids", max_bytes=max_bytes)
    if ids.dtype != torch.int64 or tuple(ids.shape) != (batch,):
        raise FrameError(
            Reason.BAD_TENSOR, f"example_ids have dtype {ids.dtype} and shape "
            f"{tuple(ids.shape)}; expected int64 of shape ({batch},)"
        )
    if batch and int(ids.min()) < 0:
        raise FrameError(Reason.OUT_OF_RANGE, "example_ids must be >= 0")
    if len(torch.unique(ids)) != batch:
        raise FrameError(Reason.MALFORMED, "example_ids repeat an example within the batch")
    return ids


def check_gradient(
    msg: TensorMessage | None, *, shape: Sequence[int], max_bytes: int, max_abs: float
) -> torch.Tensor:
    """Decode a gradient that must have exactly ``shape``; return it as float32."""
    if msg is None:
        raise FrameError(Reason.BAD_TENSOR, "frame carries no grad")
    grad = decode_tensor(msg, name="grad", max_bytes=max_bytes)
    if not grad.is_floating_point() or tuple(grad.shape) != tuple(shape):
        raise FrameError(
            Reason.BAD_TENSOR, f"grad has dtype {grad.dtype} and shape {tuple(grad.shape)}; "
            f"expected a float tensor of shape {tuple(shape)}, the pending features'"
        )
    check_finite(grad, name="grad", max_abs=max_abs)
    return grad.float()
