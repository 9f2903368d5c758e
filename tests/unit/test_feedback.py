"""Per-example error feedback at the cut: the store against a slow reference, the two rules'
invariants, device and trunk agreeing bit for bit, and every refusal of a bad frame."""

from __future__ import annotations

import time
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from protocols import protocol_named
from protocols.ushaped import UShapedOptions
from server.trunk import Trunk
from splitlearn.config import CompressionConfig, DataPlaneConfig, RunSpec
from splitlearn.dataplane import TokenRegistry, TrunkEndpoint, TrunkRejected
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import decode_tensor, encode_tensor, encoder, request
from splitlearn.dataplane.feedback import (
    ExampleRows,
    FeedbackBook,
    FeedbackFull,
    ReferenceFeedback,
    ResidualFeedback,
    StaleFeedback,
)
from tests.conftest import digits_like_model
from tests.helpers import RecordingSends, send_raw

MAX = 1 << 22


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
CUT = 1
TOPK = CompressionConfig(uplink="topk", downlink="topk", topk_fraction=0.1, error_feedback=True)


def wire(tensor: torch.Tensor, method: str = "topk") -> torch.Tensor:
    """What a receiver decodes from the bytes of ``tensor`` encoded by ``method``."""
    frame = encode_tensor(tensor, method, topk_fraction=0.1)
    return decode_tensor(pb.Tensor.FromString(frame.SerializeToString()), name="t", max_bytes=MAX)


# --- the store ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=6, unique=True),
                min_size=1, max_size=12),
       st.integers(0, 2**16))
def test_rows_are_what_a_dict_of_rows_holds(batches, seed):
    """Any sequence of stores reads back as a plain dict of rows (zeros where never stored)."""
    g = torch.Generator().manual_seed(seed)
    store, reference = ExampleRows(max_bytes=MAX), {}
    for ids in batches:
        values = torch.randn(len(ids), 2, 3, generator=g)
        store.store(torch.tensor(ids), values)
        reference.update({i: v for i, v in zip(ids, values, strict=True)})
        probe = torch.tensor(sorted({*ids, 41, 0}))
        expected = torch.stack([reference.get(i, torch.zeros(2, 3)) for i in probe.tolist()])
        assert torch.equal(store.rows(probe, (2, 3)), expected)
    assert len(store) == len(reference)


def test_rows_beyond_the_bound_are_refused_and_nothing_changes():
    store = ExampleRows(max_bytes=10 * 4 * 6)  # ten rows of 6 floats
    store.store(torch.arange(8), torch.ones(8, 6))
    with pytest.raises(FeedbackFull, match="11 examples of 24 bytes exceed"):
        store.admit(torch.tensor([0, 8, 9, 10]), (6,))
    assert len(store) == 8 and store.nbytes <= 10 * 24
    assert torch.equal(store.rows(torch.tensor([8]), (6,)), torch.zeros(1, 6))
    with pytest.raises(FeedbackFull, match="shape"):
        store.admit(torch.tensor([1]), (3, 2))


# --- the two rules ------------------------------------------------------------------


def test_an_unchanging_row_reaches_its_value_through_topk_differences():
    """Top-k of 10% sends a tenth of a row; its differences send the rest on later visits."""
    device, trunk = ReferenceFeedback(max_bytes=MAX), ReferenceFeedback(max_bytes=MAX)
    ids = torch.tensor([3, 7])
    x = torch.randn(2, 4, 5, 5, generator=torch.Generator().manual_seed(0))
    errors = []
    for _ in range(12):
        frame, agreed = device.encode(ids, x, lambda t: (t, wire(t)))
        assert torch.equal(trunk.reconstruct(ids, wire(frame)), agreed)
        device.commit(ids, agreed)
        trunk.commit(ids, agreed)
        errors.append(float((agreed - x).norm() / x.norm()))
    assert errors[0] > 0.5  # plain top-k: most of the row missing
    assert all(b < a for a, b in zip(errors[:9], errors[1:9], strict=False))
    assert errors[-1] < 2**-7  # bfloat16's rounding of the last differences


def test_downlink_feedback_delivers_every_gradient_in_the_end():
    """EF's invariant: what was sent plus the residual is the sum of the true gradients."""
    g = torch.Generator().manual_seed(1)
    feedback = ResidualFeedback(max_bytes=MAX)
    ids = torch.tensor([5, 2, 9])
    true_sum, sent_sum = torch.zeros(3, 40), torch.zeros(3, 40)

    def round_trip(t: torch.Tensor):
        frame = encode_tensor(t, "topk", topk_fraction=0.1)
        return frame, decode_tensor(frame, name="grad", max_bytes=MAX)

    for _ in range(6):
        grad = torch.randn(3, 40, generator=g)
        frame = feedback.compress(ids, grad, round_trip)
        true_sum += grad
        sent_sum += decode_tensor(pb.Tensor.FromString(frame.SerializeToString()), name="g",
                                  max_bytes=MAX)
    residual = feedback.residuals.rows(ids, (40,))
    assert torch.allclose(sent_sum + residual, true_sum, atol=1e-5)
    assert residual.abs().max() > 0  # something is still owed: the test is not vacuous


# --- device and trunk over the data plane -----------------------------------------


def dataplane(compression: CompressionConfig, **kw) -> DataPlaneConfig:
    return DataPlaneConfig(max_frame_bytes=1 << 20, max_batch=64, compression=compression, **kw)


def batch(seed: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    acts = torch.relu(torch.randn(len(ids), 32, 8, 8, generator=g))
    return acts, torch.randint(0, 10, (len(ids),), generator=g), torch.tensor(ids)


def across_rounds(server, compression: CompressionConfig):
    """Two rounds, each a fresh gRPC channel holding what the device kept from the one before.

    Yields the round's number, its batches (example ids; the second round revisits the
    first's examples) and the channel, closed once the caller is done with it.
    """
    kept = None  # what the device keeps in its context between rounds
    for server_round, batches in enumerate([[[0, 1, 2, 3], [4, 5, 0, 1]],
                                            [[2, 3, 4, 5], [1, 0, 9, 8]]], start=1):
        channel = server.channel(server.token(CUT, server_round=server_round),
                                 compression=compression)
        if kept is not None:
            channel.feedback = ReferenceFeedback.from_state(kept, max_bytes=MAX)
        yield server_round, batches, channel
        kept = channel.feedback.state() if channel.feedback is not None else None
        channel.close()


@pytest.mark.parametrize("compression", [
    TOPK, CompressionConfig(uplink="int8", downlink="none", error_feedback=True),
    CompressionConfig(uplink="none", downlink="topk", error_feedback=True),
])
def test_device_and_trunk_hold_the_same_references_bit_for_bit_across_rounds(
        compression, trunk_server_factory):
    server = trunk_server_factory(digits_like_model(), dataplane=dataplane(compression))
    for _, batches, channel in across_rounds(server, compression):
        for seed, ids in enumerate(batches):
            acts, labels, example_ids = batch(seed, ids)
            grad, _, _ = channel.forward(acts, labels, example_ids=example_ids)
            assert grad.shape == acts.shape
    memory = server.handler.feedback["c0"]
    assert (memory.uplink is None) == (channel.feedback is None) == (
        compression.uplink == "none")
    assert (memory.downlink is None) == (compression.downlink == "none")
    if memory.uplink is not None:
        assert memory.uplink.version == channel.feedback.version == 4  # no reset between
        every = torch.arange(10)
        mine = channel.feedback.references.rows(every, (32, 8, 8))
        assert torch.equal(memory.uplink.references.rows(every, (32, 8, 8)), mine)
        assert len(memory.uplink.references) == 8


def test_a_device_behind_the_trunk_is_refused_as_stale_and_starts_over_from_zero(
        trunk_server_factory):
    """A round the device did not finish moved the trunk's references, not the device's."""
    server = trunk_server_factory(digits_like_model(), dataplane=dataplane(TOPK))
    first = server.local_channel(server.token(CUT), compression=TOPK)
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    first.forward(acts, labels, example_ids=ids)
    before_last = first.feedback.state()  # kept before the batch whose reply was lost
    first.forward(acts * 2, labels, example_ids=ids)
    assert server.handler.feedback["c0"].uplink.version == 2
    channel = server.local_channel(server.token(CUT, server_round=2), compression=TOPK)
    channel.feedback = ReferenceFeedback.from_state(before_last, max_bytes=MAX)
    sent = RecordingSends(channel)
    channel.forward(acts, labels, example_ids=ids)
    assert sent.versions == [1, 0] and channel.restarts == 1  # stale, then sent from zero
    memory = server.handler.feedback["c0"].uplink
    assert memory.version == channel.feedback.version == 1
    assert torch.equal(memory.references.rows(ids, (32, 8, 8)),
                       channel.feedback.references.rows(ids, (32, 8, 8)))
    assert server.trunk.steps == 3


#: Bytes of one uplink reference at cut 1 of the digits SmallCNN.
ROW = 32 * 8 * 8 * 4


def budgeted(factory, rows: float, clients: str):
    """A trunk keeping uplink references for ``rows`` rows in all, and a channel per client."""
    compression = CompressionConfig(uplink="topk", downlink="none", error_feedback=True,
                                    feedback_max_mib=rows * ROW / 2**20)
    server = factory(digits_like_model(), dataplane=dataplane(compression))
    return server, {c: server.local_channel(server.token(CUT, client=c), compression=TOPK)
                    for c in clients}


def test_the_trunk_drops_the_least_recently_served_clients_past_its_budget(trunk_server_factory):
    """Three clients' rows in a budget for two: the first is dropped, and starts over."""
    server, channels = budgeted(trunk_server_factory, 8.5, "abc")
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    for channel in channels.values():
        channel.forward(acts, labels, example_ids=ids)
    book = server.handler.feedback
    assert "a" not in book and "b" in book and "c" in book
    assert book.nbytes <= 8.5 * ROW
    sent = RecordingSends(channels["a"])
    channels["a"].forward(acts, labels, example_ids=ids)
    assert sent.versions == [1, 0] and book["a"].uplink.version == 1


def test_a_client_flooding_ids_drops_its_own_rows_and_is_told_so(trunk_server_factory):
    """Two devices hold 4 rows each in a budget for 12.5; a third sends new ids every batch.
    Past its share it loses its own rows, not theirs, and the reply tells it to start over
    (so it sends at version 0, without a stale refusal first)."""
    server, channels = budgeted(trunk_server_factory, 12.5, "abx")
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    for name in ("a", "b"):
        channels[name].forward(acts, labels, example_ids=ids)
    book, flood = server.handler.feedback, channels["x"]
    flood.forward(acts, labels, example_ids=ids + 100)
    assert "x" in book and flood.feedback.version == 1
    flood.forward(acts, labels, example_ids=ids + 200)  # 8 rows: past 12.5 / 3
    assert "x" not in book and flood.feedback.version == 0 and len(flood.feedback.references) == 0
    assert "a" in book and "b" in book and book.nbytes <= 12.5 * ROW
    sent = RecordingSends(flood)
    flood.forward(acts, labels, example_ids=ids + 300)
    assert sent.versions == [0]  # started over in step with the trunk: no stale refusal
    for name in ("a", "b"):  # the others' references are where they left them
        sent = RecordingSends(channels[name])
        channels[name].forward(acts, labels, example_ids=ids)
        assert sent.versions == [1] and book[name].uplink.version == 2
    assert server.trunk.steps == 7


def test_memory_moved_to_another_trunk_carries_on_where_it_was(trunk_server_factory):
    """What trunk workers do with a client dealt elsewhere: the next batch is not stale, and
    the new trunk trains on the references and residuals the first one left."""
    first, second = (trunk_server_factory(digits_like_model(), dataplane=dataplane(TOPK))
                     for _ in range(2))
    channel = first.local_channel(first.token(CUT, client="a"), compression=TOPK)
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    for _ in range(2):
        channel.forward(acts, labels, example_ids=ids)
    left = first.handler.feedback["a"]
    second.handler.feedback.adopt("a", first.handler.feedback.release("a"))
    assert "a" not in first.handler.feedback and first.handler.feedback.nbytes == 0
    moved = second.handler.feedback["a"]
    assert moved.uplink.version == 2 and second.handler.feedback.nbytes == moved.nbytes
    for rows, kept in ((moved.uplink.references, left.uplink.references),
                       (moved.downlink.residuals, left.downlink.residuals)):
        assert torch.equal(rows.rows(ids, (32, 8, 8)), kept.rows(ids, (32, 8, 8)))
    there = second.local_channel(second.token(CUT, client="a"), compression=TOPK)
    there.feedback = channel.feedback
    sent = RecordingSends(there)
    there.forward(acts, labels, example_ids=ids)
    assert sent.versions == [2] and moved.uplink.version == 3
    assert first.handler.feedback.release("a") is None  # nothing held: nothing to move


def test_a_new_cut_starts_the_references_over(trunk_server_factory):
    """An adaptive planner moved the device's cut: rows of the old shape are not reused."""
    server = trunk_server_factory(digits_like_model(), dataplane=dataplane(TOPK))
    model = digits_like_model()
    channel = server.local_channel(server.token(CUT), compression=TOPK)
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    channel.forward(acts, labels, example_ids=ids)
    deeper = server.local_channel(server.token(2, server_round=2), compression=TOPK)
    deeper.feedback = ReferenceFeedback.from_state(channel.feedback.state(), max_bytes=MAX)
    with torch.no_grad():
        at_two = model.stages[1](model.stages[0](torch.rand(4, 1, 8, 8)))
    sent = RecordingSends(deeper)
    deeper.forward(at_two, labels, example_ids=ids)
    assert sent.versions == [0]
    assert server.handler.feedback["c0"].uplink.references.holds(tuple(at_two.shape[1:]))


def test_a_device_keeps_its_references_for_the_next_round_at_the_same_cut_only(
        trunk_server_factory):
    """Kept in the node's Flower context with the cut they are at: the next round at that cut
    carries on at their version; at another cut (even one of the same shape) it starts over,
    and the trunk with it, without a stale refusal first."""
    from flwr.app import Context, RecordDict

    from clients.app import _keep_feedback, _restore_feedback

    server = trunk_server_factory(digits_like_model(), dataplane=dataplane(TOPK))
    spec = RunSpec(compression=TOPK)
    node = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    first = server.local_channel(server.token(CUT), compression=TOPK)
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    first.forward(acts, labels, example_ids=ids)
    _keep_feedback(node, first, cut=CUT)
    same = server.local_channel(server.token(CUT, server_round=2), compression=TOPK)
    _restore_feedback(node, same, spec, cut=CUT)
    assert (same.feedback.version, same.feedback.lineage) == (1, first.feedback.lineage)
    moved = server.local_channel(server.token(CUT, server_round=3), compression=TOPK)
    _restore_feedback(node, moved, spec, cut=CUT + 1)  # as if the planner moved it
    assert moved.feedback.version == 0 and len(moved.feedback.references) == 0
    sent = RecordingSends(moved)
    moved.forward(acts, labels, example_ids=ids)  # the trunk's rows are the same shape here
    assert sent.versions == [0] and moved.restarts == 0
    assert server.handler.feedback["c0"].uplink.version == 1



def test_a_device_does_not_keep_references_moved_for_a_frame_never_acknowledged(
        trunk_server_factory):
    """Local loss: a round whose last frame was lost with the link leaves nothing kept (the
    next round starts from zero) and replaces what an earlier round kept; a round whose
    frames were all acknowledged keeps its references at their version."""
    from flwr.app import Context, RecordDict

    from clients.app import FEEDBACK_STATE_KEY, _keep_feedback, _restore_feedback

    server = local_loss_server(trunk_server_factory)
    spec = RunSpec(compression=TOPK)
    node = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    settled = server.local_channel(server.token(CUT), compression=TOPK)
    stream(settled, [[0, 1], [2, 3]])
    assert settled.feedback_settled
    _keep_feedback(node, settled, cut=CUT)
    assert FEEDBACK_STATE_KEY in node.state
    lost = server.local_channel(server.token(CUT, server_round=2), compression=TOPK)
    _restore_feedback(node, lost, spec, cut=CUT)
    assert lost.feedback.version == 2
    assert not stream_until_vanished(lost, [[0, 1], [2, 3]], vanish=1, seed=5)
    assert not lost.feedback_settled and lost.feedback.version == 4
    _keep_feedback(node, lost, cut=CUT)
    assert FEEDBACK_STATE_KEY not in node.state
    fresh = server.local_channel(server.token(CUT, server_round=3), compression=TOPK)
    assert _restore_feedback(node, fresh, spec, cut=CUT) == 0
    assert fresh.feedback.version == 0 and fresh.feedback.lineage != lost.feedback.lineage

def test_references_survive_the_devices_context_and_a_smaller_bound_starts_over():
    feedback = ReferenceFeedback(max_bytes=MAX)
    ids = torch.tensor([4, 1, 7])
    feedback.commit(ids, torch.randn(3, 2, 5))
    feedback.commit(ids[:2], torch.randn(2, 2, 5))
    back = ReferenceFeedback.from_state(feedback.state(), max_bytes=MAX)
    assert (back.version, back.lineage) == (2, feedback.lineage)
    assert ReferenceFeedback(max_bytes=MAX).lineage != feedback.lineage  # drawn per start
    unnamed = {k: v for k, v in feedback.state().items() if k != "lineage"}  # kept before it
    assert ReferenceFeedback.from_state(unnamed, max_bytes=MAX).version == 0
    assert torch.equal(back.references.rows(ids, (2, 5)), feedback.references.rows(ids, (2, 5)))
    smaller = ReferenceFeedback.from_state(feedback.state(), max_bytes=2 * 40)
    assert smaller.version == 0 and len(smaller.references) == 0


def test_refused_frames_name_the_reason_and_change_nothing(trunk_server_factory):
    server = trunk_server_factory(digits_like_model(), dataplane=dataplane(TOPK))
    channel = server.local_channel(server.token(CUT), compression=TOPK)
    before = {k: v.clone() for k, v in server.trunk.model.state_dict().items()}
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    frame = encoder(TOPK, "uplink")(acts)
    cases = {
        "frame carries no example_ids": {},
        "repeat an example": {"example_ids": encode_tensor(torch.tensor([0, 1, 1, 3]))},
        "must be >= 0": {"example_ids": encode_tensor(torch.tensor([0, 1, -2, 3]))},
        "example_ids have dtype torch.float32": {"example_ids": encode_tensor(ids.float())},
        "expected int64 of shape (4,)": {"example_ids": encode_tensor(ids[:3])},
    }
    for reason, extra in cases.items():
        data = request(channel.next_seq(), "forward", activations=frame,
                       labels=encode_tensor(labels), **extra).SerializeToString()
        reply = send_raw(channel, data)
        assert reply.WhichOneof("kind") == "refusal" and reason in reply.refusal.detail
    assert server.trunk.steps == 0
    after = server.trunk.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "c0" not in server.handler.feedback  # no reference was even made


def test_a_difference_beyond_the_bound_once_added_to_its_reference_is_refused(trunk_server_factory):
    """A device that sends its own differences cannot push the trunk's input past the bound."""
    server = trunk_server_factory(digits_like_model(),
                                  dataplane=dataplane(TOPK, max_abs_value=100.0))
    channel = server.local_channel(server.token(CUT), compression=TOPK)
    _, labels, ids = batch(0, [0, 1, 2, 3])
    channel.forward(torch.full((4, 32, 8, 8), 60.0), labels, example_ids=ids)
    data = request(channel.next_seq(), "forward",
                   activations=encode_tensor(torch.full((4, 32, 8, 8), 99.0)),
                   labels=encode_tensor(labels), example_ids=encode_tensor(ids),
                   feedback_version=channel.feedback.version,
                   feedback_lineage=channel.feedback.lineage)
    reply = send_raw(channel, data.SerializeToString())
    assert reply.refusal.reason == pb.Refusal.OUT_OF_RANGE, reply
    assert "|x| = 159" in reply.refusal.detail
    assert server.trunk.steps == 1


def test_a_client_past_the_trunks_memory_bound_is_refused_before_it_steps(trunk_server_factory):
    compression = CompressionConfig(uplink="topk", downlink="topk", error_feedback=True,
                                    feedback_max_mib=12 * 8192 / 2**20)  # six rows each way
    server = trunk_server_factory(digits_like_model(), dataplane=dataplane(compression))
    token = server.token(CUT)
    channel = server.local_channel(token, compression=CompressionConfig(
        uplink="topk", downlink="topk", error_feedback=True))  # the device's bound is larger
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    channel.forward(acts, labels, example_ids=ids)
    with pytest.raises(TrunkRejected, match="TOO_LARGE: error feedback: 8 examples of 8192"):
        channel.forward(acts, labels, example_ids=ids + 4)
    assert server.trunk.steps == 1


def test_ids_to_a_trunk_without_error_feedback_are_refused(trunk_server_factory):
    server = trunk_server_factory(digits_like_model())
    channel = server.local_channel(server.token(CUT))
    acts, labels, ids = batch(0, [0, 1])
    data = request(1, "forward", activations=encode_tensor(acts),
                   labels=encode_tensor(labels),
                   example_ids=encode_tensor(ids)).SerializeToString()
    reply = send_raw(channel, data)
    assert reply.refusal.reason == pb.Refusal.BAD_TENSOR
    assert "without error feedback" in reply.refusal.detail
    assert server.trunk.steps == 0


def test_a_device_without_ids_is_stopped_before_sending(trunk_server_factory):
    server = trunk_server_factory(digits_like_model(), dataplane=dataplane(TOPK))
    channel = server.local_channel(server.token(CUT), compression=TOPK)
    acts, labels, _ = batch(0, [0, 1])
    with pytest.raises(ValueError, match="example_ids"):
        channel.forward(acts, labels)


def test_a_device_counts_its_references_in_its_training_memory():
    from clients.steps.split import SplitStep
    from clients.steps.ushaped import UShapedStep
    from tests.helpers import plain_spec

    step = SplitStep(digits_like_model(), plain_spec(0.1), cut=CUT)
    row = 32 * 8 * 8 * 4  # the SmallCNN's float32 row at cut 1
    assert step.kept_bytes(144, TOPK) == 144 * row
    downlink_only = CompressionConfig(downlink="topk", error_feedback=True)
    assert step.kept_bytes(144, downlink_only) == 0  # the residuals are the trunk's
    ushaped = UShapedStep(digits_like_model(), RunSpec(strategy=UShapedOptions()), cut=CUT)
    features = 144 * 128 * 4  # the hidden layer's rows, its default tail cut
    assert ushaped.kept_bytes(144, TOPK) == 144 * row + features
    assert ushaped.kept_bytes(144, downlink_only) == features


@pytest.mark.parametrize(("bulk", "compression", "examples", "kept"), [
    (False, TOPK, 144, 2 * 144),  # its window (32 batches of 32) holds all of a round
    (False, TOPK, 5000, 32 * 32),
    (False, CompressionConfig(uplink="topk"), 5000, 0),  # no feedback: nothing sent again
    (True, CompressionConfig(), 144, 2 * 144),  # bulk: the whole round, for the reply
])
def test_local_loss_counts_the_batches_it_keeps_after_sending_them(bulk, compression,
                                                                    examples, kept):
    """Sent batches kept until acknowledged (to be sent again if stale) or, in bulk mode,
    until the Flower reply carries them: a float32 row and an int64 label each."""
    from clients.steps.local_loss import LocalLossStep
    from protocols.local_loss import LocalLossOptions

    options = LocalLossOptions(batch_size=32, local_epochs=2, bulk=bulk)
    local = LocalLossStep(digits_like_model(), RunSpec(strategy=options), cut=CUT)
    row = 32 * 8 * 8 * 4
    references = examples * row * compression.uplink_feedback
    assert local.kept_bytes(examples, compression) == references + kept * (row + 8)


# --- U-shaped ------------------------------------------------------------------------


def ushaped_server(factory, compression: CompressionConfig):
    return factory(digits_like_model(), protocol="ushaped", options=UShapedOptions(), lr=0.1,
                   dataplane=dataplane(compression))


def ushaped_batch(channel, seed: int, ids: list[int]) -> torch.Tensor:
    """One U-shaped batch through ``channel``: forward, then d loss / d features back."""
    acts, labels, example_ids = batch(seed, ids)
    features = channel.forward_features(acts, example_ids=example_ids).requires_grad_(True)
    nn.functional.cross_entropy(nn.functional.linear(features, torch.ones(10, 128)),
                                labels).backward()
    channel.backward(features.grad)
    return features.detach()


@pytest.mark.parametrize("compression", [
    TOPK, CompressionConfig(uplink="int8", downlink="topk", error_feedback=True),
    CompressionConfig(uplink="topk", downlink="none", error_feedback=True),
])
def test_ushaped_device_and_trunk_agree_on_activations_and_features_across_rounds(
        compression, trunk_server_factory):
    """Over gRPC, two rounds: the references of what each side sent agree bit for bit, and
    the features the device trains its tail on are the trunk's references of them."""
    server = ushaped_server(trunk_server_factory, compression)
    kept: dict[str, dict] = {}
    for server_round, batches in enumerate([[[0, 1, 2, 3], [4, 5, 0, 1]],
                                            [[2, 3, 4, 5], [1, 0, 9, 8]]], start=1):
        channel = server.channel(server.token(CUT, server_round=server_round),
                                 compression=compression)
        for name, state in kept.items():
            setattr(channel, name, ReferenceFeedback.from_state(state, max_bytes=MAX))
        for seed, ids in enumerate(batches):
            features = ushaped_batch(channel, seed, ids)
        kept = {name: getattr(channel, name).state() for name in ("feedback", "feature_feedback")
                if getattr(channel, name) is not None}
        channel.close()
    memory = server.handler.feedback["c0"]
    every = torch.arange(10)
    pairs = [(memory.uplink, channel.feedback, (32, 8, 8)),
             (memory.features, channel.feature_feedback, (128,))]
    for trunk_side, device_side, shape in pairs:
        assert (trunk_side is None) == (device_side is None)
        if trunk_side is not None:
            assert trunk_side.version == device_side.version == 4  # no reset between
            assert torch.equal(trunk_side.references.rows(every, shape),
                               device_side.references.rows(every, shape))
    assert (memory.features is None) == (compression.downlink == "none")
    if memory.features is not None:  # the last batch's features: the references of its ids
        last = torch.tensor(batches[-1])
        assert torch.equal(features, memory.features.references.rows(last, (128,)))
    assert server.trunk.steps == 4 and server.handler.pending_sessions == 0


def test_ushaped_stale_references_start_over_and_a_dropped_client_is_told(trunk_server_factory):
    # Per example: the activations' references and the gradients' residuals (8 KiB each),
    # the features' references (512 bytes). Three clients of 4 examples fit, not one of 8.
    compression = CompressionConfig(uplink="topk", downlink="topk", error_feedback=True,
                                    feedback_max_mib=240_000 / 2**20)
    server = ushaped_server(trunk_server_factory, compression)
    channels = {c: server.local_channel(server.token(CUT, client=c), compression=compression)
                for c in ("a", "b", "x")}
    for name in ("a", "b"):
        ushaped_batch(channels[name], 0, [0, 1, 2, 3])
    flood = channels["x"]
    ushaped_batch(flood, 1, [100, 101, 102, 103])
    ushaped_batch(flood, 1, [200, 201, 202, 203])  # past its share: its own rows go
    assert "x" not in server.handler.feedback and flood.feedback_version == 0
    assert {"a", "b"} <= set(server.handler.feedback._clients)
    # A device whose references the trunk no longer has (here: it claims more batches).
    behind = channels["a"]
    behind.feedback.version = behind.feature_feedback.version = 7
    sent = RecordingSends(behind)
    ushaped_batch(behind, 2, [0, 1, 2, 3])
    assert sent.versions == [7, 0] and server.handler.feedback["a"].version == 1
    assert server.trunk.steps == 5


def test_ushaped_refuses_ids_without_error_feedback_and_needs_them_with_it(
        trunk_server_factory):
    plain = ushaped_server(trunk_server_factory, CompressionConfig())
    channel = plain.local_channel(plain.token(CUT))
    acts, _, ids = batch(0, [0, 1])
    data = request(1, "forward", activations=encode_tensor(acts),
                   example_ids=encode_tensor(ids)).SerializeToString()
    reply = send_raw(channel, data)
    assert reply.refusal.reason == pb.Refusal.BAD_TENSOR
    assert "without error feedback" in reply.refusal.detail
    server = ushaped_server(trunk_server_factory, TOPK)
    channel = server.local_channel(server.token(CUT), compression=TOPK)
    with pytest.raises(ValueError, match="example_ids"):
        channel.forward_features(acts)
    data = request(1, "forward", activations=encode_tensor(acts)).SerializeToString()
    reply = send_raw(channel, data)
    assert reply.refusal.reason == pb.Refusal.BAD_TENSOR and "example_ids" in reply.refusal.detail
    assert server.trunk.steps == plain.trunk.steps == 0


# --- local loss: one way, a window of frames in flight ------------------------------------


def local_loss_server(factory, compression: CompressionConfig = TOPK):
    return factory(digits_like_model(), protocol="local_loss", dataplane=dataplane(compression))


def stream(channel, batches: list[list[int]], *, seed: int = 0) -> None:
    """Send one smashed batch per id list without waiting, then collect every ack."""
    for n, ids in enumerate(batches):
        acts, labels, example_ids = batch(seed + n, ids)
        channel.send_smashed(acts, labels, example_ids=example_ids)
    channel.flush()


def trained(server, client: str = "c0") -> int:
    """Batches the local-loss trunk trained for ``client``, once its queue is drained."""
    server.handler.finish_round([client])
    return server.handler.trained[client]


def assert_same_references(book: FeedbackBook, channel, client: str = "c0") -> None:
    every = torch.arange(10)
    memory = book[client].uplink
    assert memory.version == channel.feedback.version
    assert torch.equal(memory.references.rows(every, (32, 8, 8)),
                       channel.feedback.references.rows(every, (32, 8, 8)))


@pytest.mark.parametrize("compression", [
    TOPK, CompressionConfig(uplink="int8", downlink="none", error_feedback=True),
])
def test_local_loss_device_and_trunk_hold_the_same_references_across_rounds(
        compression, trunk_server_factory):
    """Over gRPC, two rounds of frames in flight: the references move as frames are sent
    and as they are queued, and agree bit for bit; the trunk trains on every batch."""
    server = local_loss_server(trunk_server_factory, compression)
    assert server.handler.feedback.downlink is False  # nothing comes down to feed back
    for server_round, batches, channel in across_rounds(server, compression):
        sent = RecordingSends(channel)
        stream(channel, batches, seed=2 * server_round)
        assert sent.versions == [2 * server_round - 2, 2 * server_round - 1]
    assert channel.feedback.version == 4  # no reset between the rounds
    assert_same_references(server.handler.feedback, channel)
    assert len(server.handler.feedback["c0"].uplink.references) == 8
    assert trained(server) == 4


def test_a_local_loss_device_behind_the_trunk_sends_its_whole_window_again_from_zero(
        trunk_server_factory):
    """The device lost a round's last two batches (kept its references after the first).
    Its next three frames are in flight before the first is refused as stale; the third
    carries the trunk's version (3) by chance, and must not be taken for current."""
    server = local_loss_server(trunk_server_factory)
    first = server.local_channel(server.token(CUT), compression=TOPK)
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    first.send_smashed(acts, labels, example_ids=ids)
    lost = first.feedback.state()  # what the device kept: version 1
    stream(first, [[0, 1, 2, 3], [0, 1, 2, 3]], seed=1)
    assert server.handler.feedback["c0"].uplink.version == 3
    channel = server.local_channel(server.token(CUT, server_round=2), compression=TOPK)
    channel.feedback = ReferenceFeedback.from_state(lost, max_bytes=MAX)
    sent = RecordingSends(channel)
    stream(channel, [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 8, 9]], seed=5)
    assert sent.versions == [1, 2, 3, 0, 1, 2]  # all three refused, then sent from zero
    assert channel.feedback.version == 3 and channel.in_flight == 0
    assert channel.restarts == 1  # once: the frames behind the first were already stale
    assert_same_references(server.handler.feedback, channel)
    assert trained(server) == 6  # 3, then the 3 sent again; none of the stale ones


def test_a_local_loss_client_past_its_share_is_told_in_the_ack_and_starts_over(
        trunk_server_factory):
    """As for split sessions: the flooder loses its own rows, its frames behind the one
    that told it are refused as stale and sent again from the new references."""
    compression = CompressionConfig(uplink="topk", downlink="none", error_feedback=True,
                                    feedback_max_mib=12.5 * ROW / 2**20)
    server = local_loss_server(trunk_server_factory, compression)
    channels = {c: server.local_channel(server.token(CUT, client=c), compression=compression)
                for c in "abx"}
    for name in ("a", "b"):
        stream(channels[name], [[0, 1, 2, 3]])
    flood = channels["x"]
    sent = RecordingSends(flood)
    stream(flood, [[100, 101, 102, 103], [200, 201, 202, 203], [300, 301, 302, 303]])
    # The second frame took it past 12.5 / 3 rows: dropped, and told so. The third was
    # encoded against references the trunk no longer has: stale, and sent again.
    assert sent.versions == [0, 1, 2, 0]
    assert flood.feedback.version == 1 and server.handler.feedback["x"].uplink.version == 1
    assert {"a", "b"} <= set(server.handler.feedback._clients)
    assert server.handler.feedback.nbytes <= 12.5 * ROW
    assert trained(server, "x") == 3


@dataclass(frozen=True)
class Round:
    """One round of a device streaming smashed data with error feedback (see below)."""

    start: int | None  # the kept state it starts from: None, the latest; else an older one
    dropped: bool  # the trunk dropped the client's memory before the round
    window: int
    batches: list[list[int]]  # each batch's example ids
    vanish: int  # its last ``vanish`` frames never reach the trunk, and the device is gone


ROUNDS = st.lists(st.builds(
    Round, st.one_of(st.none(), st.integers(0, 5)), st.booleans(), st.integers(1, 4),
    st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
             min_size=1, max_size=5),
    st.integers(0, 2)), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(ROUNDS)
# Back to version 1 with the trunk at 3, and three frames in flight: the third carries 3.
@example([Round(None, False, 1, [[0]], 0), Round(None, False, 1, [[1], [2]], 0),
          Round(0, False, 3, [[0, 1], [2], [1, 2]], 0)])
# Ahead: the device moved its references for a frame the trunk never received.
@example([Round(None, False, 2, [[0], [1]], 1), Round(None, False, 2, [[1], [0]], 0)])
# Two starts from zero at one version: ahead by a frame, restarted (a stale refusal) and
# at version 1 again, then back to the state kept before: only the lineage tells them apart.
@example([Round(None, False, 1, [[0]], 1), Round(None, False, 1, [[0]], 0),
          Round(0, False, 1, [[0]], 0)])
# A fork: back to round 1's state, whose next frame is lost on the way, then on from there:
# kept, those references would reach the trunk's version by another batch than the trunk's.
@example([Round(None, False, 1, [[0]], 0), Round(None, False, 1, [[0]], 0),
          Round(0, False, 1, [[0]], 1), Round(None, False, 1, [[0]], 0)])
def test_local_loss_frames_in_flight_never_leave_the_two_sides_apart(rounds):
    """Rounds of frames in flight, each started from any state the device kept (an older one
    models a round whose state was lost), the trunk sometimes having dropped the client, and
    devices vanishing with frames on the way: every frame the trunk queues holds the
    activations the device agreed on for it; after every round the device finishes, both
    sides hold the same references at the same version, and each of its batches was trained
    exactly once; a vanished round's queued batches are trained or dropped, once."""
    from splitlearn.dataplane.channel import InProcessTransport, TrunkChannel

    protocol = protocol_named("local_loss")
    handler = protocol.trunk(Trunk(digits_like_model(), lr=0.1), protocol.options(),
                             dataplane(TOPK))
    tokens = TokenRegistry()
    endpoint = TrunkEndpoint({protocol.name: handler}, tokens, dataplane=dataplane(TOPK))
    # Per frame in the order sent (the in-process trunk answers each as it is sent): what
    # the device agreed on, and what the trunk queued (None: refused, or never received).
    frames: list[list[torch.Tensor | None]] = []
    encode, submit = ReferenceFeedback.encode, handler._submit

    def encoding(self, ids, activations, round_trip):
        frame, agreed = encode(self, ids, activations, round_trip)
        frames.append([agreed, None])
        return frame, agreed

    def submitting(batch):
        frames[-1][1] = batch.activations
        return submit(batch)

    handler._submit = submitting
    # The device's state after each round, kept even if it vanished, as the ClientApp
    # keeps it: None where its references had moves the trunk never acknowledged.
    kept: list[dict | None] = []
    with mock.patch.object(ReferenceFeedback, "encode", encoding):
        for server_round, spec in enumerate(rounds, start=1):
            token = tokens.issue(client="c0", protocol=protocol.name, cut=CUT,
                                 server_round=server_round, ttl_s=60)
            channel = TrunkChannel(InProcessTransport(endpoint, token), compression=TOPK,
                                   window=spec.window)
            state = None
            if kept:
                state = kept[-1] if spec.start is None else kept[spec.start % len(kept)]
            if state is not None:
                channel.feedback = ReferenceFeedback.from_state(state, max_bytes=MAX)
            if spec.dropped:
                handler.feedback.release("c0")
            before, first = handler.trained["c0"] + handler.dropped["c0"], len(frames)
            finished = stream_until_vanished(channel, spec.batches, spec.vanish, server_round)
            handler.finish_round(["c0"] if finished else [])
            moved = handler.trained["c0"] + handler.dropped["c0"] - before
            assert moved == sum(q is not None for _, q in frames[first:])
            if finished:
                assert moved == len(spec.batches)
                assert_same_references(handler.feedback, channel)
            kept.append(channel.feedback.state() if channel.feedback_settled else None)
            channel.close()
    assert handler.errors == 0
    for agreed, queued in frames:
        assert queued is None or torch.equal(queued, agreed)


def stream_until_vanished(channel, batches: list[list[int]], vanish: int, seed: int) -> bool:
    """:func:`stream`, except that the last ``vanish`` frames are lost with the device.

    Returns whether the device finished the round (then every frame was acknowledged).
    """
    if not vanish:
        stream(channel, batches, seed=seed)
        return True
    try:
        for n, ids in enumerate(batches):
            if n == max(0, len(batches) - vanish):
                channel.transport.send = lambda data: None  # the link is gone
            acts, labels, example_ids = batch(seed + n, ids)
            channel.send_smashed(acts, labels, example_ids=example_ids)
    except TrunkRejected:  # an ack it waited for never came: as a reply timeout would
        pass
    return False


def test_a_local_loss_refusal_other_than_stale_still_fails_the_round(trunk_server_factory):
    """Error feedback sends only stale batches again: a bad value stops the device."""
    server = local_loss_server(trunk_server_factory)
    channel = server.local_channel(server.token(CUT), compression=TOPK)
    acts, labels, ids = batch(0, [0, 1, 2, 3])
    channel.send_smashed(acts * 1e7, labels, example_ids=ids)  # past max_abs_value
    with pytest.raises(TrunkRejected, match="OUT_OF_RANGE"):
        channel.flush()
    with pytest.raises(ValueError, match="example_ids"):
        channel.send_smashed(acts, labels)
    assert trained(server) == 0


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.lists(st.integers(0, 30), min_size=1,
                                                              max_size=5, unique=True)),
                min_size=1, max_size=25),
       st.integers(4, 40))
def test_the_book_stays_within_its_budget_and_versions_only_move_forward(batches, budget_rows):
    """Whatever the clients send, the trunk's rows stay within the budget (or one client's
    rows, which its own bound caps), and a kept client's version is its batches since zero."""
    row = (3,)
    book = FeedbackBook(uplink=True, downlink=True, max_bytes=budget_rows * 12)
    for client, ids in batches:
        version = book[client].uplink.version if client in book else 0
        try:
            memory = book.prepare(client, torch.tensor(ids), row, version=version)
        except FeedbackFull:
            continue
        memory.uplink.commit(torch.tensor(ids), torch.ones(len(ids), 3))
        memory.downlink.residuals.store(torch.tensor(ids), torch.ones(len(ids), 3))
        if book.keep(client, memory):  # it held more than its share: dropped at once
            assert client not in book
        else:
            assert book[client].uplink.version == version + 1
        assert book.nbytes == sum(book[c].nbytes for c in "abcd" if c in book)
        assert book.nbytes <= budget_rows * 12


@settings(max_examples=50, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.sampled_from("abc"), st.lists(st.integers(0, 3), min_size=1, max_size=4,
                                               unique=True)),
    st.tuples(st.just("x"), st.lists(st.integers(0, 10**6), min_size=1, max_size=8,
                                     unique=True))), min_size=1, max_size=40))
def test_a_client_within_its_share_is_never_dropped_for_another(batches):
    """Clients a, b, c send at most 4 distinct ids, x floods with new ones: whatever the
    order, the honest clients keep their references, and x only ever loses its own."""
    row, honest_bytes = (3,), 2 * 8 * 12  # both directions, capacity of at most 8 rows each
    book = FeedbackBook(uplink=True, downlink=True, max_bytes=4 * honest_bytes)  # 4 clients
    versions: dict[str, int] = {}
    for client, ids in batches:
        version = versions.get(client, 0)
        try:
            try:
                memory = book.prepare(client, torch.tensor(ids), row, version=version)
            except StaleFeedback:  # dropped while another was served: the channel restarts
                assert client == "x"
                memory = book.prepare(client, torch.tensor(ids), row, version=0)
                version = 0
        except FeedbackFull:  # x's rows alone past the whole budget
            assert client == "x"
            continue
        memory.uplink.commit(torch.tensor(ids), torch.ones(len(ids), 3))
        memory.downlink.residuals.store(torch.tensor(ids), torch.ones(len(ids), 3))
        dropped = book.keep(client, memory)
        versions[client] = 0 if dropped else version + 1  # as the channel restarts
        assert all(c in book for c in versions if c != "x"), "an honest client was dropped"
        assert book.nbytes <= book.max_bytes


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(-3, 2**40), min_size=0, max_size=6),
       dtype=st.sampled_from([torch.int64, torch.float32, torch.float16]),
       version=st.integers(0, 2**64 - 1),
       name=st.sampled_from(["splitfed_v2", "ushaped", "local_loss"]))
def test_any_ids_and_version_get_an_answer_or_a_reasoned_refusal(ids, dtype, version, name):
    """Fuzzed ``example_ids`` and ``feedback_version`` never crash the trunk, and a refused
    batch never steps it (U-shaped: never leaves a graph waiting for its backward; local
    loss: is never queued)."""
    trunk = Trunk(digits_like_model(), lr=0.1)
    protocol = protocol_named(name)
    tokens = TokenRegistry()
    handler = protocol.trunk(trunk, protocol.options(), dataplane(TOPK))
    endpoint = TrunkEndpoint({protocol.name: handler}, tokens, dataplane=dataplane(TOPK))
    session, _ = endpoint.attach(tokens.issue(client="c0", protocol=protocol.name, cut=CUT,
                                              server_round=1, ttl_s=60), lambda: None)
    acts, labels, _ = batch(0, [0, 1, 2, 3])
    kind, answer = {"splitfed_v2": ("forward", "gradient"), "ushaped": ("forward", "features"),
                    "local_loss": ("smashed", "ack")}[name]
    data = request(1, kind, activations=encoder(TOPK, "uplink")(acts),
                   **({} if name == "ushaped" else {"labels": encode_tensor(labels)}),
                   example_ids=encode_tensor(torch.tensor(ids, dtype=dtype)),
                   feedback_version=version).SerializeToString()
    reply = pb.Reply.FromString(endpoint.handle(session, data, peer="fuzz"))
    fine = (dtype == torch.int64 and len(set(ids)) == len(ids) == 4 and min(ids) >= 0
            and version == 0)
    assert reply.WhichOneof("kind") == (answer if fine else "refusal"), reply
    if name == "local_loss":
        handler.finish_round(["c0"])
    progress = {"splitfed_v2": lambda: trunk.steps, "ushaped": lambda: handler.pending_sessions,
                "local_loss": lambda: handler.trained["c0"]}[name]
    assert progress() == int(fine)
    if not fine:
        assert reply.refusal.reason != pb.Refusal.INTERNAL, reply.refusal.detail


@dataclass(frozen=True)
class ExchangeRound:
    """One round of request-reply batches with error feedback (see below)."""

    start: int | None  # the kept state it starts from: None, the latest; else an older one
    dropped: bool  # the trunk dropped the client's memory before the round
    batches: list[list[int]]  # each batch's example ids
    loss: int  # 0: finished; 1: the last forward's reply is lost; 2 (U-shaped): no backward


EXCHANGE_ROUNDS = st.lists(st.builds(
    ExchangeRound, st.one_of(st.none(), st.integers(0, 5)), st.booleans(),
    st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
             min_size=1, max_size=4),
    st.integers(0, 2)), min_size=1, max_size=4)


@pytest.mark.parametrize("name", ["splitfed_v2", "ushaped"])
@settings(max_examples=30, deadline=None)
@given(EXCHANGE_ROUNDS)
# Back to round 1's state while the trunk moved on in round 2, whose last reply was lost.
@example([ExchangeRound(None, False, [[0]], 0), ExchangeRound(None, False, [[0]], 1),
          ExchangeRound(0, False, [[0], [1]], 0)])
# Two starts at one version: the trunk dropped the client, so the device restarted (and the
# trunk with it), then lost a reply; the trunk is at version 2 as round 1 left the device,
# and back on round 1's state only the lineage tells them apart.
@example([ExchangeRound(None, False, [[0], [1]], 0), ExchangeRound(None, True, [[0], [1]], 1),
          ExchangeRound(0, False, [[0]], 0)])
def test_lost_replies_and_older_states_never_leave_the_two_sides_apart(name, rounds):
    """Split (SplitFed v2) and U-shaped sessions, through the ClientApp's keep and restore of
    the references (U-shaped: the activations' and the features'), any kept state to start
    from, the trunk sometimes having dropped the client, and rounds ending with a reply lost
    (the trunk moved its references, the device did not) or, U-shaped, with no backward:
    every forward the device finishes trains on what the trunk holds for its ids, and after
    every round it finishes both sides hold the same references at the same version."""
    from flwr.app import Context, RecordDict

    from clients.app import _keep_feedback, _restore_feedback
    from splitlearn.dataplane.channel import InProcessTransport, TrunkChannel

    compression = CompressionConfig(uplink="topk", downlink="topk", topk_fraction=0.1,
                                    error_feedback=True)
    protocol = protocol_named(name)
    handler = protocol.trunk(Trunk(digits_like_model(), lr=0.1), protocol.options(),
                             dataplane(compression))
    tokens = TokenRegistry()
    endpoint = TrunkEndpoint({protocol.name: handler}, tokens, dataplane=dataplane(compression))
    spec = RunSpec(compression=compression)
    node = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    kept: list[dict] = []  # the node's records after each round
    for server_round, step in enumerate(rounds, start=1):
        if kept:
            records = kept[-1] if step.start is None else kept[step.start % len(kept)]
            node.state = RecordDict(dict(records))
        if step.dropped:
            handler.feedback.release("c0")
        token = tokens.issue(client="c0", protocol=protocol.name, cut=CUT,
                             server_round=server_round, ttl_s=60)
        channel = TrunkChannel(InProcessTransport(endpoint, token), compression=compression)
        _restore_feedback(node, channel, spec, cut=CUT)
        finished = exchange_round(channel, handler, step, seed=10 * server_round,
                                  ushaped=name == "ushaped")
        _keep_feedback(node, channel, cut=CUT)
        kept.append(dict(node.state))
        channel.close()
        if finished:
            memory = handler.feedback["c0"]
            pairs = [(memory.uplink, channel.feedback, (32, 8, 8))]
            if name == "ushaped":
                pairs.append((memory.features, channel.feature_feedback, (128,)))
            every = torch.arange(8)
            for trunk_side, device_side, shape in pairs:
                assert trunk_side.version == device_side.version
                assert torch.equal(trunk_side.references.rows(every, shape),
                                   device_side.references.rows(every, shape))
    assert getattr(handler, "pending_sessions", 0) == 0


def exchange_round(channel, handler, step: ExchangeRound, *, seed: int, ushaped: bool
                   ) -> bool:
    """Run ``step``'s batches; return whether the device finished the round."""
    for n, ids in enumerate(step.batches):
        last = n == len(step.batches) - 1
        acts, labels, example_ids = batch(seed + n, ids)
        if last and step.loss == 1:
            lose_next_reply(channel)
            with pytest.raises(TrunkRejected):
                if ushaped:
                    channel.forward_features(acts, example_ids=example_ids)
                else:
                    channel.forward(acts, labels, example_ids=example_ids)
            return False
        if not ushaped:
            channel.forward(acts, labels, example_ids=example_ids)
        else:
            features = channel.forward_features(acts, example_ids=example_ids)
        memory = handler.feedback["c0"]  # what the trunk trained on (U-shaped: and sent)
        assert torch.equal(channel.feedback.references.rows(example_ids, (32, 8, 8)),
                           memory.uplink.references.rows(example_ids, (32, 8, 8)))
        if not ushaped:
            continue
        assert torch.equal(features, memory.features.references.rows(example_ids, (128,)))
        if last and step.loss == 2:
            return False
        features.requires_grad_(True)
        nn.functional.cross_entropy(nn.functional.linear(features, torch.ones(10, 128)),
                                    labels).backward()
        channel.backward(features.grad)
    return True


def lose_next_reply(channel) -> None:
    """The next frame reaches the trunk, and its reply never reaches the device."""
    transport = channel.transport
    receive = transport.receive

    def lost(timeout_s: float) -> bytes:
        receive(timeout_s)
        raise TrunkRejected("no reply within the timeout")

    transport.receive = lost
