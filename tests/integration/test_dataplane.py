"""The gRPC data plane: split training equals whole-model training; bad input is refused."""

from __future__ import annotations

import copy
import logging
import threading
import time

import grpc
import pytest
import torch

from splitlearn.dataplane import TrunkRejected
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import encode_tensor
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import max_param_diff, send_raw, train_split_client, train_whole

LR = 0.1
STEPS = 20


def open_channel(server, cut: int, transport: str, client: str = "c0"):
    token = server.token(cut, client=client)
    if transport == "in_process":
        return server.local_channel(token)
    return server.channel(token, transport=transport)  # grpc, websocket (browsers' framing)


@pytest.mark.parametrize("transport", ["grpc", "websocket", "in_process"])
@pytest.mark.parametrize("name", ["cnn", "resnet"])
def test_split_training_equals_whole_model_at_every_cut(trunk_server_factory, name, transport):
    reference = digits_like_model(name)
    batches = fixed_batches(STEPS)
    whole = copy.deepcopy(reference)
    train_whole(whole, batches, LR)
    for cut in reference.valid_cuts:
        # Bit for bit needs the trunk in the layout the whole model trains in: channels-last
        # kernels round differently on some CPUs (on AVX-512 the ResNet drifted 1.7e-3 in 20
        # steps from 1e-7 at the first); tests/unit/test_trunk.py compares the two layouts.
        server = trunk_server_factory(reference, lr=LR, channels_last=False)
        client_model = copy.deepcopy(reference)
        channel = open_channel(server, cut, transport)
        report = train_split_client(client_model, cut, batches, channel, lr=LR)
        channel.close()
        assert report.steps == STEPS
        # The joined model: client's stages below the cut, trunk's above it.
        joined = copy.deepcopy(server.model)
        for i in range(cut):
            joined.stages[i] = client_model.stages[i]
        diff = max_param_diff(joined, whole)
        assert diff <= 1e-5, f"{name} cut {cut} via {transport}: max abs diff {diff}"


def trunk_params(server) -> list[torch.Tensor]:
    return [p.detach().clone() for p in server.model.parameters()]


def forward_request(activations: torch.Tensor, labels: torch.Tensor, seq: int) -> bytes:
    return pb.Request(seq=seq, forward=pb.Forward(
        activations=encode_tensor(activations).to_proto(),
        labels=encode_tensor(labels).to_proto())).SerializeToString()


LABELS = torch.zeros(4, dtype=torch.int64)
#: Bad requests (for cut shape ``s`` and sequence number ``q``), and the reason each gets.
BAD_FRAMES = {
    "wrong shape": (lambda s, q: forward_request(torch.randn(4, *s[:-1], s[-1] + 1), LABELS, q),
                    "BAD_TENSOR"),
    "nan": (lambda s, q: forward_request(torch.full((4, *s), float("nan")), LABELS, q),
            "NOT_FINITE"),
    "near float32 max": (lambda s, q: forward_request(torch.full((4, *s), 3e38), LABELS, q),
                         "OUT_OF_RANGE"),
    "wrong dtype": (lambda s, q: forward_request(torch.ones(4, *s, dtype=torch.int64), LABELS, q),
                    "BAD_TENSOR"),
    "labels out of range": (lambda s, q: forward_request(torch.zeros(4, *s), LABELS + 10, q),
                            "OUT_OF_RANGE"),
    "oversized": (lambda s, q: forward_request(torch.zeros(300_000), LABELS, q), "TOO_LARGE"),
    "not a frame": (lambda s, q: b"\xff\x00garbage", "MALFORMED"),
    "replayed": (lambda s, q: forward_request(torch.zeros(4, *s), LABELS, 1), "REPLAYED"),
}


def test_bad_frames_are_refused_while_another_client_trains(trunk_server_factory):
    reference = digits_like_model("cnn")
    cut = 2
    server = trunk_server_factory(reference, lr=LR)
    shape = server.model.cut_shape(cut)

    # A well-behaved client trains in parallel for the whole test.
    good_report = {}
    good_channel = open_channel(server, cut, "grpc", client="good")

    def good_client() -> None:
        good_report["r"] = train_split_client(
            copy.deepcopy(reference), cut, fixed_batches(40, seed=1), good_channel, lr=LR
        )

    thread = threading.Thread(target=good_client)
    thread.start()
    bad = open_channel(server, cut, "grpc", client="bad")
    for label, (make, reason) in BAD_FRAMES.items():
        reply = send_raw(bad, make(shape, bad.next_seq()))
        assert reply.WhichOneof("kind") == "refusal", label
        assert pb.Refusal.Reason.Name(reply.refusal.reason) == reason, f"{label}: {reply.refusal}"
    # The stream survives refusals: a valid frame on it still trains.
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(copy.deepcopy(reference), cut)[0](x)
    grad, _, _ = bad.forward(acts.detach(), y)
    assert grad.shape == acts.shape
    bad.close()
    thread.join(timeout=60)
    good_channel.close()
    assert good_report["r"].steps == 40
    # Every refusal is booked against the stream that sent it, none against the good one.
    assert sum(server.endpoint.refusals.values()) == len(BAD_FRAMES)
    assert server.trunk.steps == 41


def test_refusals_leave_trunk_weights_unchanged(trunk_server_factory):
    reference = digits_like_model("cnn")
    cut = 1
    server = trunk_server_factory(reference, lr=LR)
    shape = server.model.cut_shape(cut)
    before = trunk_params(server)
    channel = open_channel(server, cut, "grpc")
    for make, _ in BAD_FRAMES.values():
        assert send_raw(channel, make(shape, channel.next_seq())).WhichOneof("kind") == "refusal"
    channel.close()
    assert all(torch.equal(a, b) for a, b in zip(before, trunk_params(server), strict=True))
    assert server.trunk.steps == 0


def test_bad_token_is_refused_with_a_reason(trunk_server_factory):
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference)
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(copy.deepcopy(reference), 1)[0](x).detach()
    channel = server.channel("not-a-token")
    with pytest.raises(TrunkRejected, match="UNAUTHENTICATED: session token rejected"):
        channel.forward(acts, y)
    channel.close()
    # A revoked token stops working too: its open stream is closed at once.
    channel = open_channel(server, 1, "grpc")
    channel.forward(acts, y)
    server.tokens.revoke_round(1)
    with pytest.raises(TrunkRejected, match="CANCELLED|token rejected"):
        channel.forward(acts, y)
    channel.close()
    assert server.trunk.steps == 1


def test_activations_shaped_for_another_cut_are_refused(trunk_server_factory):
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference)
    x, y = fixed_batches(1, batch=4)[0]
    acts_cut2 = split(copy.deepcopy(reference), 2)[0](x).detach()
    channel = open_channel(server, 1, "grpc")  # the token says cut 1
    with pytest.raises(TrunkRejected, match="BAD_TENSOR.*for this client's cut"):
        channel.forward(acts_cut2, y)
    channel.close()


def test_client_vanishing_mid_round_leaves_trunk_serving(trunk_server_factory):
    reference = digits_like_model("cnn")
    cut = 2
    server = trunk_server_factory(reference, lr=LR)
    vanishing = open_channel(server, cut, "grpc", client="gone")

    def vanish(step: int) -> None:
        if step == 3:
            vanishing.abort()
            raise ConnectionAbortedError("device vanished")

    with pytest.raises(ConnectionAbortedError):
        train_split_client(copy.deepcopy(reference), cut, fixed_batches(10), vanishing, lr=LR,
                           on_step=vanish)
    assert server.trunk.steps == 3
    # Others (and newcomers) carry on; every trunk step was whole.
    other = open_channel(server, cut, "grpc", client="other")
    report = train_split_client(copy.deepcopy(reference), cut, fixed_batches(5, seed=2), other,
                                lr=LR)
    other.close()
    assert report.steps == 5 and server.trunk.steps == 8
    assert all(torch.isfinite(p).all() for p in server.model.parameters())


def abrupt_ends(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "ended abruptly" in r.getMessage()]


def test_a_closing_device_is_not_logged_as_vanished_and_a_vanishing_one_is_detached(
        trunk_server_factory, caplog):
    """Over gRPC: the device that closes ends its stream cleanly; the one that aborts is
    detached, and logged as ended abruptly unless gRPC let its cancel look like a half-close
    (the ways a stream ends, each reached every time, are the next test's)."""
    caplog.set_level(logging.INFO, logger="splitlearn.dataplane.service")
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference, lr=LR)
    for client, end in (("leaving", "close"), ("gone", "abort")):
        channel = open_channel(server, 2, "grpc", client=client)
        train_split_client(copy.deepcopy(reference), 2, fixed_batches(2), channel, lr=LR)
        getattr(channel, end)()
        if end == "close":  # close returns once the trunk ended the stream
            assert server.endpoint.open_sessions == 0 and abrupt_ends(caplog) == []
    deadline = time.monotonic() + 10
    while server.endpoint.open_sessions and time.monotonic() < deadline:
        time.sleep(0.01)  # the trunk notices the cancel
    assert server.endpoint.open_sessions == 0
    assert abrupt_ends(caplog) in ([], ["data plane: a stream of client gone ended abruptly"])
    assert server.trunk.steps == 4


class _Stream:
    """The service's view of one stream, for a way it can end that gRPC reaches by a race.

    A stand-in for the servicer context (metadata, peer, and whether gRPC still holds the
    call active) and for the request iterator.
    """

    def __init__(self, token: str, requests: list[bytes], *, ends: str) -> None:
        self.metadata = (("x-splitlearn-token", token),)
        self.requests, self.ends = requests, ends

    def invocation_metadata(self):
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def cancel(self) -> None:
        pass

    def is_active(self) -> bool:
        return self.ends != "cancel marked as the requests ran out"

    def __iter__(self):
        yield from self.requests
        if self.ends == "cancel raised while reading":
            raise grpc.RpcError()


@pytest.mark.parametrize("ends,abrupt", [
    ("half-close", False),
    # gRPC ends the request iterator on a cancel too when it reads the end of the stream
    # before it marks the call cancelled; it is marked by the time the handler looks.
    ("cancel marked as the requests ran out", True),
    ("cancel raised while reading", True),
    # A cancel while a reply is being sent: gRPC stops resuming the handler's generator
    # and closes it, without an RpcError.
    ("cancel while a reply is sent", True),
])
def test_every_way_a_stream_ends_detaches_it_and_only_a_half_close_is_clean(
        trunk_server_factory, caplog, ends, abrupt):
    caplog.set_level(logging.INFO, logger="splitlearn.dataplane.service")
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference, lr=LR)
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(copy.deepcopy(reference), 1)[0](x).detach()
    stream = _Stream(server.token(1, client="c"), [forward_request(acts, y, 1)], ends=ends)
    replies = server.service._exchange(iter(stream), stream)
    assert pb.Reply.FromString(next(replies)).WhichOneof("kind") == "gradient"
    assert server.endpoint.open_sessions == 1
    if ends == "cancel while a reply is sent":
        replies.close()
    else:
        assert list(replies) == []
    assert abrupt_ends(caplog) == (
        ["data plane: a stream of client c ended abruptly"] if abrupt else [])
    assert server.endpoint.open_sessions == 0 and server.trunk.steps == 1


NATIVE_CLIENT = """
import json, sys
import grpc, numpy as np
import trunk_pb2 as pb, trunk_pb2_grpc as rpc

address, token = sys.argv[1], sys.argv[2]
seq = int(sys.argv[3]) if len(sys.argv) > 3 else 1
acts = np.load("acts.npy"); labels = np.load("labels.npy")
def tensor(a, dtype):  # dtype + shape + little-endian bytes, as trunk.proto says
    return pb.Tensor(dtype=dtype, shape=list(a.shape), data=a.tobytes())
request = pb.Request(seq=seq, forward=pb.Forward(
    activations=tensor(acts, pb.FLOAT32), labels=tensor(labels, pb.INT64)))
with grpc.insecure_channel(address) as channel:
    try:
        reply = next(rpc.TrunkStub(channel).Exchange(
            iter([request]), metadata=(("x-splitlearn-token", token),), timeout=30))
    except grpc.RpcError as err:  # the session itself refused (gRPC status)
        print(json.dumps([seq, "status", err.code().name, 0.0]))
        sys.exit(0)
kind = reply.WhichOneof("kind")
if kind == "gradient":
    grad = np.frombuffer(reply.gradient.grad.data, dtype=np.float32).reshape(
        reply.gradient.grad.shape)
    np.save("grad.npy", grad)
    print(json.dumps([reply.seq, kind, list(grad.shape), reply.gradient.loss]))
else:
    print(json.dumps([reply.seq, kind, pb.Refusal.Reason.Name(reply.refusal.reason), 0.0]))
"""


def run_native_client(tmp_path, address: str, token: str, acts, labels, *, seq: int = 1):
    """Generate stubs from trunk.proto alone and send one forward from a fresh process."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np
    from grpc_tools import protoc

    if not (tmp_path / "trunk_pb2.py").exists():
        proto = Path(__file__).resolve().parents[2] / "splitlearn" / "dataplane" / "trunk.proto"
        assert protoc.main(["protoc", f"-I{proto.parent}", f"--python_out={tmp_path}",
                            f"--grpc_python_out={tmp_path}", str(proto)]) == 0
        (tmp_path / "client.py").write_text(NATIVE_CLIENT)
    np.save(tmp_path / "acts.npy", acts.numpy())
    np.save(tmp_path / "labels.npy", labels.numpy())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of ours
    done = subprocess.run([sys.executable, "client.py", address, token, str(seq)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_client_built_from_the_proto_alone_trains(trunk_server_factory, tmp_path):
    """A native client's view: stubs generated from trunk.proto and nothing else of ours."""
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference)
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(copy.deepcopy(reference), 1)[0](x).detach()
    seq, kind, shape, loss = run_native_client(tmp_path, server.service.address,
                                               server.token(1), acts, y)
    assert (seq, kind, shape) == (1, "gradient", list(acts.shape))
    assert loss > 0 and server.trunk.steps == 1


def test_a_trunk_served_in_a_few_lines_trains_a_proto_client_as_the_whole_model_does(tmp_path):
    """serve_trunk: one protocol's trunk from a model and its options, no Flower run.

    The gradient the proto-only client gets is the whole model's at the cut, the trunk's
    weights after the step are the whole model's after one SGD step, and a fresh stream
    of the same token resumes above the last sequence number (a replay is refused).
    """
    import numpy as np

    from protocols.splitfed import SplitFedV2Options
    from server.standalone import serve_trunk
    from splitlearn.config import DataPlaneConfig

    model, reference = digits_like_model("cnn"), digits_like_model("cnn")
    x, y = fixed_batches(1, batch=4)[0]
    bottom, top = split(reference, 1)
    acts = bottom(x).detach().requires_grad_()
    torch.nn.functional.cross_entropy(top(acts), y).backward()
    torch.optim.SGD(top.parameters(), lr=LR).step()
    options = SplitFedV2Options(lr=LR, momentum=0.0)
    with serve_trunk(model, options, DataPlaneConfig(channels_last=False)) as served:
        token = served.grant("native-0", cut=1)
        seq, kind, _, loss = run_native_client(tmp_path, served.address, token, acts.detach(), y)
        assert (seq, kind) == (1, "gradient") and loss > 0
        grad = torch.from_numpy(np.load(tmp_path / "grad.npy"))
        assert torch.allclose(grad, acts.grad, atol=1e-6)
        assert max_param_diff(served.trunk.model, reference) <= 1e-6
        # A fresh stream of the same token: seq 1 again is a replay; above it resumes.
        assert run_native_client(tmp_path, served.address, token, acts.detach(), y)[1:3] == [
            "refusal", "REPLAYED"]
        assert run_native_client(tmp_path, served.address, token, acts.detach(), y,
                                 seq=2)[:2] == [2, "gradient"]
        assert served.trunk.steps == 2
        served.finish_round(["native-0"])
        assert run_native_client(tmp_path, served.address, token, acts.detach(), y,
                                 seq=3)[1:3] == ["status", "UNAUTHENTICATED"]


def test_tls_trunk_serves_only_clients_that_verify_it(trunk_server_factory, tmp_path):
    import grpc

    from experiments.certificates import make_certificates

    files = make_certificates(tmp_path / "ours")
    stranger = make_certificates(tmp_path / "stranger", name="stranger")
    credentials = grpc.ssl_server_credentials(
        [(files.key.read_bytes(), files.certificate.read_bytes())])
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference, lr=LR, server_credentials=credentials)
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(copy.deepcopy(reference), 1)[0](x).detach()
    # A plaintext client, and one that trusts another CA, get no session.
    for kwargs in ({}, {"root_certificates": stranger.ca.read_bytes()}):
        channel = server.channel(server.token(1), **kwargs)
        with pytest.raises(TrunkRejected, match="UNAVAILABLE"):
            channel.forward(acts, y)
        channel.close()
    assert server.trunk.steps == 0
    # A client verifying the trunk by our CA trains as over plaintext.
    channel = server.channel(server.token(1), root_certificates=files.ca.read_bytes())
    report = train_split_client(copy.deepcopy(reference), 1, fixed_batches(3), channel, lr=LR)
    channel.close()
    assert report.steps == 3 and server.trunk.steps == 3


def test_a_device_flooding_bad_frames_loses_its_session_and_the_others_train_on(
        trunk_server_factory, caplog):
    """Each bad frame is refused in milliseconds, but one after another they held the
    interpreter (an honest device fell from 75 to 22 steps a second) and logged a line
    each: past dataplane.max_refusals the flooding device's token is revoked."""
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference, lr=LR)
    limit = server.endpoint.dataplane.max_refusals
    assert limit > 0
    honest = open_channel(server, 1, "grpc", client="honest")
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(copy.deepcopy(reference), 1)[0](x).detach()
    token = server.token(1, client="flood")
    flood = server.channel(token)
    reasons = []
    with caplog.at_level(logging.WARNING, logger="splitlearn.dataplane.endpoint"):
        with pytest.raises(TrunkRejected):  # the limit-th frame's reply never comes: closed
            for _ in range(limit + 5):
                reasons.append(pb.Refusal.Reason.Name(
                    send_raw(flood, b"\xff\x00garbage").refusal.reason))
        honest.forward(acts, y)  # the others carry on
    assert reasons == ["MALFORMED"] * (limit - 1)
    assert server.tokens.lookup(token) is None  # no new stream on it either
    logged = [r for r in caplog.records if "client flood" in r.getMessage()]
    assert len(logged) == 9 and "max_refusals" in logged[-1].getMessage()  # 8, then the close
    honest.close()
    assert server.trunk.steps == 1


def test_back_pressure_and_quarantine_do_not_count_against_a_session():
    from splitlearn.config import DataPlaneConfig
    from splitlearn.dataplane import InProcessTransport, TokenRegistry, TrunkChannel, TrunkEndpoint
    from splitlearn.dataplane.codec import FrameError, Reason

    class Busy:
        def handle(self, session, request):  # noqa: ANN001, ANN201
            raise FrameError(Reason.BUSY, "the queue is full")

        def attach(self, session) -> None:  # noqa: ANN001
            """Nothing to set up."""

        def detach(self, session) -> None:  # noqa: ANN001
            """Nothing to drop."""

    tokens = TokenRegistry()
    endpoint = TrunkEndpoint({"busy": Busy()}, tokens, dataplane=DataPlaneConfig(max_refusals=2))
    token = tokens.issue(client="d", protocol="busy", cut=1, server_round=1, ttl_s=60)
    channel = TrunkChannel(InProcessTransport(endpoint, token))
    for _ in range(5):  # back-pressure five times: the session stays
        reply = send_raw(channel, forward_request(torch.zeros(4, 2), LABELS, channel.next_seq()))
        assert pb.Refusal.Reason.Name(reply.refusal.reason) == "BUSY"
    assert tokens.lookup(token) is not None
    send_raw(channel, b"\xff\x00garbage")
    send_raw(channel, b"\xff\x00garbage")  # the second counted refusal: closed
    assert tokens.lookup(token) is None
