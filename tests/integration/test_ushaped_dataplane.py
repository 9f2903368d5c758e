"""U-shaped data plane: split == whole-model SGD, no labels on the wire, reasoned refusals."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from clients.loop import train_round
from clients.steps.ushaped import UShapedStep
from experiments.local import LocalGrid
from protocols.ushaped import UShapedOptions
from splitlearn.config import PrivacyConfig, RunSpec
from splitlearn.dataplane import TrunkRejected
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import encode_tensor
from splitlearn.privacy import ClientPrivacy
from splitlearn.stages import split_u
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import max_param_diff, send_raw, train_whole

LR = 0.1
STEPS = 20


def ushaped_server(factory, model, tail_cut: int, **kw):
    return factory(model, protocol="ushaped", options=UShapedOptions(tail_cut=tail_cut), lr=LR,
                   **kw)


def open_ushaped(server, cut: int, transport: str = "grpc", **kw):
    token = server.token(cut, **kw)
    return server.channel(token) if transport == "grpc" else server.local_channel(token)


def cut_pairs(model) -> list[tuple[int, int]]:
    return [(c, t) for c in model.valid_cuts for t in range(c + 1, model.num_stages)]


@pytest.mark.parametrize("transport", ["grpc", "in_process"])
@pytest.mark.parametrize("name", ["cnn", "resnet"])
def test_ushaped_training_equals_whole_model_at_every_cut_pair(
    trunk_server_factory, name, transport
):
    reference = digits_like_model(name)
    batches = fixed_batches(STEPS)
    whole = copy.deepcopy(reference)
    train_whole(whole, batches, LR)
    pairs = cut_pairs(reference)
    assert len(pairs) == 6  # 5 stages: every (cut, tail_cut) with a stage on each part
    for cut, tail_cut in pairs:
        # In the whole model's layout: bit for bit (as test_dataplane.py says why).
        server = ushaped_server(trunk_server_factory, reference, tail_cut, channels_last=False)
        client_model = copy.deepcopy(reference)
        spec = RunSpec(strategy=UShapedOptions(tail_cut=tail_cut, lr=LR, momentum=0.0))
        step = UShapedStep(client_model, spec, cut=cut)
        channel = open_ushaped(server, cut, transport)
        report = train_round(step, channel, ClientPrivacy(PrivacyConfig(), batches), epochs=1)
        channel.close()
        assert report.steps == STEPS and server.trunk.steps == STEPS
        assert report.exchanges == 2 * STEPS
        # The joined model: the device's head and tail, the trunk's stages between.
        joined = copy.deepcopy(server.model)
        for i in [*range(cut), *range(tail_cut, reference.num_stages)]:
            joined.stages[i] = client_model.stages[i]
        diff = max_param_diff(joined, whole)
        assert diff <= 1e-5, f"{name} cuts {cut}/{tail_cut} via {transport}: max abs diff {diff}"
        assert server.handler.pending_sessions == 0


# --- what the device sends -------------------------------------------------


class RecordingTransport:
    """Wraps a transport and keeps every request frame (what left the device)."""

    def __init__(self, inner, frames: list[bytes]) -> None:
        self.inner, self.frames = inner, frames

    def send(self, data: bytes) -> None:
        self.frames.append(data)
        self.inner.send(data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def assert_label_free(frames: list[bytes], batch_sizes: set[int]) -> None:
    for data in frames:
        request = pb.Request.FromString(data)
        kind = request.WhichOneof("kind")
        part = getattr(request, kind)
        assert not (kind != "backward" and part.HasField("labels")), kind
        for field, tensor in part.ListFields():
            assert tensor.dtype in (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16), (kind, field.name)
            assert not (len(tensor.shape) == 1 and tensor.shape[0] in batch_sizes), field.name


def test_clientapp_round_sends_no_labels_and_two_exchanges_per_batch(tmp_path):
    """Through the shipped ClientApp and strategy (in process): frames carry no labels."""
    from clients.app import build_client_app
    from server.app import run_training, start_runtime, stop_runtime
    from tests.conftest import small_config

    cfg = small_config("strategy=ushaped", "strategy.num_rounds=1", "strategy.fraction_evaluate=1",
                       run_dir=str(tmp_path))
    runtime = start_runtime(cfg)
    frames: list[bytes] = []

    def recording_channel(address, token, spec, *, proof=None):
        from experiments.local import in_process_channels

        channel = in_process_channels(runtime.endpoint)(address, token, spec, proof=proof)
        channel.transport = RecordingTransport(channel.transport, frames)
        return channel

    try:
        grid = LocalGrid(build_client_app(recording_channel), num_nodes=cfg.num_clients)
        result = run_training(grid, runtime)
    finally:
        stop_runtime(runtime)
    train_frames = [f for f in frames if pb.Request.FromString(f).WhichOneof("kind") != "evaluate"]
    steps = runtime.trunk.steps
    assert steps > cfg.num_clients and len(train_frames) == 2 * steps
    kinds = [pb.Request.FromString(f).WhichOneof("kind") for f in train_frames]
    assert sorted(kinds) == sorted(["forward", "backward"] * steps)
    assert_label_free(frames, {cfg.strategy.batch_size})
    evaluated = [f for f in frames if pb.Request.FromString(f).WhichOneof("kind") == "evaluate"]
    assert evaluated and runtime.trunk.steps == steps  # evaluation never updates
    assert not runtime.endpoint.refusals
    assert result.history[-1]["clients"] == cfg.num_clients


# --- refusals and per-session state ----------------------------------------


def trunk_params(server) -> list[torch.Tensor]:
    return [p.detach().clone() for p in server.model.parameters()]


def raw(channel, **kind) -> pb.Reply:
    return send_raw(channel, pb.Request(seq=channel.next_seq(), **kind).SerializeToString())


@pytest.mark.parametrize("transport", ["grpc", "in_process"])
def test_protocol_violations_are_refused_with_reasons_and_change_nothing(
    trunk_server_factory, transport
):
    reference = digits_like_model("cnn")
    cut, tail_cut = 1, 3
    server = ushaped_server(trunk_server_factory, reference, tail_cut)
    head, _, _ = split_u(copy.deepcopy(reference), cut, tail_cut)
    x, y = fixed_batches(1, batch=4)[0]
    acts = head(x).detach()
    channel = open_ushaped(server, cut, transport)
    before = trunk_params(server)

    with pytest.raises(TrunkRejected, match="NO_PENDING_FORWARD"):
        channel.backward(torch.zeros(4, *reference.cut_shape(tail_cut)))
    reply = raw(channel, forward=pb.Forward(activations=encode_tensor(acts).to_proto(),
                                            labels=encode_tensor(y).to_proto()))
    assert "keep labels on the device" in reply.refusal.detail
    reply = raw(channel, smashed=pb.Smashed(activations=encode_tensor(acts).to_proto()))
    assert pb.Refusal.Reason.Name(reply.refusal.reason) == "UNEXPECTED_KIND"
    assert server.handler.pending_sessions == 0

    features = channel.forward_features(acts)
    assert tuple(features.shape) == (4, *reference.cut_shape(tail_cut))
    for bad, why in [
        (torch.zeros(3, *features.shape[1:]), "BAD_TENSOR"),
        (torch.full(features.shape, float("nan")), "NOT_FINITE"),
        (torch.full(features.shape, 3e38), "OUT_OF_RANGE"),
        (torch.zeros(features.shape, dtype=torch.int64), "BAD_TENSOR"),
    ]:
        with pytest.raises(TrunkRejected, match=why):
            channel.backward(bad)
    # Refusals changed nothing: no step, and the pending forward is still there.
    assert all(torch.equal(a, b) for a, b in zip(before, trunk_params(server), strict=True))
    assert server.trunk.steps == 0 and server.handler.pending_sessions == 1
    grad = channel.backward(torch.ones(features.shape))
    assert grad.shape == acts.shape and server.trunk.steps == 1
    assert sum(server.endpoint.refusals.values()) == 7  # every refusal above, counted
    channel.close()


def test_a_second_forward_replaces_the_pending_one(trunk_server_factory):
    reference = digits_like_model("cnn")
    server = ushaped_server(trunk_server_factory, reference, 4)
    head, _, _ = split_u(copy.deepcopy(reference), 2, 4)
    channel = open_ushaped(server, 2)
    first = head(fixed_batches(1, batch=4)[0][0]).detach()
    second = head(fixed_batches(1, batch=6, seed=1)[0][0]).detach()
    channel.forward_features(first)
    reply = raw(channel, forward=pb.Forward(activations=encode_tensor(second).to_proto()))
    assert reply.WhichOneof("kind") == "features" and reply.features.replaced_pending
    assert server.handler.replaced == 1
    with pytest.raises(TrunkRejected, match="BAD_TENSOR"):  # the batch of 4 is gone
        channel.backward(torch.ones(4, 128))
    assert channel.backward(torch.ones(6, 128)).shape == second.shape
    channel.close()


def test_pending_graphs_are_dropped_when_the_stream_ends_or_the_round_is_revoked(
    trunk_server_factory,
):
    reference = digits_like_model("cnn")
    server = ushaped_server(trunk_server_factory, reference, 4)
    head, _, _ = split_u(copy.deepcopy(reference), 1, 4)
    acts = head(fixed_batches(1, batch=4)[0][0]).detach()
    ushaped = server.handler

    ended = open_ushaped(server, 1, client="ended")
    ended.forward_features(acts)
    assert ushaped.pending_sessions == 1
    ended.close()  # the device never sends the backward
    deadline = time.monotonic() + 5  # the service notices the stream's end on its thread
    while ushaped.pending_sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ushaped.pending_sessions == 0

    local = open_ushaped(server, 1, "in_process", client="local")
    local.forward_features(acts)
    local.close()
    assert ushaped.pending_sessions == 0

    revoked = open_ushaped(server, 1, client="revoked", server_round=1)
    later = open_ushaped(server, 1, client="later", server_round=2)
    revoked.forward_features(acts)
    later.forward_features(acts)
    server.tokens.revoke_round(1)  # the round ends while a graph is pending
    assert ushaped.pending_sessions == 1  # round 2's session keeps its graph
    with pytest.raises(TrunkRejected, match="CANCELLED|token rejected"):
        revoked.backward(torch.ones(4, 128))
    later.backward(torch.ones(4, 128))
    assert server.trunk.steps == 1 and ushaped.pending_sessions == 0
    revoked.close()
    later.close()


@pytest.mark.parametrize("name", ["cnn", "resnet"])
def test_interleaved_sessions_step_on_the_current_trunk(trunk_server_factory, name):
    """A trunk step between a session's forward and backward: the backward recomputes."""
    reference = digits_like_model(name)
    cut, tail_cut = 1, 4
    server = ushaped_server(trunk_server_factory, reference, tail_cut)
    head, _, _ = split_u(copy.deepcopy(reference), cut, tail_cut)
    (xa, _), (xb, _) = fixed_batches(2, batch=4)
    acts_a, acts_b = head(xa).detach(), head(xb).detach()
    a = open_ushaped(server, cut, client="a")
    b = open_ushaped(server, cut, client="b")
    features_a = a.forward_features(acts_a)
    b.forward_features(acts_b)
    grad_b = torch.randn(4, *reference.cut_shape(tail_cut))
    a.backward(torch.randn(features_a.shape))
    # B's backward must be the gradient through the trunk as it is now (after A's step).
    after_a = copy.deepcopy(server.model)
    buffers_before = [t.clone() for t in server.model.buffers()]
    leaf = acts_b.clone().requires_grad_(True)
    # In the layout the trunk computes in: the check is for the recompute, not for float
    # rounding between layouts (test_trunk compares the layouts).
    out = leaf.contiguous(memory_format=torch.channels_last) if server.trunk.channels_last else leaf
    for stage in after_a.stages[cut:tail_cut]:
        out = stage.train()(out)
    out.backward(grad_b)
    got = b.backward(grad_b)
    assert torch.allclose(got, leaf.grad, atol=1e-6)
    assert server.trunk.steps == 2 and server.handler.recomputed == 1
    # Batch-norm statistics moved once per batch (at each forward), not again on recompute.
    assert all(torch.equal(x, y) for x, y in zip(buffers_before, server.model.buffers(),
                                                strict=True))
    a.close()
    b.close()


def test_features_for_evaluation_keep_no_graph_and_update_nothing(trunk_server_factory):
    reference = digits_like_model("resnet")
    server = ushaped_server(trunk_server_factory, reference, 4)
    head, trunk, _ = split_u(copy.deepcopy(reference), 2, 4)
    x = fixed_batches(1, batch=8)[0][0]
    channel = open_ushaped(server, 2)
    before = copy.deepcopy(server.model.state_dict())
    features = channel.evaluate_features(head.eval()(x).detach())
    with torch.no_grad():
        expected = trunk.eval()(head(x))
    assert torch.allclose(features, expected, atol=1e-6)
    assert server.handler.pending_sessions == 0 and server.trunk.steps == 0
    assert all(torch.equal(v, server.model.state_dict()[k]) for k, v in before.items())
    channel.close()


def test_a_split_session_may_not_send_backward(trunk_server_factory):
    server = trunk_server_factory(digits_like_model("cnn"))
    channel = server.local_channel(server.token(1))
    with pytest.raises(TrunkRejected, match="UNEXPECTED_KIND.*not 'backward'"):
        channel.backward(torch.ones(4, 128))
