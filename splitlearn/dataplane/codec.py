"""Tensors and requests on the wire, and the rules every frame must pass.

The wire contract is ``trunk.proto`` (compiled to :mod:`trunk_pb2`). Decoding is
defensive: the size is checked before parsing, every dtype, shape and byte count
before a tensor is allocated, and every value before a model sees it. Whatever goes
wrong while decoding becomes a :class:`FrameError` carrying one of the proto's
refusal reasons, so the server answers with a ``Refusal`` and never crashes a stream.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from splitlearn.dataplane import trunk_pb2 as pb

Reason = pb.Refusal.Reason

#: Wire dtypes and their torch counterparts; nothing else is accepted.
DTYPES: dict[int, torch.dtype] = {
    pb.FLOAT32: torch.float32,
    pb.FLOAT16: torch.float16,
    pb.BFLOAT16: torch.bfloat16,
    pb.INT64: torch.int64,
}
_WIRE_DTYPES = {v: k for k, v in DTYPES.items()}
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


def encode_tensor(tensor: torch.Tensor) -> pb.Tensor:
    """Return the wire form of ``tensor`` (detached, on the CPU, contiguous)."""
    t = tensor.detach().cpu().contiguous()
    if t.dtype not in _WIRE_DTYPES:
        raise ValueError(f"dtype {t.dtype} cannot be sent; accepted: {list(_WIRE_DTYPES)}")
    # bfloat16 has no numpy dtype: ship its raw 16-bit patterns.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return pb.Tensor(dtype=_WIRE_DTYPES[t.dtype], shape=t.shape, data=raw.numpy().tobytes())


def decode_tensor(msg: pb.Tensor, *, name: str, max_bytes: int) -> torch.Tensor:
    """Check a wire tensor's header against its bytes and return it as a tensor it owns.

    Raises
    ------
    FrameError
        ``BAD_TENSOR`` for an unknown dtype, ``TOO_LARGE`` for too many or too
        large dimensions, ``MALFORMED`` when the bytes do not match the header.
    """
    if msg.dtype not in DTYPES:
        accepted = [pb.DType.Name(d) for d in DTYPES]
        raise FrameError(Reason.BAD_TENSOR, f"{name} has dtype {msg.dtype}; accepted: {accepted}")
    shape = tuple(msg.shape)
    # A dimension above the frame limit can only be paired with a zero elsewhere, and
    # such shapes overflow torch's size arithmetic: refuse them before anything else.
    if len(shape) > MAX_DIMS or any(d > max_bytes for d in shape):
        raise FrameError(
            Reason.TOO_LARGE, f"{name} has shape {shape}: more than {MAX_DIMS} dimensions "
            f"or a dimension above {max_bytes}"
        )
    dtype = DTYPES[msg.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(shape) * itemsize != len(msg.data):
        raise FrameError(
            Reason.MALFORMED, f"{name} of shape {shape} and dtype {pb.DType.Name(msg.dtype)} "
            f"needs {math.prod(shape) * itemsize} bytes, the frame holds {len(msg.data)}"
        )
    if dtype == torch.bfloat16:
        array = np.frombuffer(msg.data, dtype=np.int16).copy().reshape(shape)
        return torch.from_numpy(array).view(torch.bfloat16)
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    # copy(): the tensor owns writable memory (autograd leaves need it).
    return torch.from_numpy(np.frombuffer(msg.data, dtype=np_dtype).copy().reshape(shape))


def decode_request(data: bytes, *, max_bytes: int) -> pb.Request:
    """Parse a request frame; any failure is a :class:`FrameError`, never a crash."""
    if len(data) > max_bytes:
        raise FrameError(
            Reason.TOO_LARGE, f"frame of {len(data)} bytes exceeds the limit of {max_bytes}"
        )
    try:
        request = pb.Request.FromString(data)
    except Exception as err:  # noqa: BLE001 - any parser failure is a refusal
        raise FrameError(Reason.MALFORMED, f"not a Request frame: {err}") from None
    if request.WhichOneof("kind") is None:
        raise FrameError(Reason.MALFORMED, "request carries no kind")
    return request


def refusal(seq: int, reason: int, detail: str) -> pb.Reply:
    """Build a ``Refusal`` reply (the detail is cut to 500 characters)."""
    return pb.Reply(seq=seq, refusal=pb.Refusal(reason=reason, detail=detail[:500]))


def magnitude(tensor: torch.Tensor) -> float:
    """Largest absolute value of ``tensor`` (NaN if it holds a NaN); one pass, no copy."""
    if not tensor.numel():
        return 0.0
    low, high = torch.aminmax(tensor)  # NaN propagates into both
    return max(-float(low), float(high)) if not torch.isnan(low) else float("nan")


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


def present(parent: object, field: str) -> pb.Tensor | None:
    """Return the tensor ``field`` of a request part, or None if it was not sent."""
    return getattr(parent, field) if parent.HasField(field) else None  # type: ignore[attr-defined]


def check_activations(
    msg: pb.Tensor | None, *, cut_shape: Sequence[int], max_batch: int, max_bytes: int,
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
    msg: pb.Tensor | None, *, batch: int, num_classes: int, max_bytes: int
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
    if labels.min() < 0 or labels.max() >= num_classes:
        raise FrameError(Reason.OUT_OF_RANGE, f"labels outside [0, {num_classes})")
    return labels


def check_gradient(
    msg: pb.Tensor | None, *, shape: Sequence[int], max_bytes: int, max_abs: float
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
