"""A browser device trains against the real trunk over WebSocket, as the whole model trains.

The web runtime (web/dist/device.js in Debian's Chromium) writes and reads ``trunk.proto``
frames itself (web/src/wire.ts): its bytes are checked here against Python's own protobuf
both ways. Then the page opens a session on a trunk served on 127.0.0.1
(splitlearn/dataplane/websocket.py), trains the small CNN's stages below the cut on ten
batches (its forward, the trunk's gradient, its backward and SGD step), and the joined model
must equal whole-model SGD in PyTorch within ``TOLERANCE`` relative to each tensor's largest
value. The trunk's refusals reach the page with their reason, and the session carries on.
"""

from __future__ import annotations

import copy

import pytest
import torch

from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import encode_tensor
from splitlearn.stages import split
from splitlearn.web import describe_stages, state_from_web
from splitlearn.web import encode_tensor as web_tensor
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import train_whole
from tests.integration.test_web_step import (  # noqa: F401 - fixtures
    PHONE_BACKENDS,
    TOLERANCE,
    browser,
    page,
)

# On the backends a phone trains on (the cpu backend's arithmetic: test_web_step.py).
pytestmark = [pytest.mark.serial, pytest.mark.parametrize("page", PHONE_BACKENDS, indirect=True)]

LR = 0.1
STEPS = 10
CUT = 2


def device_state_into(joined, state: dict, stages: range) -> None:  # noqa: ANN001
    """Load the page's state (keys ``"<stage>.…"``) into ``joined``'s ``stages``."""
    for i in stages:
        joined.stages[i].load_state_dict({k.partition(".")[2]: v for k, v in state.items()
                                          if k.partition(".")[0] == str(i)})


def assert_equal_to(joined, whole) -> None:  # noqa: ANN001
    for (name, a), b in zip(joined.state_dict().items(), whole.state_dict().values(),
                            strict=True):
        if a.is_floating_point():
            scale = max(b.abs().max().item(), 1e-6)
            assert (a - b).abs().max().item() / scale < TOLERANCE, name



def test_the_pages_frames_are_protobufs_bytes_both_ways(page):  # noqa: F811
    values = torch.randn(3, 2, 4)
    frame = page.evaluate("""([shape, data, labels]) => {
        const w = splitlearnDevice.wire;
        const values = Float32Array.from(data);
        return Array.from(w.forwardRequest(7, w.float32Tensor(shape, values),
                                           w.int64Tensor(labels)));
    }""", [list(values.shape), values.flatten().tolist(), [0, 9, 3]])
    request = pb.Request.FromString(bytes(frame))
    assert request.seq == 7 and request.WhichOneof("kind") == "forward"
    acts = request.forward.activations
    assert acts.dtype == pb.FLOAT32 and list(acts.shape) == [3, 2, 4]
    assert torch.equal(torch.frombuffer(bytearray(acts.data), dtype=torch.float32).view(3, 2, 4),
                       values)
    labels = request.forward.labels
    assert labels.dtype == pb.INT64 and list(labels.shape) == [3]
    assert torch.frombuffer(bytearray(labels.data), dtype=torch.int64).tolist() == [0, 9, 3]
    grad = torch.randn(3, 2, 4)
    replies = {
        "gradient": pb.Reply(seq=7, gradient=pb.Gradient(
            grad=encode_tensor(grad).to_proto(), loss=1.25, correct=2)),
        "refusal": pb.Reply(seq=8, refusal=pb.Refusal(reason=pb.Refusal.OUT_OF_RANGE,
                                                      detail="labels beyond 9 ✓")),
    }
    for kind, reply in replies.items():
        read = page.evaluate("""bytes => {
            const r = splitlearnDevice.wire.readReply(Uint8Array.from(bytes));
            return {...r, values: r.tensor ? Array.from(
                splitlearnDevice.wire.float32Values(r.tensor)) : null,
                shape: r.tensor ? r.tensor.shape : null};
        }""", list(reply.SerializeToString()))
        assert read["seq"] == reply.seq and read["kind"] == kind
        if kind == "gradient":
            assert read["shape"] == [3, 2, 4] and read["loss"] == 1.25 and read["correct"] == 2
            assert torch.equal(torch.tensor(read["values"]).view(3, 2, 4), grad)
        else:
            assert read["reason"] == "OUT_OF_RANGE" and read["detail"] == "labels beyond 9 ✓"


def test_a_browser_device_trains_against_the_trunk_as_the_whole_model(page,  # noqa: F811
                                                                      trunk_server_factory):
    reference = digits_like_model("cnn")
    batches = fixed_batches(STEPS)
    whole = copy.deepcopy(reference)
    train_whole(whole, batches, LR)
    server = trunk_server_factory(reference, lr=LR, channels_last=False)
    bottom = copy.deepcopy(split(reference, CUT)[0]).train()
    page.evaluate("""async ([d, o, url, token]) => {
        globalThis.dev?.dispose();
        globalThis.dev = splitlearnDevice.load(d, o);
        globalThis.trunk = await splitlearnDevice.connect(url, token);
    }""", [describe_stages(bottom, reference.input_shape),
           {"lr": LR, "momentum": 0.0, "weight_decay": 0.0},
           server.websocket_url(), server.token(CUT, client="phone")])
    losses = []
    for x, y in batches:
        result = page.evaluate("([x, y]) => splitlearnDevice.trainBatch(dev, trunk, x, y)",
                               [web_tensor(x), y.tolist()])
        losses.append(result["loss"])
    sent = page.evaluate("() => { trunk.close(); return [trunk.bytesUp, trunk.bytesDown]; }")
    assert server.trunk.steps == STEPS and all(0 < loss < 5 for loss in losses)
    assert sent[0] > STEPS * x.numel() and sent[1] > 0
    joined = copy.deepcopy(server.model)
    device_state_into(joined, state_from_web(page.evaluate("() => dev.state()")), range(CUT))
    assert_equal_to(joined, whole)


def test_a_refusal_reaches_the_page_by_name_and_the_session_carries_on(page,  # noqa: F811
                                                                        trunk_server_factory):
    reference = digits_like_model("cnn")
    server = trunk_server_factory(reference, lr=LR)
    bottom = copy.deepcopy(split(reference, 1)[0]).train()
    x, y = fixed_batches(1, batch=4)[0]
    outcome = page.evaluate("""async ([d, url, token, x, y]) => {
        const dev = splitlearnDevice.load(d, {lr: 0.1, momentum: 0, weight_decay: 0});
        const trunk = await splitlearnDevice.connect(url, token);
        let refused = null;
        try {
            await splitlearnDevice.trainBatch(dev, trunk, x, y.map(v => v + 10));
        } catch (err) {
            refused = err instanceof splitlearnDevice.TrunkRefused ? err.reason : String(err);
        }
        const after = await splitlearnDevice.trainBatch(dev, trunk, x, y);
        trunk.close();
        dev.dispose();
        let unknown = null;
        try {
            await splitlearnDevice.connect(url, "forged");
        } catch (err) {
            unknown = err.message;
        }
        return {refused, loss: after.loss, unknown};
    }""", [describe_stages(bottom, reference.input_shape), server.websocket_url(),
           server.token(1, client="phone"), web_tensor(x), y.tolist()])
    assert outcome["refused"] == "OUT_OF_RANGE"
    assert outcome["loss"] > 0 and server.trunk.steps == 1
    assert outcome["unknown"].startswith("UNAUTHENTICATED")


def test_a_browser_ushaped_device_keeps_its_labels_and_trains_as_the_whole_model(
        page, trunk_server_factory):  # noqa: F811
    """SplitEasy's design: head and tail on the phone, the loss there; the trunk's gradient
    check (server/consistency.py) must accept what TensorFlow.js returns."""
    reference = digits_like_model("cnn")
    tail_cut = reference.num_stages - 1
    batches = fixed_batches(STEPS)
    whole = copy.deepcopy(reference)
    train_whole(whole, batches, LR)
    server = trunk_server_factory(reference, protocol="ushaped", lr=LR, channels_last=False)
    stages = list(copy.deepcopy(reference).stages)
    head, tail = torch.nn.Sequential(*stages[:1]), torch.nn.Sequential(*stages[tail_cut:])
    features = reference.cut_shape(tail_cut)
    sgd = {"lr": LR, "momentum": 0.0, "weight_decay": 0.0}
    page.evaluate("""async ([h, t, o, url, token]) => {
        globalThis.head = splitlearnDevice.load(h, o);
        globalThis.tail = splitlearnDevice.load(t, o);
        globalThis.trunk = await splitlearnDevice.connect(url, token);
    }""", [describe_stages(head, reference.input_shape), describe_stages(tail, features), sgd,
           server.websocket_url(), server.token(1, client="phone")])
    for x, y in batches:
        page.evaluate("([x, y]) => splitlearnDevice.trainUShapedBatch(head, tail, trunk, x, y)",
                      [web_tensor(x), y.tolist()])
    page.evaluate("() => trunk.close()")
    assert server.trunk.steps == STEPS
    joined = copy.deepcopy(server.model)
    head_state = state_from_web(page.evaluate("() => head.state()"))
    tail_state = {f"{tail_cut}.{k.partition('.')[2]}": v for k, v in
                  state_from_web(page.evaluate("() => tail.state()")).items()}
    device_state_into(joined, head_state, range(1))
    device_state_into(joined, tail_state, range(tail_cut, tail_cut + 1))
    assert_equal_to(joined, whole)
    page.evaluate("() => { head.dispose(); tail.dispose(); }")
