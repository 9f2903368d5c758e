"""Frames against the generated protobuf code, the reference: same bytes, same fields.

``Frame`` writes and reads trunk.proto by hand so that tensor bytes are not copied
through protobuf. It must be indistinguishable on the wire: what it writes is
byte for byte what protobuf writes, what it reads is what protobuf reads, and it
refuses exactly the bytes protobuf refuses (fuzzed with mutated frames).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import (
    FrameError,
    decode_request,
    decode_tensor,
    encode_tensor,
    reply,
    request,
)
from splitlearn.dataplane.frames import (
    MAX_FRAME_FIELDS,
    SMALL_FRAME_BYTES,
    Frame,
    FrameDecodeError,
    _varint,
    read,
)

SMALL_BYTES = st.binary(max_size=40)
U64 = st.integers(0, 2**64 - 1)
DOUBLES = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0])


@st.composite
def tensors(draw: st.DrawFn) -> dict:
    fields = {
        "dtype": draw(st.sampled_from([0, 1, 2, 3, 4, 5, 99, -1, 2**31 - 1, -(2**31)])),
        "shape": draw(st.lists(U64, max_size=4)),
        "data": draw(SMALL_BYTES),
        "scales": draw(SMALL_BYTES),
        "row_nnz": draw(st.integers(0, 2**32 - 1)),
        "indices": draw(SMALL_BYTES),
        "mask": draw(SMALL_BYTES),
    }
    return {k: v for k, v in fields.items() if draw(st.booleans())}


def maybe_tensor(draw: st.DrawFn) -> dict | None:
    return draw(st.none() | tensors())


@st.composite
def requests(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(["forward", "evaluate", "backward", "smashed", None]))
    fields: dict = {"seq": draw(U64)}
    if kind == "backward":
        part = {"grad": maybe_tensor(draw)}
    elif kind is not None:
        part = {"activations": maybe_tensor(draw), "labels": maybe_tensor(draw)}
    if kind is not None:
        fields[kind] = {k: v for k, v in part.items() if v is not None}
    return fields


@st.composite
def replies(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(["gradient", "features", "metrics", "ack", "refusal", None]))
    fields: dict = {"seq": draw(U64)}
    if kind == "gradient":
        part = {"grad": maybe_tensor(draw), "loss": draw(DOUBLES), "correct": draw(U64)}
        fields[kind] = {k: v for k, v in part.items() if v is not None}
    elif kind == "features":
        part = {"features": maybe_tensor(draw), "replaced_pending": draw(st.booleans())}
        fields[kind] = {k: v for k, v in part.items() if v is not None}
    elif kind == "metrics":
        fields[kind] = pb.Metrics(loss=draw(DOUBLES), correct=draw(U64))
    elif kind == "ack":
        fields[kind] = pb.Ack(queued=draw(U64))
    elif kind == "refusal":
        fields[kind] = pb.Refusal(reason=draw(st.integers(0, 12)),
                                  detail=draw(st.text(max_size=20)))
    return fields


def generated(cls: type, fields: dict):  # noqa: ANN201 - a generated message
    """The generated message with ``fields`` (dicts become nested messages)."""
    message = cls()
    for name, value in fields.items():
        if isinstance(value, dict):
            getattr(message, name).CopyFrom(generated(type(getattr(message, name)), value))
            getattr(message, name).SetInParent()
        elif isinstance(value, list):
            getattr(message, name).extend(value)
        elif hasattr(value, "SerializeToString"):
            getattr(message, name).CopyFrom(value)
        else:
            setattr(message, name, value)
    return message


def same_fields(frame: Frame, message) -> None:  # noqa: ANN001 - a generated message
    """Assert that every field reads the same from the frame and the message."""
    for field in message.DESCRIPTOR.fields:
        ours, theirs = getattr(frame, field.name), getattr(message, field.name)
        if field.message_type is not None:
            has = message.HasField(field.name)
            assert frame.HasField(field.name) == has, field.name
            if isinstance(ours, Frame):
                same_fields(ours, theirs)
            else:
                assert ours == theirs, field.name
        elif field.type == field.TYPE_BYTES:
            assert bytes(ours) == theirs, field.name
        elif field.type == field.TYPE_DOUBLE and math.isnan(theirs):
            assert math.isnan(ours)
        else:
            assert tuple(ours) == tuple(theirs) if field.is_repeated else ours == theirs
    for oneof in message.DESCRIPTOR.oneofs:
        assert frame.WhichOneof(oneof.name) == message.WhichOneof(oneof.name)


@settings(max_examples=300, deadline=None)
@given(st.one_of(requests().map(lambda f: (pb.Request, f)), replies().map(lambda f: (pb.Reply, f))))
def test_a_frame_writes_protobufs_bytes_and_reads_protobufs_fields(case):
    cls, fields = case
    message = generated(cls, fields)
    frame = Frame(cls, **fields)
    assert frame.SerializeToString() == message.SerializeToString()
    assert frame.ByteSize() == message.ByteSize()
    same_fields(Frame.parse(cls, message.SerializeToString()), message)


def mutated(data: bytes, draw: st.DrawFn) -> bytes:
    """``data`` with a few bytes flipped, cut, inserted or dropped."""
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "drop"]))
        at = draw(st.integers(0, max(len(buf) - 1, 0)))
        if op == "flip" and buf:
            buf[at] = draw(st.integers(0, 255))
        elif op == "cut":
            del buf[at:]
        elif op == "insert":
            buf[at:at] = draw(st.binary(min_size=1, max_size=6))
        elif buf:
            del buf[at]
    return bytes(buf)


@st.composite
def damaged_frames(draw: st.DrawFn) -> tuple[type, bytes]:
    if draw(st.booleans()):
        cls, fields = pb.Request, draw(requests())
    else:
        cls, fields = pb.Reply, draw(replies())
    data = generated(cls, fields).SerializeToString()
    how = draw(st.sampled_from(["mutated", "concatenated", "random"]))
    if how == "concatenated":  # protobuf reads two messages back to back as their merge
        more = draw(requests() if cls is pb.Request else replies())
        return cls, data + generated(cls, more).SerializeToString()
    return cls, mutated(data, draw) if how == "mutated" else draw(st.binary(max_size=60))


@settings(max_examples=1500, deadline=None)
@given(damaged_frames())
def test_a_damaged_frame_is_refused_exactly_when_protobuf_refuses_it(case):
    cls, data = case
    try:
        message = cls.FromString(data)
    except DecodeError:
        with pytest.raises(FrameDecodeError):
            Frame.parse(cls, data)
        return
    frame = Frame.parse(cls, data)
    same_fields(frame, message)
    # A frame keeps no unknown fields of its own (its generated parts, such as Metrics, do).
    again = cls.FromString(frame.SerializeToString())
    again.DiscardUnknownFields()
    message.DiscardUnknownFields()
    assert again.SerializeToString() == message.SerializeToString()


def test_zero_bits_are_left_out_and_negative_zero_is_sent_as_protobuf_does():
    for loss in (0.0, -0.0):
        fields = {"gradient": {"loss": loss, "correct": 0}}
        assert (Frame(pb.Reply, **fields).SerializeToString()
                == generated(pb.Reply, fields).SerializeToString())


def test_wide_varints_are_cut_to_the_fields_width_as_protobuf_cuts_them():
    tensor = _varint(1 << 3) + _varint(2**40 + 3) + _varint(5 << 3) + _varint(2**40 + 7)
    data = length_prefixed(2, length_prefixed(1, tensor))
    frame, message = Frame.parse(pb.Request, data), pb.Request.FromString(data)
    assert frame.forward.activations.row_nnz == message.forward.activations.row_nnz == 7
    assert frame.forward.activations.dtype == message.forward.activations.dtype == 3
    same_fields(frame, message)


ODD_FRAMES = {
    "unknown group": b"\x08\x05" + b"\x7b" + b"\x08\x01" + b"\x7c",  # field 15 group
    "nested groups": b"\x7b\x83\x01\x84\x01\x7c",
    "unclosed group": b"\x7b\x08\x01",
    "mismatched end": b"\x7b\x84\x01",
    "stray end group": b"\x0c",
    "wire type 6": b"\x0e",
    "field 0": b"\x00\x01",
    "seq as LEN": b"\x0a\x01\x05",
    "tag over 32 bits": b"\xff\xff\xff\xff\x7f\x00",
    "11-byte varint": b"\x08" + b"\xff" * 10 + b"\x01",
    "10-byte varint": b"\x08" + b"\xff" * 9 + b"\x01",
    "5-byte tag": b"\x88\x80\x80\x80\x00\x01",
    "6-byte tag": b"\x88\x80\x80\x80\x80\x00\x01",
    "6-byte unknown tag": b"\x08\x00\x8a\xd4\x8d\xda\x84\x00\x01",
}


@pytest.mark.parametrize("data", ODD_FRAMES.values(), ids=ODD_FRAMES.keys())
def test_groups_and_wire_types_protobuf_skips_or_refuses(data):
    try:
        message = pb.Request.FromString(data)
    except DecodeError:
        with pytest.raises(FrameDecodeError):
            Frame.parse(pb.Request, data)
        return
    same_fields(Frame.parse(pb.Request, data), message)


def length_prefixed(field: int, body: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(body)) + body


@pytest.mark.parametrize("where", ["request", "tensor", "refusal"])
def test_groups_nest_as_deep_as_protobuf_allows_and_no_deeper(where):
    cls, wrap = {
        "request": (pb.Request, lambda body: body),
        "tensor": (pb.Request, lambda body: length_prefixed(2, length_prefixed(1, body))),
        "refusal": (pb.Reply, lambda body: length_prefixed(6, body)),
    }[where]
    outcomes = set()
    for depth in range(90, 110):
        data = wrap(b"\x7b" * depth + b"\x7c" * depth)
        try:
            cls.FromString(data)
        except DecodeError:
            outcomes.add("refused")
            with pytest.raises(FrameDecodeError, match="deep"):
                Frame.parse(cls, data)
            continue
        outcomes.add("read")
        Frame.parse(cls, data)
    assert outcomes == {"read", "refused"}


def test_a_parsed_tensor_is_a_view_of_the_frame_and_decodes_to_its_own_memory():
    x = torch.randn(32, 16, 8, 8)
    data = Frame(pb.Request, seq=1, forward={"activations": encode_tensor(x)}).SerializeToString()
    request = decode_request(data, max_bytes=1 << 24)
    view = request.forward.activations.data
    assert view.obj is data and len(view) == x.numel() * 4  # no copy on parsing
    decoded = decode_tensor(request.forward.activations, name="a", max_bytes=1 << 24)
    assert torch.equal(decoded, x)
    decoded += 1  # the decoded tensor owns writable memory, apart from the frame
    assert torch.equal(torch.from_numpy(np.frombuffer(view, dtype=np.float32).copy()),
                       x.flatten())


def test_a_written_tensor_refers_to_the_tensors_memory_until_the_frame_is_written():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    wire = encode_tensor(x)
    assert np.shares_memory(np.asarray(wire.data), x.numpy())
    assert wire.to_proto().data == x.numpy().tobytes()


def test_fields_are_checked_as_the_generated_setters_check_them():
    with pytest.raises(ValueError, match="uint64"):
        Frame(pb.Request, seq=-1)
    with pytest.raises(ValueError, match="int32"):
        Frame(pb.Tensor, dtype=2**31)
    with pytest.raises(AttributeError, match="no field"):
        Frame(pb.Request, sequence=1)
    with pytest.raises(TypeError, match="expected a Forward"):
        Frame(pb.Request, forward=pb.Evaluate())
    with pytest.raises(ValueError, match="contiguous"):
        Frame(pb.Tensor, data=np.arange(10)[::2])
    with pytest.raises(TypeError, match="generated class"):
        Frame(pb.Metrics)
    frame = Frame(pb.Request, forward={}, evaluate={})
    assert frame.WhichOneof("kind") == "evaluate" and not frame.HasField("forward")
    with pytest.raises(ValueError, match="presence"):
        frame.HasField("seq")


@pytest.mark.parametrize("rows", [2, 4096], ids=["small", "large"])
def test_requests_and_replies_take_the_path_their_size_pays_for_and_read_back_the_same(rows):
    x = torch.randn(rows, 8)
    labels = torch.arange(rows) % 10
    sent = request(5, "forward", activations=encode_tensor(x), labels=encode_tensor(labels))
    large = rows * 8 * 4 >= SMALL_FRAME_BYTES
    assert isinstance(sent, Frame) == large
    data = sent.SerializeToString()
    if large:  # a frame's bytes are protobuf's
        assert data == sent.to_proto().SerializeToString()
    received = decode_request(data, max_bytes=1 << 24)
    assert isinstance(received, Frame) == large
    assert torch.equal(decode_tensor(received.forward.activations, name="a", max_bytes=1 << 24), x)
    answer = reply("gradient", grad=encode_tensor(x), loss=0.5, correct=3)
    back = read(pb.Reply, answer.SerializeToString())
    assert isinstance(answer, Frame) == isinstance(back, Frame) == large
    assert (back.gradient.loss, back.gradient.correct) == (0.5, 3)
    assert torch.equal(decode_tensor(back.gradient.grad, name="g", max_bytes=1 << 24), x)


def test_a_damaged_large_request_is_refused_with_a_reason_on_either_path():
    data = request(1, "forward", activations=encode_tensor(torch.randn(4096, 8)),
                   labels=encode_tensor(torch.zeros(4096, dtype=torch.int64))).SerializeToString()
    assert len(data) >= SMALL_FRAME_BYTES
    for damaged in (data[:-1], data[: SMALL_FRAME_BYTES - 1], data + b"\x0e"):
        with pytest.raises(FrameError) as refused:
            decode_request(damaged, max_bytes=1 << 24)
        assert refused.value.reason_name == "MALFORMED"


# --- the reader's work is bounded by the frame's field budget, not by its size --------

#: (Request field, Forward/Evaluate/... field) of each tensor whose ``shape`` repeats.
SHAPED = [(2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (4, 1), (5, 1), (5, 2), (5, 3)]


def repeated_shape_frame(outer: int, inner: int, entries: int, spans: int, packed: bool,
                         copies: int) -> bytes:
    """A request whose tensor's ``shape`` holds ``entries`` ones, split over ``spans`` runs
    (packed or one varint field each) and the tensor over ``copies`` occurrences."""
    runs = [entries // spans + (i < entries % spans) for i in range(spans)]
    if packed:
        body = b"".join(length_prefixed(2, b"\x01" * n) for n in runs)
    else:
        body = b"\x10\x01" * entries
    # A message field seen again is merged into the first: its shape entries add up.
    message = b"".join(length_prefixed(inner, b"\x08\x01" + body) for _ in range(copies))
    return b"\x08\x01" + length_prefixed(outer, message)


def fields_read(data: bytes) -> tuple[int, object]:
    """Parse ``data`` as a Request, counting every field the reader visits."""
    from unittest import mock

    from splitlearn.dataplane import frames

    visits = [0]
    spend = frames._Budget.spend

    def counting(self):  # noqa: ANN001, ANN202
        visits[0] += 1
        spend(self)

    with mock.patch.object(frames._Budget, "spend", counting):
        try:
            return visits[0], Frame.parse(pb.Request, data)
        except FrameDecodeError as err:
            return visits[0], err


@settings(max_examples=200, deadline=None)
@given(where=st.sampled_from(SHAPED), entries=st.integers(0, 3 * MAX_FRAME_FIELDS),
       spans=st.integers(1, 64), packed=st.booleans(), copies=st.integers(1, 3))
def test_any_number_of_repeated_entries_reads_as_protobuf_or_stops_at_the_budget(
        where, entries, spans, packed, copies):
    data = repeated_shape_frame(*where, entries, min(spans, max(entries, 1)), packed, copies)
    visits, parsed = fields_read(data)
    if isinstance(parsed, FrameDecodeError):  # refused where the budget ran out, no later
        assert "fields in one frame" in str(parsed) and visits == MAX_FRAME_FIELDS + 1
        return
    assert visits <= MAX_FRAME_FIELDS
    same_fields(parsed, pb.Request.FromString(data))


def test_the_repeated_shape_attack_at_the_frame_limit_is_refused_within_the_budget():
    """90,000 repeated shape entries (175 KiB; 13-21 s of parsing before), and the same at
    the 64 MiB frame limit: refused as soon as the budget runs out, whatever the size."""
    for entries in (90_000, (64 << 20) // 2 - 64):
        data = repeated_shape_frame(2, 1, entries, 1, packed=False, copies=1)
        visits, parsed = fields_read(data)
        assert isinstance(parsed, FrameDecodeError) and visits == MAX_FRAME_FIELDS + 1
        with pytest.raises(FrameError, match="fields in one frame"):
            decode_request(data, max_bytes=64 << 20)
