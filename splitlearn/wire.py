"""Tensors on the wire: data-plane frames and Flower records.

A data-plane frame is ``MAGIC | uint32 header length | JSON header | payload``.
The header names each tensor with its dtype and shape; the payload is the
tensors' raw little-endian bytes, in header order. Frames are decoded
defensively: every length, dtype, shape and value is checked before a tensor
reaches a model, and a violation raises :class:`FrameError` with the reason.

This is the only module of ``splitlearn`` that imports Flower (for the record
conversions at the bottom).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MAGIC = b"SLF1"
_PREFIX = struct.Struct("<4sI")
MAX_HEADER_BYTES = 64 * 1024

#: Frame kinds. ``forward`` goes client -> trunk (activations and labels);
#: ``gradient`` comes back (gradient at the cut, loss, correct count);
#: ``evaluate`` asks for loss/accuracy without an update; ``error`` refuses a
#: frame and names why.
KINDS = ("forward", "gradient", "evaluate", "metrics", "error")
#: Local-loss protocol: ``smashed`` goes client -> trunk one way (activations and
#: labels, validated like ``forward``, trained asynchronously); ``ack`` says it
#: was queued (no gradient comes back).
KINDS = (*KINDS, "smashed", "ack")
#: U-shaped protocol (labels stay on the device): ``forward``/``evaluate`` carry
#: activations only; the trunk answers ``features`` (its output at the tail cut);
#: ``backward`` goes client -> trunk with the gradient w.r.t. those features and
#: is answered by ``gradient`` (the gradient at the cut, nothing else).
KINDS = (*KINDS, "features", "backward")

#: dtypes a frame may carry; anything else is refused before any allocation.
DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
}
_NAMES_BY_DTYPE = {v: k for k, v in DTYPES.items()}


class FrameError(ValueError):
    """A frame was malformed or violated the data-plane contract."""


@dataclass
class Frame:
    """A decoded data-plane frame.

    Parameters
    ----------
    kind : str
        One of :data:`KINDS`.
    tensors : dict[str, torch.Tensor]
        Named tensors carried by the frame.
    meta : dict[str, Any]
        Small JSON-serialisable values (loss, step number, reason ...).
    nbytes : int
        Size of the encoded frame in bytes.
    """

    kind: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0


def encode_frame(
    kind: str,
    tensors: Mapping[str, torch.Tensor] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> bytes:
    """Encode tensors and metadata into one frame.

    Parameters
    ----------
    kind : str
        One of :data:`KINDS`.
    tensors : Mapping[str, torch.Tensor], optional
        Tensors to send; they are detached and moved to the CPU.
    meta : Mapping[str, Any], optional
        JSON-serialisable metadata.

    Returns
    -------
    bytes
        The encoded frame.
    """
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind!r}; accepted: {', '.join(KINDS)}")
    specs, chunks = [], []
    for name, tensor in (tensors or {}).items():
        t = tensor.detach().cpu().contiguous()
        if t.dtype not in _NAMES_BY_DTYPE:
            raise FrameError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        specs.append({"name": name, "dtype": _NAMES_BY_DTYPE[t.dtype], "shape": list(t.shape)})
        # bfloat16 has no numpy dtype: ship its raw 16-bit pattern.
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        chunks.append(raw.numpy().tobytes())
    header = json.dumps({"kind": kind, "tensors": specs, "meta": dict(meta or {})}).encode()
    return b"".join([_PREFIX.pack(MAGIC, len(header)), header, *chunks])


def decode_frame(data: bytes, *, max_bytes: int) -> Frame:
    """Decode and structurally validate a frame.

    Parameters
    ----------
    data : bytes
        The encoded frame.
    max_bytes : int
        Largest accepted frame, in bytes.

    Returns
    -------
    Frame
        The decoded frame; tensors own their memory.

    Raises
    ------
    FrameError
        If the frame is too large, truncated, or its header is inconsistent.
    """
    if len(data) > max_bytes:
        raise FrameError(f"frame of {len(data)} bytes exceeds the limit of {max_bytes} bytes")
    header = _read_header(data)
    offset = _PREFIX.size + header["_len"]
    tensors = {}
    for spec in header["tensors"]:
        name, dtype, shape = _read_spec(spec)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > len(data):
            raise FrameError(f"frame truncated: tensor {name!r} needs {nbytes} bytes")
        tensors[name] = _tensor_from_bytes(data[offset : offset + nbytes], dtype, shape)
        offset += nbytes
    if offset != len(data):
        raise FrameError(f"frame has {len(data) - offset} trailing bytes after its tensors")
    return Frame(header["kind"], tensors, header["meta"], len(data))


def _read_header(data: bytes) -> dict[str, Any]:
    if len(data) < _PREFIX.size:
        raise FrameError(f"frame of {len(data)} bytes is shorter than its prefix")
    magic, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}; expected {MAGIC!r}")
    if header_len > MAX_HEADER_BYTES or _PREFIX.size + header_len > len(data):
        raise FrameError(f"header length {header_len} is out of bounds")
    try:
        header = json.loads(data[_PREFIX.size : _PREFIX.size + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FrameError(f"header is not valid JSON: {err}") from None
    if not isinstance(header, dict) or header.get("kind") not in KINDS:
        raise FrameError(f"header kind must be one of {', '.join(KINDS)}")
    if not isinstance(header.get("tensors"), list) or not isinstance(header.get("meta"), dict):
        raise FrameError("header needs a 'tensors' list and a 'meta' object")
    header["_len"] = header_len
    return header


def _read_spec(spec: Any) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if not isinstance(spec, dict):
        raise FrameError("tensor spec must be an object")
    name, dtype_name, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str):
        raise FrameError("tensor spec needs a string 'name'")
    if dtype_name not in DTYPES:
        raise FrameError(
            f"tensor {name!r} has dtype {dtype_name!r}; accepted: {', '.join(DTYPES)}"
        )
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise FrameError(f"tensor {name!r} has an invalid shape {shape!r}")
    return name, DTYPES[dtype_name], tuple(shape)


def _tensor_from_bytes(buf: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bfloat16:
        array = np.frombuffer(buf, dtype=np.int16).copy()
        return torch.from_numpy(array).view(torch.bfloat16).reshape(shape)
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    # copy() so the tensor owns writable memory (autograd leaves need it).
    return torch.from_numpy(np.frombuffer(buf, dtype=np_dtype).copy()).reshape(shape)


def check_forward_frame(
    frame: Frame,
    *,
    cut_shape: Sequence[int],
    num_classes: int,
    max_batch: int,
    need_labels: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate a ``forward``/``evaluate`` frame against the client's cut.

    Parameters
    ----------
    frame : Frame
        A decoded frame.
    cut_shape : Sequence[int]
        Per-sample shape of the activation at this client's cut.
    num_classes : int
        Labels must lie in ``[0, num_classes)``.
    max_batch : int
        Largest accepted batch.
    need_labels : bool
        Whether the frame must carry labels.

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor | None]
        Activations (float32) and labels (int64 or None).

    Raises
    ------
    FrameError
        Naming the first violated rule.
    """
    acts = frame.tensors.get("activations")
    if acts is None:
        raise FrameError("frame carries no 'activations' tensor")
    if not acts.is_floating_point():
        raise FrameError(f"activations have dtype {acts.dtype}; expected a float dtype")
    if tuple(acts.shape[1:]) != tuple(cut_shape) or acts.dim() != len(cut_shape) + 1:
        raise FrameError(
            f"activations have shape {tuple(acts.shape)}; expected (batch, "
            f"{', '.join(map(str, cut_shape))}) for this client's cut"
        )
    batch = acts.shape[0]
    if not 1 <= batch <= max_batch:
        raise FrameError(f"batch of {batch} samples outside [1, {max_batch}]")
    if not torch.isfinite(acts).all():
        raise FrameError("activations contain NaN or infinite values")
    labels = frame.tensors.get("labels")
    if labels is None:
        if need_labels:
            raise FrameError("frame carries no 'labels' tensor")
        return acts.float(), None
    if labels.dtype != torch.int64 or tuple(labels.shape) != (batch,):
        raise FrameError(
            f"labels have dtype {labels.dtype} and shape {tuple(labels.shape)}; "
            f"expected int64 of shape ({batch},)"
        )
    if batch and (labels.min() < 0 or labels.max() >= num_classes):
        raise FrameError(f"labels outside [0, {num_classes})")
    return acts.float(), labels


def check_label_free(frame: Frame, *, allowed: Sequence[str]) -> None:
    """Refuse a U-shaped frame carrying any tensor besides ``allowed`` (labels above all).

    Raises
    ------
    FrameError
        Naming the unexpected tensors and the accepted ones.
    """
    extra = sorted(set(frame.tensors) - set(allowed))
    if extra:
        raise FrameError(
            f"U-shaped sessions keep labels on the device: {frame.kind!r} frame carries "
            f"{extra}; accepted: {list(allowed)}"
        )


def check_backward_frame(frame: Frame, *, features_shape: Sequence[int]) -> torch.Tensor:
    """Validate a U-shaped ``backward`` frame against the session's pending features.

    Parameters
    ----------
    frame : Frame
        A decoded ``backward`` frame.
    features_shape : Sequence[int]
        Full shape (batch included) of the features the trunk sent for the
        pending forward; the gradient must have exactly that shape.

    Returns
    -------
    torch.Tensor
        The gradient w.r.t. the features, float32.

    Raises
    ------
    FrameError
        Naming the first violated rule.
    """
    check_label_free(frame, allowed=("grad",))
    grad = frame.tensors.get("grad")
    if grad is None:
        raise FrameError("backward frame carries no 'grad' tensor")
    if not grad.is_floating_point():
        raise FrameError(f"grad has dtype {grad.dtype}; expected a float dtype")
    if tuple(grad.shape) != tuple(features_shape):
        raise FrameError(
            f"grad has shape {tuple(grad.shape)}; expected {tuple(features_shape)}, "
            "the shape of the pending features"
        )
    if not torch.isfinite(grad).all():
        raise FrameError("grad contains NaN or infinite values")
    return grad.float()


def error_reason(frame: Frame) -> str:
    """Return the reason carried by an ``error`` frame."""
    return str(frame.meta.get("reason", "unspecified"))


# --- Flower records --------------------------------------------------------


def state_to_record(state: Mapping[str, torch.Tensor]) -> Any:
    """Wrap a state dict (parameters and buffers) in a Flower ``ArrayRecord``."""
    from flwr.app import ArrayRecord

    return ArrayRecord({k: v.detach().cpu() for k, v in state.items()})


def record_to_state(record: Any) -> dict[str, torch.Tensor]:
    """Unwrap a Flower ``ArrayRecord`` into a state dict of tensors."""
    return {k: torch.from_numpy(np.array(v.numpy())) for k, v in record.items()}
