"""The data plane over WebSocket: the same frames, endpoint, tokens and refusals as gRPC.

Browsers reach the trunk over a WebSocket (``splitlearn/dataplane/websocket.py``). These
tests talk to a real service on 127.0.0.1 with the Python transport and with raw sockets
(training over it equals the whole model: ``test_dataplane.py``): every bad frame gets the
refusal it gets over gRPC while a gRPC device trains beside it, and a connection that
breaks the hello, the token, the node key, the stream limit or TLS is closed with a code and
a reason.
"""

from __future__ import annotations

import base64
import copy
import csv
import json
import ssl
import threading

import pytest
import torch
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import connect

from clients.app import TRANSPORT_KEY, build_client_app, trunk_channel
from experiments.local import LocalGrid, run_local
from splitlearn.dataplane import TrunkRejected, TrunkWebSocketService
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.node_keys import new_private_key, prove, public_key_of
from splitlearn.dataplane.websocket import CLOSE_CODES, parse_hello
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches, small_config
from tests.helpers import send_raw, train_split_client
from tests.integration.test_dataplane import BAD_FRAMES, LR, forward_request


def test_bad_frames_over_websocket_get_grpcs_refusals_while_a_grpc_device_trains(
        trunk_server_factory):
    reference = digits_like_model("cnn")
    cut = 2
    server = trunk_server_factory(reference, lr=LR)
    shape = server.model.cut_shape(cut)
    good = server.channel(server.token(cut, client="good"))
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("r", train_split_client(
        copy.deepcopy(reference), cut, fixed_batches(30, seed=1), good, lr=LR)))
    thread.start()
    bad = server.channel(server.token(cut, client="bad"), transport="websocket")
    for label, (make, reason) in BAD_FRAMES.items():
        reply = send_raw(bad, make(shape, bad.next_seq()))
        assert pb.Refusal.Reason.Name(reply.refusal.reason) == reason, f"{label}: {reply}"
    # A text message is a malformed frame, refused the same way; the session carries on.
    bad.transport._connection.send("not a frame")  # noqa: SLF001 - a raw text message
    reply = pb.Reply.FromString(bad.transport.receive(30.0))
    assert pb.Refusal.Reason.Name(reply.refusal.reason) == "MALFORMED"
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(copy.deepcopy(reference), cut)[0](x).detach()
    grad, _, _ = bad.forward(acts, y)
    assert grad.shape == acts.shape
    bad.close()
    thread.join(timeout=60)
    good.close()
    assert done["r"].steps == 30 and server.trunk.steps == 31
    assert sum(server.endpoint.refusals.values()) == len(BAD_FRAMES) + 1


def closed_with(url: str, *messages: str | bytes, context: ssl.SSLContext | None = None
                ) -> tuple[int, str]:
    """Open a raw WebSocket, send ``messages``, return how the service closed it."""
    with connect(url, ssl=context, open_timeout=10) as ws:
        try:
            for message in messages:
                ws.send(message)
            while True:
                ws.recv(timeout=15)
        except ConnectionClosed as closed:
            assert closed.rcvd is not None, "the service closed without a close frame"
            return closed.rcvd.code, closed.rcvd.reason
    raise AssertionError("the service did not close the connection")


def test_a_connection_without_a_valid_hello_and_token_is_closed_with_a_reason(
        trunk_server_factory):
    server = trunk_server_factory(digits_like_model("cnn"), lr=LR)
    url = server.websocket_url()
    good_hello = json.dumps({"token": server.token(1)})
    cases = {
        "binary hello": ((b'{"token": "x"}',), "INVALID_ARGUMENT", "text message"),
        "not JSON": (("token please",), "INVALID_ARGUMENT", "not JSON"),
        "no token": (('{"tok": 1}',), "INVALID_ARGUMENT", "token"),
        "proof not base64": ((json.dumps({"token": "t", "proof": "%%"}),), "INVALID_ARGUMENT",
                             "base64"),
        "unknown token": ((json.dumps({"token": "forged"}),), "UNAUTHENTICATED", "unknown"),
    }
    for label, (messages, status, words) in cases.items():
        code, reason = closed_with(url, *messages)
        assert code == CLOSE_CODES[status] and reason.startswith(status), (label, reason)
        assert words in reason, (label, reason)
    code, reason = closed_with(url.replace("/trunk", "/elsewhere"), good_hello)
    assert code == CLOSE_CODES["NOT_FOUND"]
    assert server.trunk.steps == 0 and server.endpoint.open_sessions == 0


def test_a_token_bound_to_a_node_key_needs_that_nodes_proof(trunk_server_factory):
    server = trunk_server_factory(digits_like_model("cnn"), lr=LR)
    key = new_private_key()
    token = server.token(1, node_key=public_key_of(key))
    for proof, words in ((None, "proof"), (prove(new_private_key(), token), "did not sign")):
        hello = {"token": token} | ({} if proof is None else
                                    {"proof": base64.b64encode(proof).decode()})
        code, reason = closed_with(server.websocket_url(), json.dumps(hello))
        assert code == CLOSE_CODES["UNAUTHENTICATED"], reason
        assert reason.startswith("UNAUTHENTICATED") and words in reason, reason
    channel = server.channel(token, transport="websocket", proof=prove(key, token))
    x, y = fixed_batches(1, batch=4)[0]
    channel.forward(split(digits_like_model("cnn"), 1)[0](x).detach(), y)
    channel.close()
    assert server.trunk.steps == 1


def test_streams_beyond_the_limit_are_closed_at_once(trunk_server_factory):
    server = trunk_server_factory(digits_like_model("cnn"), lr=LR)
    limited = TrunkWebSocketService(server.endpoint, max_streams=1)
    limited.start()
    try:
        holder = connect(limited.url)
        token = server.token(1, client="b")
        holder.send(json.dumps({"token": token}))
        assert json.loads(holder.recv(timeout=10)) == {"attached": True}
        code, reason = closed_with(limited.url, json.dumps({"token": server.token(1, "c")}))
        assert code == CLOSE_CODES["RESOURCE_EXHAUSTED"], reason
        # A second stream on a token that holds one, on another service: the same refusal.
        code, reason = closed_with(server.websocket_url(), json.dumps({"token": token}))
        assert code == CLOSE_CODES["RESOURCE_EXHAUSTED"] and "RESOURCE_EXHAUSTED" in reason
        holder.close()
    finally:
        limited.stop()


def test_a_revoked_round_closes_its_websockets(trunk_server_factory):
    server = trunk_server_factory(digits_like_model("cnn"), lr=LR)
    channel = server.channel(server.token(1, server_round=3), transport="websocket")
    x, y = fixed_batches(1, batch=4)[0]
    acts = split(digits_like_model("cnn"), 1)[0](x).detach()
    channel.forward(acts, y)
    server.tokens.revoke_round(3)
    with pytest.raises(TrunkRejected, match="CANCELLED"):
        channel.forward(acts, y)
    assert server.trunk.steps == 1


def test_a_message_beyond_twice_the_frame_limit_ends_only_its_own_connection(
        trunk_server_factory):
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference, lr=LR)
    url = server.websocket_url()
    huge = forward_request(torch.zeros(600_000), torch.zeros(4, dtype=torch.int64), 1)
    assert len(huge) > 2 * server.endpoint.dataplane.max_frame_bytes
    code, _ = closed_with(url, json.dumps({"token": server.token(1, client="big")}), huge)
    assert code == 1009  # "message too big" (RFC 6455): the socket's limit, before parsing
    channel = server.channel(server.token(1, client="next"), transport="websocket")
    report = train_split_client(copy.deepcopy(reference), 1, fixed_batches(2), channel, lr=LR)
    channel.close()
    assert report.steps == 2


def test_wss_serves_only_devices_that_verify_it(trunk_server_factory, tmp_path):
    from experiments.certificates import make_certificates

    files = make_certificates(tmp_path / "ours")
    stranger = make_certificates(tmp_path / "stranger", name="stranger")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(files.certificate, files.key)
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference, lr=LR, ws_context=context)
    assert server.websocket_url().startswith("wss://")
    with pytest.raises(TrunkRejected, match="UNAVAILABLE"):
        server.channel(server.token(1), transport="websocket",
                       root_certificates=stranger.ca.read_bytes())
    with pytest.raises((InvalidHandshake, ConnectionClosed, OSError)):  # plaintext to TLS
        closed_with(server.websocket_url().replace("wss://", "ws://"), "{}")
    channel = server.channel(server.token(1), transport="websocket",
                             root_certificates=files.ca.read_bytes())
    report = train_split_client(copy.deepcopy(reference), 1, fixed_batches(3), channel, lr=LR)
    channel.close()
    assert report.steps == 3 and server.trunk.steps == 3


@pytest.mark.parametrize("hello", ['{"token": "t"}', '{"token": "t", "proof": "AAEC"}'])
def test_a_hello_gives_its_token_and_proof(hello):
    token, proof = parse_hello(hello)
    assert token == "t" and proof in (None, b"\x00\x01\x02")


# --- a run: the shipped strategy and ClientApp, some devices over WebSocket --------------


class MixedTransports(LocalGrid):
    """Odd nodes reach the trunk over WebSocket (node config), even ones over gRPC."""

    def __init__(self, client_app, *, num_nodes: int, concurrency: int = 1) -> None:  # noqa: ANN001
        super().__init__(client_app, num_nodes=num_nodes, concurrency=concurrency)
        for node, context in self.contexts.items():
            if node % 2:
                context.node_config[TRANSPORT_KEY] = "websocket"


def networked(channels, runtime):  # noqa: ANN001, ANN201 - run_local's client_app hook
    """The shipped ClientApp dialing the trunk over the network, as a SuperNode's does."""
    return build_client_app(trunk_channel)


def run_rounds(run_dir, grid, *overrides: str) -> tuple[dict, list[dict]]:  # noqa: ANN001
    result = run_local(small_config(*overrides, run_dir=str(run_dir)), grid_type=grid,
                       client_app=networked)
    with open(run_dir / "clients.csv") as f:
        return result.history[-1], list(csv.DictReader(f))


def test_devices_over_websocket_and_grpc_train_a_run_as_all_grpc_ones_do(tmp_path):
    mixed, rows = run_rounds(tmp_path / "mixed", MixedTransports, "dataplane.websocket_port=0")
    plain, _ = run_rounds(tmp_path / "grpc", LocalGrid)
    assert [r["status"] for r in rows] == ["ok"] * len(rows)
    assert all(int(r["bytes_up"]) > 0 for r in rows)
    assert mixed["test_accuracy"] == plain["test_accuracy"]  # the same frames, in the same order
    assert mixed["test_loss"] == pytest.approx(plain["test_loss"], rel=1e-6)


def test_a_websocket_device_fails_with_a_reason_when_the_trunk_serves_none(tmp_path):
    _, rows = run_rounds(tmp_path, MixedTransports)
    odd = [r for r in rows if int(r["partition_id"]) % 2 == 0]  # node = partition + 1
    assert odd and all(r["status"] == "failed" for r in odd)
    assert all("dataplane.websocket_port" in r["reason"] for r in odd)
    assert all(r["status"] == "ok" for r in rows if r not in odd)


def test_a_node_dials_the_address_of_its_transport():
    from clients.app import trunk_address
    from clients.device import DeviceFailure

    record = {"trunk_address": "h:1", "trunk_websocket": "ws://h:2/trunk"}
    assert trunk_address(record, "grpc") == "h:1"
    assert trunk_address(record, "websocket") == "ws://h:2/trunk"
    assert trunk_address({}, "websocket") == ""  # a protocol without a data plane
    with pytest.raises(DeviceFailure, match='expected "grpc" or "websocket"'):
        trunk_address(record, "pigeon")
