"""The trunk under attack: exhaustion, stolen tokens, stalls and extreme values over real gRPC.

Each test names one way a hostile or broken client could hurt the server, and
checks that it is refused with a reason while the trunk and other clients carry on.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from server.sessions.split import SharedTrunk, SplitSession
from splitlearn.config import DataPlaneConfig
from splitlearn.dataplane import TrunkRejected
from splitlearn.dataplane.node_keys import new_private_key, prove, public_key_of
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import send_raw, train_split_client


def batch_at(model, cut: int, *, size: int = 4):
    x, y = fixed_batches(1, batch=size)[0]
    return split(copy.deepcopy(model), cut)[0](x).detach(), y


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Poll ``condition`` (a test helper: the server acts on its own schedule)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_idle_streams_on_one_token_are_refused_at_once_and_others_are_served(
    trunk_server_factory,
):
    model = digits_like_model("cnn")
    server = trunk_server_factory(model, max_streams=8)
    acts, y = batch_at(model, 1)
    hog = server.token(1, client="hog")
    first = server.channel(hog)
    first.forward(acts, y)  # holds the token's one stream
    refused = []
    for _ in range(30):  # a few dozen more streams on the same token
        extra = server.channel(hog, reply_timeout_s=10)
        with pytest.raises(TrunkRejected, match="RESOURCE_EXHAUSTED") as err:
            extra.forward(acts, y)
        refused.append(str(err.value))
        extra.close()
    assert len(refused) == 30
    # A new client gets a worker and trains.
    other = server.channel(server.token(1, client="new"))
    assert other.forward(acts, y)[0].shape == acts.shape
    other.close()
    first.close()
    assert server.trunk.steps == 2


def test_streams_past_the_service_limit_are_refused_not_queued(trunk_server_factory):
    model = digits_like_model("cnn")
    server = trunk_server_factory(model, max_streams=3)
    acts, y = batch_at(model, 1)
    held = [server.channel(server.token(1, client=f"c{i}")) for i in range(3)]
    for channel in held:
        channel.forward(acts, y)
    late = server.channel(server.token(1, client="late"), reply_timeout_s=10)
    with pytest.raises(TrunkRejected, match="RESOURCE_EXHAUSTED"):
        late.forward(acts, y)
    late.close()
    held[0].close()  # a worker frees up: a newcomer is served again
    assert wait_until(lambda: server.endpoint.open_sessions == 2)
    again = server.channel(server.token(1, client="again"))
    assert again.forward(acts, y)[0].shape == acts.shape
    for channel in (again, *held[1:]):
        channel.close()


def test_streams_close_when_idle_expired_or_revoked(trunk_server_factory):
    model = digits_like_model("cnn")
    server = trunk_server_factory(
        model, dataplane=DataPlaneConfig(max_frame_bytes=1 << 20, max_batch=64, idle_timeout_s=0.3),
        watchdog_s=0.05,
    )
    acts, y = batch_at(model, 1)
    idle = server.channel(server.token(1, client="idle"))
    idle.forward(acts, y)
    assert wait_until(lambda: server.endpoint.open_sessions == 0)
    with pytest.raises(TrunkRejected, match="CANCELLED"):
        idle.forward(acts, y)
    expiring = server.channel(server.token(1, client="short", ttl_s=0.5))
    expiring.forward(acts, y)
    assert wait_until(lambda: server.endpoint.open_sessions == 0)
    with pytest.raises(TrunkRejected, match="CANCELLED|UNAUTHENTICATED"):
        expiring.forward(acts, y)
    revoked = server.channel(server.token(1, client="rev", server_round=3))
    revoked.forward(acts, y)
    server.tokens.revoke_round(3)
    assert server.endpoint.open_sessions == 0  # closed by the revocation itself
    for channel in (idle, expiring, revoked):
        channel.close()


def test_a_stolen_token_gets_no_second_stream_and_its_refusals_are_not_the_owners(
    trunk_server_factory,
):
    model = digits_like_model("cnn")
    server = trunk_server_factory(model)
    acts, y = batch_at(model, 1)
    token = server.token(1, client="owner")
    owner = server.channel(token)
    owner.forward(acts, y)
    thief = server.channel(token, reply_timeout_s=10)
    with pytest.raises(TrunkRejected, match="RESOURCE_EXHAUSTED"):
        thief.forward(acts, y)
    thief.close()
    owner.close()
    # With a second stream allowed, a thief's bad frames are booked against its own stream.
    lenient = trunk_server_factory(
        model, dataplane=DataPlaneConfig(max_frame_bytes=1 << 20, max_batch=64, streams_per_token=2)
    )
    token = lenient.token(1, client="owner")
    owner, thief = lenient.channel(token), lenient.channel(token)
    owner.forward(acts, y)
    for _ in range(3):
        assert send_raw(thief, b"junk").WhichOneof("kind") == "refusal"
    owner.forward(acts, y)
    assert list(lenient.endpoint.refusals.values()) == [3]  # one peer, the thief's
    owner.close()
    thief.close()


def test_a_token_bound_to_its_node_is_refused_to_another_node_over_grpc(trunk_server_factory):
    model = digits_like_model("cnn")
    server = trunk_server_factory(model)
    acts, y = batch_at(model, 1)
    owner_key, thief_key = new_private_key(), new_private_key()
    token = server.token(1, client="owner", node_key=public_key_of(owner_key))
    server.token(1, client="thief", node_key=public_key_of(thief_key))  # its own grant
    for proof, refusal in (
        (None, "UNAUTHENTICATED: this token is bound to node owner's key: no proof"),
        (prove(thief_key, token), "PERMISSION_DENIED: token belongs to another node: it was "
                                  "issued to node owner, and the stream's proof is node thief's"),
        (b"\x00" * 80, "UNAUTHENTICATED: node proof does not verify"),
    ):
        thief = server.channel(token, proof=proof, reply_timeout_s=10)
        with pytest.raises(TrunkRejected, match=refusal):
            thief.forward(acts, y)
        thief.close()
    assert server.trunk.steps == 0
    owner = server.channel(token, proof=prove(owner_key, token))
    assert owner.forward(acts, y)[0].shape == acts.shape  # the refusals cost the owner nothing
    owner.close()


def test_a_stalled_trunk_cannot_hang_a_client_or_the_shutdown(trunk_server_factory):
    model = digits_like_model("cnn")
    release = threading.Event()

    class Stalled(SplitSession):
        def handle(self, session, request):
            release.wait(30)
            return super().handle(session, request)

    server = trunk_server_factory(
        model, handler=lambda trunk, dataplane: Stalled(SharedTrunk(trunk), dataplane=dataplane)
    )
    acts, y = batch_at(model, 1)
    channel = server.channel(server.token(1), reply_timeout_s=0.3)
    with pytest.raises(TrunkRejected, match="no reply from the trunk within 0.3 s"):
        channel.forward(acts, y)
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (server.service.stop(0.1), stopped.set()))
    stopper.start()
    # Bounded: the stop returns even though a handler is still stuck in the trunk.
    assert stopped.wait(20)
    release.set()
    stopper.join()


def test_extreme_values_never_reach_the_weights(trunk_server_factory):
    model = digits_like_model("cnn")
    unbounded = DataPlaneConfig(max_frame_bytes=1 << 20, max_batch=64, max_abs_value=float("inf"))
    server = trunk_server_factory(model, dataplane=unbounded)
    acts, y = batch_at(model, 1)
    before = [p.detach().clone() for p in server.model.parameters()]
    channel = server.channel(server.token(1))
    with pytest.raises(TrunkRejected, match="STEP_NOT_FINITE"):
        channel.forward(torch.full_like(acts, 3e38), y)
    assert all(torch.equal(a, p) for a, p in zip(before, server.model.parameters(), strict=True))
    assert server.trunk.steps == 0
    channel.close()
    # The same session still trains on sane values afterwards.
    report = train_split_client(copy.deepcopy(model), 1, fixed_batches(3),
                                server.channel(server.token(1, client="sane")), lr=0.1)
    assert report.steps == 3 and server.trunk.steps == 3
    assert all(torch.isfinite(p).all() for p in server.model.parameters())

