"""U-shaped data plane: split == whole-model SGD, no labels on the wire, reasoned refusals."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients.app import evaluate_ushaped_split, train_ushaped_split
from clients.ushaped import EXCHANGES_PER_BATCH, train_ushaped
from server.app import make_task_template
from splitlearn.config import compose_config
from splitlearn.split import split_u, ushaped_state
from splitlearn.transport import GrpcTrunkSession, TrunkRejected
from splitlearn.wire import decode_frame, encode_frame, state_to_record
from tests.conftest import digits_like_model, fixed_batches
from tests.integration.test_dataplane import max_param_diff, train_whole

LR = 0.1
STEPS = 20


def ushaped_token(server, cut: int, tail_cut: int, client: str = "c0", server_round: int = 1):
    return server.tokens.issue(
        client=client, cut=cut, server_round=server_round, ttl_s=60, tail_cut=tail_cut
    )


def open_ushaped(server, cut: int, tail_cut: int, transport: str = "grpc", **kw):
    token = ushaped_token(server, cut, tail_cut, **kw)
    if transport == "grpc":
        return GrpcTrunkSession(server.service.address, token, max_frame_bytes=1 << 20)
    return server.endpoint.local_session(token)


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
        server = trunk_server_factory(reference, lr=LR)
        client_model = copy.deepcopy(reference)
        head, _, tail = split_u(client_model, cut, tail_cut)
        session = open_ushaped(server, cut, tail_cut, transport)
        report = train_ushaped(head, tail, lambda b=batches: b, session, epochs=1, lr=LR)
        session.close()
        assert report.steps == STEPS and server.trunk.steps == STEPS
        # The joined model: the device's head and tail, the trunk's stages between.
        joined = copy.deepcopy(server.model)
        for i in [*range(cut), *range(tail_cut, reference.num_stages)]:
            joined.stages[i] = client_model.stages[i]
        diff = max_param_diff(joined, whole)
        assert diff <= 1e-5, f"{name} cuts {cut}/{tail_cut} via {transport}: max abs diff {diff}"
        assert server.endpoint.ushaped.pending_sessions == 0


# --- what the device sends -------------------------------------------------


@pytest.fixture
def run_identity(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1, raising=False)


def capture_frames(monkeypatch, server) -> list[bytes]:
    """Record every request frame the trunk service receives (what left the device)."""
    frames: list[bytes] = []
    handle = server.endpoint.handle

    def recording(data: bytes, token: str | None) -> bytes:
        frames.append(data)
        return handle(data, token)

    monkeypatch.setattr(server.endpoint, "handle", recording)
    return frames


def assert_label_free(frames: list[bytes], batch_sizes: set[int]) -> None:
    for data in frames:
        frame = decode_frame(data, max_bytes=1 << 22)
        assert "labels" not in frame.tensors, frame.kind
        assert not frame.meta, f"{frame.kind} frame carries meta {frame.meta}"
        for name, tensor in frame.tensors.items():
            assert tensor.is_floating_point(), f"{frame.kind}: {name} is {tensor.dtype}"
            assert not (tensor.dim() == 1 and len(tensor) in batch_sizes), name


def test_clientapp_round_sends_no_labels_and_two_exchanges_per_batch(
    trunk_server_factory, monkeypatch, run_identity
):
    cfg = compose_config(["strategy=ushaped", "num_clients=5", "strategy.local_epochs=1"])
    model = digits_like_model("cnn")
    server = trunk_server_factory(model, lr=cfg.strategy.lr)
    frames = capture_frames(monkeypatch, server)
    tail_cut = model.num_stages - 1
    task = replace(
        make_task_template(cfg, server.service.address), server_round=1, tail_cut=tail_cut,
        token=ushaped_token(server, cfg.model.cut, tail_cut),
    )
    arrays = state_to_record(ushaped_state(model, cfg.model.cut, tail_cut))
    content = RecordDict({"arrays": arrays, "config": ConfigRecord(task.to_config())})
    context = Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 5},
                      state=RecordDict(), run_config={})

    reply = train_ushaped_split(
        Message(content=content, dst_node_id=1, message_type="train.ushaped"), context
    )

    metrics = reply.content["metrics"]
    steps = int(metrics["steps"])
    assert steps > 1 and server.trunk.steps == steps
    assert len(frames) == EXCHANGES_PER_BATCH * steps
    kinds = [decode_frame(f, max_bytes=1 << 22).kind for f in frames]
    assert kinds == ["forward", "backward"] * steps
    assert_label_free(frames, {cfg.strategy.batch_size, int(metrics["num-examples"]) % 32})
    assert server.endpoint.rejected == {}
    # The reply holds the head and the tail, keyed by stage index; never the trunk.
    stages = {int(k.split(".")[0]) for k in reply.content["arrays"].keys()}
    assert stages == {*range(cfg.model.cut), tail_cut}
    assert set(metrics.keys()) >= {"train-loss", "train-accuracy", "bytes-up", "virtual-s"}

    frames.clear()
    evaluated = evaluate_ushaped_split(
        Message(content=content, dst_node_id=1, message_type="evaluate.ushaped"), context
    )
    assert evaluated.content["metrics"]["num-examples"] > 0
    assert {decode_frame(f, max_bytes=1 << 22).kind for f in frames} == {"evaluate"}
    assert_label_free(frames, {cfg.strategy.batch_size})
    assert server.trunk.steps == steps  # evaluation never updates


# --- refusals and per-session state ----------------------------------------


def trunk_params(server) -> list[torch.Tensor]:
    return [p.detach().clone() for p in server.model.parameters()]


def send_raw(session, kind: str, tensors: dict[str, torch.Tensor]) -> None:
    """Send any frame; raise TrunkRejected with the trunk's reason if it is refused."""
    reply = decode_frame(session._round_trip(encode_frame(kind, tensors)), max_bytes=1 << 22)
    if reply.kind == "error":
        raise TrunkRejected(reply.meta["reason"])


@pytest.mark.parametrize("transport", ["grpc", "in_process"])
def test_protocol_violations_are_refused_with_reasons_and_change_nothing(
    trunk_server_factory, transport
):
    reference = digits_like_model("cnn")
    cut, tail_cut = 1, 3
    server = trunk_server_factory(reference, lr=LR)
    head, _, tail = split_u(copy.deepcopy(reference), cut, tail_cut)
    x, y = fixed_batches(1, batch=4)[0]
    acts = head(x).detach()
    session = open_ushaped(server, cut, tail_cut, transport)
    before = trunk_params(server)

    with pytest.raises(TrunkRejected, match="backward without a pending forward"):
        session.backward_features(torch.zeros(4, *reference.cut_shape(tail_cut)))
    with pytest.raises(TrunkRejected, match="keep labels on the device.*'labels'"):
        send_raw(session, "forward", {"activations": acts, "labels": y})
    with pytest.raises(TrunkRejected, match="'backward', 'evaluate', not 'smashed'"):
        send_raw(session, "smashed", {"activations": acts})
    assert server.endpoint.ushaped.pending_sessions == 0

    features = session.forward_features(acts)
    assert tuple(features.shape) == (4, *reference.cut_shape(tail_cut))
    for bad, why in [
        (torch.zeros(3, *features.shape[1:]), "expected \\(4, 128, 2, 2\\), the shape of the"),
        (torch.full(features.shape, float("nan")), "NaN"),
        (torch.zeros(features.shape, dtype=torch.int64), "float dtype"),
    ]:
        with pytest.raises(TrunkRejected, match=why):
            session.backward_features(bad)
    with pytest.raises(TrunkRejected, match="accepted: \\['grad'\\]"):
        send_raw(session, "backward", {"grad": torch.zeros(features.shape), "labels": y})
    # Refusals changed nothing: no step, and the pending forward is still there.
    assert all(torch.equal(a, b) for a, b in zip(before, trunk_params(server), strict=True))
    assert server.trunk.steps == 0 and server.endpoint.ushaped.pending_sessions == 1
    grad = session.backward_features(torch.ones(features.shape))
    assert grad.shape == acts.shape and server.trunk.steps == 1
    assert server.endpoint.rejected["c0"] == 7  # every refusal above, counted
    session.close()


def test_a_second_forward_replaces_the_pending_one(trunk_server_factory):
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference, lr=LR)
    head, _, _ = split_u(copy.deepcopy(reference), 2, 4)
    session = open_ushaped(server, 2, 4)
    first = head(fixed_batches(1, batch=4)[0][0]).detach()
    second = head(fixed_batches(1, batch=6, seed=1)[0][0]).detach()
    session.forward_features(first)
    reply = decode_frame(
        session._round_trip(encode_frame("forward", {"activations": second})), max_bytes=1 << 22
    )
    assert reply.kind == "features" and reply.meta == {"replaced_pending": True}
    assert server.endpoint.ushaped.replaced == 1
    with pytest.raises(TrunkRejected, match="expected \\(6, 128\\)"):  # the batch of 4 is gone
        session.backward_features(torch.ones(4, 128))
    assert session.backward_features(torch.ones(6, 128)).shape == second.shape
    session.close()


def test_pending_graphs_are_dropped_when_the_stream_ends_or_the_round_is_revoked(
    trunk_server_factory,
):
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference, lr=LR)
    head, _, _ = split_u(copy.deepcopy(reference), 1, 4)
    acts = head(fixed_batches(1, batch=4)[0][0]).detach()
    ushaped = server.endpoint.ushaped

    ended = open_ushaped(server, 1, 4, client="ended")
    ended.forward_features(acts)
    assert ushaped.pending_sessions == 1
    ended.close()  # the device never sends the backward
    deadline = time.monotonic() + 5  # the service notices the stream's end on its thread
    while ushaped.pending_sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ushaped.pending_sessions == 0

    local = open_ushaped(server, 1, 4, "in_process", client="local")
    local.forward_features(acts)
    local.close()
    assert ushaped.pending_sessions == 0

    revoked = open_ushaped(server, 1, 4, client="revoked", server_round=1)
    later = open_ushaped(server, 1, 4, client="later", server_round=2)
    revoked.forward_features(acts)
    later.forward_features(acts)
    server.tokens.revoke_round(1)  # the round ends while a graph is pending
    assert ushaped.pending_sessions == 1  # round 2's session keeps its graph
    with pytest.raises(TrunkRejected, match="token rejected"):
        revoked.backward_features(torch.ones(4, 128))
    later.backward_features(torch.ones(4, 128))
    assert server.trunk.steps == 1 and ushaped.pending_sessions == 0
    revoked.close()
    later.close()


@pytest.mark.parametrize("name", ["cnn", "resnet"])
def test_interleaved_sessions_step_on_the_current_trunk(trunk_server_factory, name):
    """A trunk step between a session's forward and backward: the backward recomputes."""
    reference = digits_like_model(name)
    cut, tail_cut = 1, 4
    server = trunk_server_factory(reference, lr=LR)
    head, _, _ = split_u(copy.deepcopy(reference), cut, tail_cut)
    (xa, _), (xb, _) = fixed_batches(2, batch=4)
    acts_a, acts_b = head(xa).detach(), head(xb).detach()
    a = open_ushaped(server, cut, tail_cut, client="a")
    b = open_ushaped(server, cut, tail_cut, client="b")
    features_a = a.forward_features(acts_a)
    b.forward_features(acts_b)
    grad_b = torch.randn(4, *reference.cut_shape(tail_cut))
    a.backward_features(torch.randn(features_a.shape))
    # B's backward must be the gradient through the trunk as it is now (after A's step).
    after_a = copy.deepcopy(server.model)
    buffers_before = [t.clone() for t in server.model.buffers()]
    leaf = acts_b.clone().requires_grad_(True)
    out = leaf
    for stage in after_a.stages[cut:tail_cut]:
        out = stage.train()(out)
    out.backward(grad_b)
    got = b.backward_features(grad_b)
    assert torch.allclose(got, leaf.grad, atol=1e-6)
    assert server.trunk.steps == 2 and server.endpoint.ushaped.recomputed == 1
    # Batch-norm statistics moved once per batch (at each forward), not again on recompute.
    assert all(torch.equal(x, y) for x, y in zip(buffers_before, server.model.buffers(),
                                                strict=True))
    a.close()
    b.close()


def test_features_for_evaluation_keep_no_graph_and_update_nothing(trunk_server_factory):
    reference = digits_like_model("resnet")
    server = trunk_server_factory(reference, lr=LR)
    head, trunk, _ = split_u(copy.deepcopy(reference), 2, 4)
    x = fixed_batches(1, batch=8)[0][0]
    session = open_ushaped(server, 2, 4)
    before = copy.deepcopy(server.model.state_dict())
    features = session.evaluate_features(head.eval()(x).detach())
    with torch.no_grad():
        expected = trunk.eval()(head(x))
    assert torch.allclose(features, expected, atol=1e-6)
    assert server.endpoint.ushaped.pending_sessions == 0 and server.trunk.steps == 0
    assert all(torch.equal(v, server.model.state_dict()[k]) for k, v in before.items())
    session.close()


def test_a_non_ushaped_session_may_not_send_backward(trunk_server_factory):
    server = trunk_server_factory(digits_like_model("cnn"))
    session = server.endpoint.local_session(server.token(1))
    with pytest.raises(TrunkRejected, match="not 'backward'"):
        session.backward_features(torch.ones(4, 128))
