"""The gRPC data plane: split training equals whole-model training; bad input is refused."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from clients.train import train_bottom
from splitlearn.split import split
from splitlearn.transport import GrpcTrunkSession, TrunkRejected
from splitlearn.wire import encode_frame
from tests.conftest import digits_like_model, fixed_batches

LR = 0.1
STEPS = 20


def train_whole(model: nn.Module, batches, lr: float) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    for x, y in batches:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (pa - pb).abs().max().item()
        for pa, pb in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
        if pa.is_floating_point()
    )


def open_session(server, cut: int, transport: str, client: str = "c0"):
    token = server.token(cut, client=client)
    if transport == "grpc":
        return GrpcTrunkSession(server.service.address, token, max_frame_bytes=1 << 20)
    return server.endpoint.local_session(token)


@pytest.mark.parametrize("transport", ["grpc", "in_process"])
@pytest.mark.parametrize("name", ["cnn", "resnet"])
def test_split_training_equals_whole_model_at_every_cut(trunk_server_factory, name, transport):
    reference = digits_like_model(name)
    batches = fixed_batches(STEPS)
    whole = copy.deepcopy(reference)
    train_whole(whole, batches, LR)
    for cut in reference.valid_cuts:
        server = trunk_server_factory(reference, lr=LR)
        client_model = copy.deepcopy(reference)
        bottom, _ = split(client_model, cut)
        session = open_session(server, cut, transport)
        report = train_bottom(bottom, lambda b=batches: b, session, epochs=1, lr=LR)
        session.close()
        assert report.steps == STEPS
        # The joined model: client's stages below the cut, trunk's above it.
        joined = copy.deepcopy(server.model)
        for i in range(cut):
            joined.stages[i] = client_model.stages[i]
        diff = max_param_diff(joined, whole)
        assert diff <= 1e-5, f"{name} cut {cut} via {transport}: max abs diff {diff}"


def trunk_params(server) -> list[torch.Tensor]:
    return [p.detach().clone() for p in server.model.parameters()]


def send_raw(session: GrpcTrunkSession, data: bytes) -> str:
    """Send raw bytes on a session; return the refusal reason."""
    with pytest.raises(TrunkRejected) as info:
        reply = session._round_trip(data)
        session.bytes_down += len(reply)
        from splitlearn.transport import _to_reply
        from splitlearn.wire import decode_frame

        _to_reply(decode_frame(reply, max_bytes=1 << 21))
    return str(info.value)


BAD_FRAMES = {
    "wrong shape": (lambda s: {"activations": torch.randn(4, *s[:-1], s[-1] + 1),
                               "labels": torch.zeros(4, dtype=torch.int64)}, "expected (batch"),
    "nan": (lambda s: {"activations": torch.full((4, *s), float("nan")),
                       "labels": torch.zeros(4, dtype=torch.int64)}, "NaN"),
    "wrong dtype": (lambda s: {"activations": torch.ones(4, *s, dtype=torch.int64),
                               "labels": torch.zeros(4, dtype=torch.int64)}, "float dtype"),
    "oversized": (lambda s: {"activations": torch.zeros(300_000),
                             "labels": torch.zeros(4, dtype=torch.int64)}, "exceeds the limit"),
}


def test_bad_frames_are_refused_while_another_client_trains(trunk_server_factory):
    reference = digits_like_model("cnn")
    cut = 2
    server = trunk_server_factory(reference, lr=LR, max_frame_bytes=1 << 20)
    shape = server.model.cut_shape(cut)

    # A well-behaved client trains in parallel for the whole test.
    good_report = {}
    good_bottom, _ = split(copy.deepcopy(reference), cut)
    good_session = open_session(server, cut, "grpc", client="good")

    def good_client() -> None:
        good_report["r"] = train_bottom(
            good_bottom, lambda: fixed_batches(40, seed=1), good_session, epochs=1, lr=LR
        )

    thread = threading.Thread(target=good_client)
    thread.start()

    bad = open_session(server, cut, "grpc", client="bad")
    for label, (make, reason) in BAD_FRAMES.items():
        with server.trunk._lock:  # snapshot consistent with the good client's steps
            before = trunk_params(server)
            steps_before = server.trunk.steps
        message = send_raw(bad, encode_frame("forward", make(shape)))
        assert reason in message, f"{label}: {message}"
        with server.trunk._lock:
            if server.trunk.steps == steps_before:  # no good step interleaved
                after = trunk_params(server)
                assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # The stream survives refusals: a valid frame on it still trains.
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(copy.deepcopy(reference), cut)[0](x)
    assert bad.exchange(acts.detach(), y).grad.shape == acts.shape
    bad.close()

    thread.join(timeout=60)
    good_session.close()
    assert good_report["r"].steps == 40
    assert server.endpoint.rejected["bad"] == len(BAD_FRAMES)


def test_refusals_leave_trunk_weights_unchanged(trunk_server_factory):
    reference = digits_like_model("cnn")
    cut = 1
    server = trunk_server_factory(reference, lr=LR)
    shape = server.model.cut_shape(cut)
    before = trunk_params(server)
    session = open_session(server, cut, "grpc")
    for make, reason in BAD_FRAMES.values():
        assert reason in send_raw(session, encode_frame("forward", make(shape)))
    session.close()
    assert all(torch.equal(a, b) for a, b in zip(before, trunk_params(server), strict=True))
    assert server.trunk.steps == 0


def test_bad_token_is_refused_with_a_reason(trunk_server_factory):
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference)
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(copy.deepcopy(reference), 1)[0](x).detach()
    session = GrpcTrunkSession(server.service.address, "not-a-token")
    with pytest.raises(TrunkRejected, match="UNAUTHENTICATED: session token rejected"):
        session.exchange(acts, y)
    session.close()
    # A revoked token stops working too, even on an open stream.
    session = open_session(server, 1, "grpc")
    session.exchange(acts, y)
    server.tokens.revoke_round(1)
    with pytest.raises(TrunkRejected, match="token rejected"):
        session.exchange(acts, y)
    session.close()
    assert server.trunk.steps == 1


def test_activations_shaped_for_another_cut_are_refused(trunk_server_factory):
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference)
    x, y = fixed_batches(1, batch=4)[0]
    acts_cut2 = split(copy.deepcopy(reference), 2)[0](x).detach()
    session = open_session(server, 1, "grpc")  # token says cut 1
    with pytest.raises(TrunkRejected, match="for this client's cut"):
        session.exchange(acts_cut2, y)
    session.close()


def test_client_vanishing_mid_round_leaves_trunk_serving(trunk_server_factory):
    reference = digits_like_model("cnn")
    cut = 2
    server = trunk_server_factory(reference, lr=LR)
    bottom, _ = split(copy.deepcopy(reference), cut)
    vanishing = open_session(server, cut, "grpc", client="gone")

    def vanish(step: int) -> None:
        if step == 3:
            vanishing.abort()
            raise ConnectionAbortedError("device vanished")

    with pytest.raises(ConnectionAbortedError):
        train_bottom(bottom, lambda: fixed_batches(10), vanishing, epochs=1, lr=LR, on_step=vanish)
    assert server.trunk.steps == 3
    # Others (and newcomers) carry on; every trunk step was whole.
    other_bottom, _ = split(copy.deepcopy(reference), cut)
    other = open_session(server, cut, "grpc", client="other")
    report = train_bottom(other_bottom, lambda: fixed_batches(5, seed=2), other, epochs=1, lr=LR)
    other.close()
    assert report.steps == 5 and server.trunk.steps == 8
    assert all(torch.isfinite(p).all() for p in server.model.parameters())
