"""Frames on the wire: round trips, every refusal rule, and fuzzing of the decoder."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols import protocol_named
from server.trunk import Trunk
from splitlearn.config import CompressionConfig, DataPlaneConfig
from splitlearn.dataplane import FrameError, TokenRegistry, TrunkEndpoint
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import (
    MAX_DIMS,
    check_activations,
    check_labels,
    decode_request,
    decode_tensor,
    encode_tensor,
    request,
)
from splitlearn.dataplane.frames import SMALL_FRAME_BYTES
from tests.conftest import digits_like_model

MAX = 1 << 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(3, 4, 2), (0, 5), ()])
def test_tensor_round_trip_keeps_dtype_shape_and_values(dtype, shape):
    t = (torch.randn(shape) * 100).to(dtype)
    back = decode_tensor(pb.Tensor.FromString(encode_tensor(t).SerializeToString()),
                         name="t", max_bytes=MAX)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_decoded_tensors_are_writable_and_independent():
    msg = encode_tensor(torch.ones(2, 3))
    a = decode_tensor(msg, name="a", max_bytes=MAX)
    b = decode_tensor(msg, name="b", max_bytes=MAX)
    a += 1  # would fail on read-only memory
    assert torch.equal(b, torch.ones(2, 3))
    a.requires_grad_(True)


def reason(err: pytest.ExceptionInfo[FrameError]) -> str:
    return pb.Refusal.Reason.Name(err.value.reason)


@pytest.mark.parametrize(("tensor", "expected"), [
    (pb.Tensor(dtype=99, shape=[1], data=b"\0" * 4), "BAD_TENSOR"),
    (pb.Tensor(dtype=pb.FLOAT32, shape=[2, 2], data=b"\0" * 15), "MALFORMED"),
    (pb.Tensor(dtype=pb.FLOAT32, shape=[1] * (MAX_DIMS + 1), data=b"\0" * 4), "TOO_LARGE"),
    # A zero beside a dimension that overflows torch's size arithmetic.
    (pb.Tensor(dtype=pb.FLOAT32, shape=[0, 2**63], data=b""), "TOO_LARGE"),
    (pb.Tensor(dtype=pb.FLOAT32, shape=[2**40, 2**40], data=b""), "TOO_LARGE"),
    # A zero beside dimensions each within the limit, whose product overflows numpy's.
    (pb.Tensor(dtype=pb.FLOAT32, shape=[0, MAX, MAX, MAX], data=b""), "TOO_LARGE"),
    (pb.Tensor(dtype=pb.BFLOAT16, shape=[MAX, 0, MAX, MAX], data=b""), "TOO_LARGE"),
    (pb.Tensor(dtype=pb.INT8, shape=[0, MAX, MAX, MAX], data=b""), "TOO_LARGE"),
])
def test_inconsistent_tensor_headers_are_refused_with_a_reason(tensor, expected):
    with pytest.raises(FrameError) as err:
        decode_tensor(tensor, name="t", max_bytes=MAX)
    assert reason(err) == expected


def test_requests_are_refused_before_parsing_when_too_large_and_when_kindless():
    with pytest.raises(FrameError) as err:
        decode_request(b"\0" * (MAX + 1), max_bytes=MAX)
    assert reason(err) == "TOO_LARGE"
    with pytest.raises(FrameError) as err:
        decode_request(pb.Request(seq=1).SerializeToString(), max_bytes=MAX)
    assert reason(err) == "MALFORMED"
    with pytest.raises(FrameError) as err:
        decode_request(b"\x0a\xff\xff\xff\xff\x0f", max_bytes=MAX)  # a length past the end
    assert reason(err) == "MALFORMED"


def test_activation_and_label_rules_name_the_problem():
    def acts(t: torch.Tensor, **kw):
        return check_activations(encode_tensor(t), **({"cut_shape": (3,), "max_batch": 8,
                                                        "max_bytes": MAX, "max_abs": 1e6} | kw))

    assert acts(torch.ones(2, 3)).dtype == torch.float32
    for bad, expected in [
        (torch.ones(2, 4), "BAD_TENSOR"), (torch.ones(2, 3, dtype=torch.int64), "BAD_TENSOR"),
        (torch.ones(9, 3), "TOO_LARGE"), (torch.full((2, 3), float("inf")), "NOT_FINITE"),
        (torch.full((2, 3), 3e38), "OUT_OF_RANGE"),
    ]:
        with pytest.raises(FrameError) as err:
            acts(bad)
        assert reason(err) == expected, bad
    with pytest.raises(FrameError) as err:
        check_activations(None, cut_shape=(3,), max_batch=8, max_bytes=MAX, max_abs=1e6)
    assert "no activations" in str(err.value)
    labels = encode_tensor(torch.tensor([0, 9]))
    assert check_labels(labels, batch=2, num_classes=10, max_bytes=MAX).tolist() == [0, 9]
    for bad, batch in [(torch.tensor([0, 10]), 2), (torch.tensor([0, 1]), 3),
                       (torch.tensor([0.0, 1.0]), 2)]:
        with pytest.raises(FrameError):
            check_labels(encode_tensor(bad), batch=batch, num_classes=10, max_bytes=MAX)


def fuzz_endpoint(protocol: str = "splitfed_v2", *,
                  compression: CompressionConfig | None = None):
    """An endpoint serving ``protocol``'s real sessions on a small trunk, and a session at cut 1."""
    spec = protocol_named(protocol)
    assert spec.trunk is not None
    trunk = Trunk(copy.deepcopy(digits_like_model("cnn")), lr=0.1)
    dataplane = DataPlaneConfig(max_frame_bytes=MAX, max_batch=16,
                             compression=compression or CompressionConfig())
    options = spec.options(tail_cut=3) if protocol == "ushaped" else spec.options()
    tokens = TokenRegistry()
    endpoint = TrunkEndpoint({protocol: spec.trunk(trunk, options, dataplane)}, tokens,
                             dataplane=dataplane)
    token = tokens.issue(client="fuzzer", protocol=protocol, cut=1, server_round=1, ttl_s=600)
    session, _ = endpoint.attach(token, cancel=lambda: None)
    return endpoint, session, trunk


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
BYTES_TARGET = fuzz_endpoint()


@FUZZ
@given(st.binary(max_size=4096))
def test_any_bytes_get_a_reply_never_an_exception(data):
    endpoint, session, trunk = BYTES_TARGET
    reply = pb.Reply.FromString(endpoint.handle(session, data, peer="fuzz"))
    assert reply.WhichOneof("kind") in ("refusal", "gradient", "metrics")
    assert reply.refusal.reason != pb.Refusal.INTERNAL, reply.refusal.detail  # a bug's reason
    assert all(torch.isfinite(p).all() for p in trunk.model.parameters())


tensors = st.builds(
    pb.Tensor,
    dtype=st.integers(0, 6),
    # Any size, small ones, and ones each within the frame limit whose product is not.
    shape=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 40) | st.integers(MAX // 2, MAX),
                   max_size=10),
    data=st.binary(max_size=2048),
    scales=st.binary(max_size=64),  # compressed forms too (int8 scales, top-k positions)
    row_nnz=st.integers(0, 8),
    indices=st.binary(max_size=128),
    mask=st.binary(max_size=16),
)


STRUCTURED_TARGET = fuzz_endpoint()
SEQ = itertools.count(1)


@FUZZ
@given(kind=st.sampled_from(["forward", "evaluate", "backward", "smashed"]),
       activations=tensors, labels=tensors)
def test_structured_garbage_is_refused_and_the_trunk_stays_finite(kind, activations, labels):
    endpoint, session, trunk = STRUCTURED_TARGET
    part = {"backward": pb.Backward(grad=activations)}.get(kind) or getattr(pb, kind.title())(
        activations=activations, labels=labels)
    request = pb.Request(seq=next(SEQ), **{kind: part})
    reply = pb.Reply.FromString(endpoint.handle(session, request.SerializeToString(), peer="f"))
    assert reply.WhichOneof("kind") == "refusal"  # nothing here is a valid batch
    assert pb.Refusal.Reason.Name(reply.refusal.reason) not in ("REPLAYED", "INTERNAL"), (
        reply.refusal.detail)
    assert all(torch.isfinite(p).all() for p in trunk.model.parameters())


LARGE_TARGET = fuzz_endpoint()
#: A valid forward of 16 rows at cut 1 (128 KiB).
LARGE_BATCH = (torch.rand(16, 32, 8, 8), torch.arange(16) % 10)


#: Edits of a frame: where (bytes from its head, or back from its tail, where the headers,
#: lengths and labels are), what (flip a byte, cut there, insert bytes) and with what.
EDITS = st.lists(st.tuples(st.booleans(), st.integers(0, 200),
                           st.sampled_from(["flip", "cut", "insert"]),
                           st.binary(min_size=1, max_size=8)), min_size=1, max_size=4)


def damaged(data: bytes, edits: list[tuple[bool, int, str, bytes]]) -> bytes:
    buf = bytearray(data)
    for from_head, offset, op, value in edits:
        if not buf:
            break
        at = min(offset, len(buf) - 1) if from_head else max(len(buf) - 1 - offset, 0)
        if op == "flip":
            buf[at] = value[0]
        elif op == "cut":
            del buf[at:]
        else:
            buf[at:at] = value
    return bytes(buf)


@FUZZ
@given(EDITS)
def test_damaged_large_frames_get_a_reason_and_the_trunk_stays_finite(edits):
    endpoint, session, trunk = LARGE_TARGET
    acts, labels = LARGE_BATCH
    frame = request(next(SEQ), "forward", activations=encode_tensor(acts),
                    labels=encode_tensor(labels)).SerializeToString()
    assert len(frame) >= SMALL_FRAME_BYTES  # read as a Frame, not by protobuf
    reply = pb.Reply.FromString(endpoint.handle(session, damaged(frame, edits), peer="fuzz"))
    assert reply.WhichOneof("kind") in ("refusal", "gradient")
    if reply.WhichOneof("kind") == "refusal":
        assert reply.refusal.reason != pb.Refusal.INTERNAL, reply.refusal.detail
    assert all(torch.isfinite(p).all() for p in trunk.model.parameters())


def test_the_generated_code_is_what_trunk_proto_compiles_to(tmp_path):
    """trunk_pb2.py is kept with the .proto; regenerating it must change nothing."""
    from pathlib import Path

    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    proto = "splitlearn/dataplane/trunk.proto"
    assert protoc.main(["protoc", f"-I{root}", f"--python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", str(root / proto)]) == 0
    for generated in ("trunk_pb2.py", "trunk_pb2.pyi"):
        fresh = (tmp_path / "splitlearn" / "dataplane" / generated).read_text()
        assert fresh == (root / "splitlearn" / "dataplane" / generated).read_text(), (
            f"{generated} is stale: python -m grpc_tools.protoc -I. --python_out=. "
            f"--pyi_out=. {proto}"
        )


# --- adversarial error-feedback fields, against every protocol's trunk --------------------

FEEDBACK_PROTOCOLS = ("splitfed_v2", "splitfed_v1", "sequential", "ushaped", "local_loss", "sglr")


#: Each protocol's trunk with top-k both ways and error feedback.
FEEDBACK_TARGETS = {p: fuzz_endpoint(p, compression=CompressionConfig(
    uplink="topk", downlink="topk", error_feedback=True)) for p in FEEDBACK_PROTOCOLS}

#: What each protocol's device sends a training batch as.
TRAINING_KIND = {"local_loss": "smashed"}


def int64_ids(values: list[int]) -> pb.Tensor:
    return encode_tensor(torch.tensor(values, dtype=torch.int64)).to_proto()


@FUZZ
@given(protocol=st.sampled_from(FEEDBACK_PROTOCOLS), batch=st.integers(1, 4),
       data=st.data(), seed=st.integers(0, 2**16))
def test_any_error_feedback_fields_get_a_reason_and_the_trunk_stays_finite(
        protocol, batch, data, seed):
    """A well-formed batch for the cut with any example ids (negative, huge, repeated, too
    few, or any tensor at all), any version and lineage, and for U-shaped any backward after
    it: accepted or refused with a reason, never a bug's; the sessions persist across
    examples, so versions and references build up as a device's would."""
    endpoint, session, trunk = FEEDBACK_TARGETS[protocol]
    ids = data.draw(st.one_of(
        st.lists(st.integers(0, 8), min_size=batch, max_size=batch).map(int64_ids),
        st.lists(st.integers(-2**63, 2**63 - 1), min_size=batch, max_size=batch).map(int64_ids),
        st.lists(st.integers(0, 8), max_size=6).map(int64_ids),
        tensors,
    ), label="example_ids")
    version = data.draw(st.integers(0, 3) | st.integers(0, 2**64 - 1), label="version")
    lineage = data.draw(st.integers(0, 3) | st.integers(0, 2**64 - 1), label="lineage")
    generator = torch.Generator().manual_seed(seed)
    acts = torch.rand(batch, *trunk.cut_shape(1), generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)
    kind = TRAINING_KIND.get(protocol, "forward")
    # U-shaped labels stay on the device.
    fields = {} if protocol == "ushaped" else {"labels": encode_tensor(labels)}
    frame = request(next(SEQ), kind, activations=encode_tensor(acts), **fields)
    part = getattr(frame, kind)
    part.example_ids.CopyFrom(ids)
    part.feedback_version, part.feedback_lineage = version, lineage
    frames = [frame]
    if protocol == "ushaped":  # the device's d loss / d features, of any batch
        rows = data.draw(st.integers(1, 4), label="backward rows")
        frames.append(request(next(SEQ), "backward", grad=encode_tensor(
            torch.randn(rows, *trunk.cut_shape(3), generator=generator))))
    for sent in frames:
        reply = pb.Reply.FromString(endpoint.handle(session, sent.SerializeToString(), peer="f"))
        if reply.WhichOneof("kind") == "refusal":
            assert reply.refusal.reason != pb.Refusal.INTERNAL, reply.refusal.detail
    if protocol == "local_loss":
        # Local loss trains what it acknowledged on a thread of its own: drain it, as a
        # round's end does (no thread outlives the example, and what it trained is checked).
        endpoint.handlers[protocol].finish_round([session.grant.client])
    assert all(torch.isfinite(p).all() for p in trunk.model.parameters())
