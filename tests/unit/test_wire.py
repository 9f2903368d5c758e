import json
import struct

import pytest
import torch

from splitlearn.wire import (
    MAGIC,
    FrameError,
    check_forward_frame,
    decode_frame,
    encode_frame,
    record_to_state,
    state_to_record,
)

LIMIT = 1 << 20


def forward_frame(acts, labels):
    return decode_frame(encode_frame("forward", {"activations": acts, "labels": labels}),
                        max_bytes=1 << 26)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_round_trip_preserves_dtype_shape_and_values(dtype):
    t = (torch.randn(3, 4, 5) * 10).to(dtype)
    frame = decode_frame(encode_frame("gradient", {"grad": t}, {"loss": 1.5}), max_bytes=LIMIT)
    assert frame.kind == "gradient" and frame.meta == {"loss": 1.5}
    assert frame.tensors["grad"].dtype == dtype
    assert torch.equal(frame.tensors["grad"], t)


def test_decoded_tensors_are_writable_and_independent():
    data = encode_frame("forward", {"activations": torch.ones(2, 3)})
    t = decode_frame(data, max_bytes=LIMIT).tensors["activations"]
    t.add_(1)  # would fail or warn on a read-only buffer
    assert torch.equal(decode_frame(data, max_bytes=LIMIT).tensors["activations"], torch.ones(2, 3))


def test_empty_and_scalar_tensors():
    frame = decode_frame(
        encode_frame("forward", {"a": torch.zeros(0, 3), "b": torch.tensor(2.0)}), max_bytes=LIMIT
    )
    assert frame.tensors["a"].shape == (0, 3) and float(frame.tensors["b"]) == 2.0


def _raw(header: dict, payload: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<4sI", MAGIC, len(h)) + h + payload


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "shorter than its prefix"),
        (b"XXXX" + b"\0" * 8, "bad magic"),
        (struct.pack("<4sI", MAGIC, 10**9) + b"{}", "header length"),
        (struct.pack("<4sI", MAGIC, 3) + b"{{{", "not valid JSON"),
        (_raw({"kind": "nope", "tensors": [], "meta": {}}), "kind must be one of"),
        (_raw({"kind": "forward", "tensors": "x", "meta": {}}), "'tensors' list"),
        (_raw({"kind": "forward", "tensors": [{"name": "a", "dtype": "int8", "shape": [1]}],
               "meta": {}}, b"\0"), "dtype 'int8'"),
        (_raw({"kind": "forward", "tensors": [{"name": "a", "dtype": "float32", "shape": [-1]}],
               "meta": {}}), "invalid shape"),
        (_raw({"kind": "forward", "tensors": [{"name": "a", "dtype": "float32", "shape": [4]}],
               "meta": {}}, b"\0" * 8), "truncated"),
        (_raw({"kind": "forward", "tensors": [], "meta": {}}, b"\0"), "trailing bytes"),
    ],
)
def test_malformed_frames_are_refused_with_a_reason(data, reason):
    with pytest.raises(FrameError, match=reason):
        decode_frame(data, max_bytes=LIMIT)


def test_oversized_frame_is_refused_before_parsing():
    data = encode_frame("forward", {"activations": torch.zeros(LIMIT // 4 + 1)})
    with pytest.raises(FrameError, match=f"exceeds the limit of {LIMIT} bytes"):
        decode_frame(data, max_bytes=LIMIT)


def test_unsupported_dtype_cannot_be_encoded():
    with pytest.raises(FrameError, match="unsupported dtype"):
        encode_frame("forward", {"a": torch.zeros(2, dtype=torch.int8)})


CUT = (4, 3, 3)


def check(frame, **kw):
    kw = {"cut_shape": CUT, "num_classes": 10, "max_batch": 8} | kw
    return check_forward_frame(frame, **kw)


def test_valid_forward_frame_passes():
    acts, labels = check(forward_frame(torch.randn(5, *CUT), torch.arange(5)))
    assert acts.shape == (5, *CUT) and labels.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("acts", "labels", "reason"),
    [
        (torch.randn(5, 4, 3, 2), torch.arange(5), r"expected \(batch, 4, 3, 3\)"),
        (torch.randn(5, 4, 3, 3, 1), torch.arange(5), "expected"),
        (torch.ones(5, *CUT, dtype=torch.int64), torch.arange(5), "expected a float dtype"),
        (torch.full((5, *CUT), float("nan")), torch.arange(5), "NaN or infinite"),
        (torch.full((5, *CUT), float("inf")), torch.arange(5), "NaN or infinite"),
        (torch.randn(9, *CUT), torch.arange(9), r"outside \[1, 8\]"),
        (torch.randn(0, *CUT), torch.arange(0), r"outside \[1, 8\]"),
        (torch.randn(5, *CUT), torch.arange(4), "labels have dtype"),
        (torch.randn(5, *CUT), torch.arange(5).float(), "labels have dtype"),
        (torch.randn(5, *CUT), torch.tensor([0, 1, 2, 3, 10]), r"labels outside \[0, 10\)"),
        (torch.randn(5, *CUT), torch.tensor([0, 1, 2, 3, -1]), "labels outside"),
    ],
)
def test_forward_frame_violations_name_the_problem(acts, labels, reason):
    with pytest.raises(FrameError, match=reason):
        check(forward_frame(acts, labels))


def test_missing_tensors_are_named():
    with pytest.raises(FrameError, match="no 'activations'"):
        check(decode_frame(encode_frame("forward", {"labels": torch.arange(2)}), max_bytes=LIMIT))
    with pytest.raises(FrameError, match="no 'labels'"):
        check(decode_frame(encode_frame("forward", {"activations": torch.randn(2, *CUT)}),
                           max_bytes=LIMIT))


def test_state_record_round_trip_keeps_buffers_and_dtypes():
    state = {"0.weight": torch.randn(3, 2), "0.num_batches_tracked": torch.tensor(7)}
    back = record_to_state(state_to_record(state))
    assert torch.equal(back["0.weight"], state["0.weight"])
    assert back["0.num_batches_tracked"].dtype == torch.int64
    assert int(back["0.num_batches_tracked"]) == 7
