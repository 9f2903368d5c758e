"""Local-loss split learning: aux head, client step, smashed-data sessions.

The device trains its bottom against an auxiliary head of its own and hands the
smashed data (activations and labels) to the trunk one way: streamed as ``smashed``
frames into a byte-bounded queue, or carried in the Flower reply (bulk). The
strategy's bulk training is tested with the strategies.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.app.metadata import validate_message_type
from torch import Tensor, nn

from clients.loop import train_round
from clients.steps.local_loss import LocalLossStep
from protocols import protocol_named
from protocols.local_loss import LocalLossOptions
from server.app import initial_arrays
from server.sessions.local_loss import SmashedSession, local_loss_sessions
from server.sessions.split import SharedTrunk
from server.trunk import Trunk
from splitlearn.aux_head import (
    AUX_PREFIX,
    aux_state,
    build_aux_head,
    cut_aux_prefix,
    heads_by_cut,
    without_aux,
)
from splitlearn.config import DataPlaneConfig, PrivacyConfig, RunSpec
from splitlearn.dataplane import (
    FrameError,
    Reason,
    TokenRegistry,
    TrunkChannel,
    TrunkRejected,
)
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import encode_tensor
from splitlearn.messages import SMASHED_RECORD_KEY, record_to_state, state_to_record, unpack_smashed
from splitlearn.planning.cost import Assignment
from splitlearn.privacy import ClientPrivacy
from splitlearn.stages import load_bottom_state, split
from strategies.local_loss import LocalLossSplit
from strategies.splitfed import DataPlaneAccess
from tests.conftest import digits_like_model, fixed_batches
from tests.helpers import ScriptedGrid, max_param_diff, send_raw

LR = 0.1
LIMITS = DataPlaneConfig(max_frame_bytes=1 << 20, max_batch=64)


def ll_spec(*, bulk: bool = False, aux_hidden: int = 0, cut: int = 1, **options) -> RunSpec:
    spec = RunSpec(strategy=LocalLossOptions(lr=LR, momentum=0.5, bulk=bulk,
                                             aux_hidden=aux_hidden, **options))
    spec.model.cut = cut
    return spec


def smashed(model, cut: int, n: int, *, batch: int = 8, seed: int = 0):
    bottom, _ = split(copy.deepcopy(model), cut)
    with torch.no_grad():
        return [(bottom(x), y) for x, y in fixed_batches(n, batch=batch, seed=seed)]


def batch_bytes(acts: Tensor, labels: Tensor) -> int:
    """What a batch occupies once queued: float32 activations and int64 labels."""
    return acts.numel() * 4 + labels.numel() * 8


class GatedTrunk(Trunk):
    """A trunk whose steps wait at a gate (a trunk as slow as the test wants)."""

    def __init__(self, model, *, lr: float, gate: threading.Event) -> None:
        super().__init__(model, lr=lr)
        self.gate = gate
        self.entered = 0  # steps that reached the gate

    @contextmanager
    def step(self, *, samples: int, from_stage: int) -> Iterator:
        self.entered += 1
        assert self.gate.wait(30), "the test never opened the gate"
        with super().step(samples=samples, from_stage=from_stage) as backward:
            yield backward


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Holds the trunk's steps until the test sets it; set at teardown, whatever happened."""
    event = threading.Event()
    yield event
    event.set()


def gated_server(factory, model, gate: threading.Event, **session_kw):
    """A local-loss data plane whose trunk steps wait at ``gate``."""
    options = {"max_queue_bytes": 1 << 22} | session_kw

    def handler(trunk: Trunk, dataplane: DataPlaneConfig) -> SmashedSession:
        return SmashedSession(SharedTrunk(GatedTrunk(trunk.model, lr=LR, gate=gate)),
                              dataplane=dataplane, **options)

    return factory(model, protocol="local_loss", handler=handler)


def wait_for(condition, what: str) -> None:
    """Wait (bounded) for a state the test needs; not a timing assertion."""
    done = threading.Event()
    for _ in range(1000):
        if condition():
            return
        done.wait(0.01)
    raise AssertionError(f"never happened: {what}")


def smashed_request(channel: TrunkChannel, **tensors: Tensor) -> bytes:
    part = pb.Smashed(**{k: encode_tensor(v).to_proto() for k, v in tensors.items()})
    return pb.Request(seq=channel.next_seq(), smashed=part).SerializeToString()


# --- auxiliary head ----------------------------------------------------------


@pytest.mark.parametrize(("cut", "hidden"), [(1, 0), (2, 16), (4, 0)])
def test_aux_head_maps_cut_activations_to_logits(cut, hidden):
    model = digits_like_model()
    head = build_aux_head(model.cut_shape(cut), model.num_classes, hidden=hidden, seed=0)
    (acts, _), = smashed(model, cut, 1, batch=5)
    assert head(acts).shape == (5, model.num_classes)
    keys = set(aux_state(head))
    expected = {"aux.1.weight", "aux.1.bias"} | (
        {"aux.3.weight", "aux.3.bias"} if hidden else set()
    )
    assert keys == expected
    assert not any(k.split(".")[0].isdigit() for k in keys)  # never a stage key


def test_aux_head_is_seeded():
    a = build_aux_head((4, 2, 2), 10, seed=3)
    b = build_aux_head((4, 2, 2), 10, seed=3)
    c = build_aux_head((4, 2, 2), 10, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))
    assert not torch.equal(a[1].weight, c[1].weight)
    with pytest.raises(ValueError, match="hidden"):
        build_aux_head((4,), 10, hidden=-1)


def test_initial_state_holds_bottom_and_aux_and_evaluation_ignores_the_aux():
    model = digits_like_model()
    spec = ll_spec(aux_hidden=8, cut=1)
    runtime = SimpleNamespace(protocol=protocol_named("local_loss"), spec=spec,
                              trunk=Trunk(copy.deepcopy(model), lr=LR), planning=None)
    state = record_to_state(initial_arrays(runtime))
    stages, heads = heads_by_cut(state)  # one head per cut in play: here model.cut's
    assert set(stages) == set(split(model, 1)[0].state_dict())
    assert set(heads) == {1}
    assert set(heads[1]) == {"1.weight", "1.bias", "3.weight", "3.bias"}
    assert heads[1]["1.weight"].shape == (8, int(np.prod(model.cut_shape(1))))
    with pytest.raises(ValueError, match="does not name a stage"):
        load_bottom_state(copy.deepcopy(model), state)  # strict about stage keys ...
    load_bottom_state(copy.deepcopy(model), without_aux(state))  # ... so evaluation filters
    # A client step rebuilds exactly that bottom and head from what it is sent.
    sent = stages | {AUX_PREFIX + k: v for k, v in heads[1].items()}
    step = LocalLossStep(digits_like_model(seed=5), spec, cut=1)
    step.load(sent)
    assert all(torch.equal(v, sent[AUX_PREFIX + k]) for k, v in step.aux.state_dict().items())
    assert all(torch.equal(v, sent[k]) for k, v in step.bottom.state_dict().items())
    assert step.state().keys() == sent.keys()
    # The head a client at that cut seeds for itself is the one in the global arrays.
    fresh = LocalLossStep(digits_like_model(seed=5), spec, cut=1).aux.state_dict()
    assert all(torch.equal(v, heads[1][k]) for k, v in fresh.items())


def train_reply(node: int, arrays: dict[str, np.ndarray], examples: int) -> Message:
    request = Message(content=RecordDict(), dst_node_id=node, message_type="train.local_loss")
    return Message(content=RecordDict({
        "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        "metrics": MetricRecord({"num-examples": examples, "partition-id": node}),
    }), reply_to=request)


def test_the_aux_head_is_averaged_with_the_bottom(task_identity):
    rng = np.random.default_rng(0)
    keys = ("0.0.weight", "aux.1.weight", "aux.1.bias")
    ws = [{k: rng.normal(size=(3, 2)).astype(np.float32) for k in keys} for _ in range(2)]
    finished: list[list[str]] = []
    strategy = LocalLossSplit(
        protocol="local_loss", spec=ll_spec(),
        dataplane=DataPlaneAccess(TokenRegistry(), "127.0.0.1:1", 60.0),
        trunk=SimpleNamespace(finish_round=finished.append),
    )
    request = Message(content=RecordDict(), dst_node_id=2, message_type="train.local_loss")
    vanished = Message(Error(code=0, reason="[dropout] vanished"), reply_to=request)
    arrays, metrics = strategy.aggregate_train(
        1, [train_reply(1, ws[0], 10), vanished, train_reply(3, ws[1], 30)])
    assert arrays is not None and metrics is not None
    for key in keys:  # FedAvg by examples, the head's entries (kept as cut 1's) like the bottom's
        expected = np.average([ws[0][key], ws[1][key]], axis=0, weights=[10, 30])
        kept = key.replace(AUX_PREFIX, cut_aux_prefix(1), 1)
        np.testing.assert_allclose(arrays[kept].numpy(), expected, rtol=1e-6)
    assert finished == [["1", "3"]] and metrics["failed-clients"] == 1


def test_each_cut_keeps_its_own_head_averaged_over_the_clients_at_that_cut(task_identity,
                                                                           monkeypatch):
    """Per-client cuts: a head's input is its cut's activations, so heads are kept per cut,
    each client is sent its cut's, and a cut nobody held this round keeps its head."""
    rng = np.random.default_rng(1)
    cut_of = {1: 1, 2: 1, 3: 2}
    heads = {cut: rng.normal(size=(10, 4 * cut)).astype(np.float32) for cut in (1, 2, 3)}
    global_arrays = ArrayRecord({"0.0.weight": Array(np.ones((2, 2), np.float32)),
                                 **{f"aux@{c}.1.weight": Array(h) for c, h in heads.items()}})
    strategy = LocalLossSplit(
        protocol="local_loss", spec=ll_spec(),
        dataplane=DataPlaneAccess(TokenRegistry(), "127.0.0.1:1", 60.0),
        trunk=SimpleNamespace(finish_round=lambda finished: None,
                              merge_round=lambda updates, upto: dict(updates[0][0])),
    )
    monkeypatch.setattr(strategy, "assignment", lambda node: Assignment(str(node), cut_of[node]))
    sent = strategy.configure_train(1, global_arrays, ConfigRecord(),
                                    ScriptedGrid([1, 2, 3], answer=lambda m: m))
    for message in sent:
        arrays = message.content["arrays"]
        assert set(arrays) == {"0.0.weight", "aux.1.weight"}
        mine = heads[cut_of[message.metadata.dst_node_id]]
        np.testing.assert_array_equal(arrays["aux.1.weight"].numpy(), mine)
    trained = {n: rng.normal(size=heads[c].shape).astype(np.float32) for n, c in cut_of.items()}
    replies = [train_reply(n, {"0.0.weight": np.zeros((2, 2), np.float32),
                               "aux.1.weight": trained[n]}, examples)
               for n, examples in ((1, 10), (2, 30), (3, 5))]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    np.testing.assert_allclose(arrays["aux@1.1.weight"].numpy(),
                               np.average([trained[1], trained[2]], axis=0, weights=[10, 30]),
                               rtol=1e-6)
    np.testing.assert_array_equal(arrays["aux@2.1.weight"].numpy(), trained[3])
    np.testing.assert_array_equal(arrays["aux@3.1.weight"].numpy(), heads[3])  # untouched
    with pytest.raises(ValueError, match="cut's head key"):
        heads_by_cut({"aux@x.1.weight": torch.zeros(1)})


def test_local_loss_is_registered_under_valid_message_types():
    protocol = protocol_named("local_loss")
    assert protocol.client is LocalLossStep and protocol.trunk is local_loss_sessions
    assert protocol.strategy is LocalLossSplit and protocol.options is LocalLossOptions
    for kind in ("train", "evaluate"):
        assert validate_message_type(f"{kind}.local_loss")


# --- the client step -----------------------------------------------------------------


def reference_local_loss(model, cut: int, batches, *, epochs: int, seed: int = 0):
    """Bottom and aux head trained by hand on the local loss (SGD, momentum 0.5).

    Returns the trained bottom, the head, and the activations of every batch as
    they were computed (before that batch's step).
    """
    bottom, _ = split(copy.deepcopy(model), cut)
    head = build_aux_head(model.cut_shape(cut), model.num_classes, seed=seed)
    opt = torch.optim.SGD([*bottom.parameters(), *head.parameters()], lr=LR, momentum=0.5)
    sent = []
    for _ in range(epochs):
        for x, y in batches:
            acts = bottom(x)
            sent.append((acts.detach().clone(), y))
            opt.zero_grad()
            nn.functional.cross_entropy(head(acts), y).backward()
            opt.step()
    return bottom, head, sent


def test_client_update_does_not_depend_on_the_trunk(trunk_server_factory):
    """Bottom and head train on the local loss only: streamed, kept or by hand, the same."""
    model = digits_like_model()
    cut, batches = 2, fixed_batches(6)
    server = trunk_server_factory(model, protocol="local_loss", lr=LR,
                                  options=LocalLossOptions(queue_bytes=1 << 22))
    ref_bottom, ref_head, _ = reference_local_loss(model, cut, batches, epochs=2)
    for bulk in (False, True):
        step = LocalLossStep(copy.deepcopy(model), ll_spec(bulk=bulk, cut=cut), cut=cut)
        channel = None if bulk else server.local_channel(server.token(cut))
        report = train_round(step, channel, ClientPrivacy(PrivacyConfig(), batches), epochs=2)
        assert report.steps == 12 and report.examples == 12 * 16 and report.bytes_up > 0
        assert max_param_diff(step.bottom, ref_bottom) <= 1e-6, f"bulk={bulk}"
        assert max_param_diff(step.aux, ref_head) <= 1e-6, f"bulk={bulk}"
        if channel is not None:
            channel.close()
    server.handler.finish_round(["c0"])
    assert server.trunk.steps == 12 and server.handler.trained["c0"] == 12


def test_bulk_payload_round_trips_batch_by_batch():
    model = digits_like_model()
    cut = 1
    batches = [(x[:n], y[:n]) for (x, y), n in zip(fixed_batches(3, batch=4), (4, 4, 2),
                                                   strict=True)]
    step = LocalLossStep(copy.deepcopy(model), ll_spec(bulk=True, cut=cut), cut=cut)
    assert step.reply_arrays() == {} and not step.needs_channel
    train_round(step, None, ClientPrivacy(PrivacyConfig(), batches), epochs=1)
    _, _, sent = reference_local_loss(model, cut, batches, epochs=1)
    arrays = step.reply_arrays()[SMASHED_RECORD_KEY]
    assert arrays["batch-sizes"].tolist() == [4, 4, 2]
    assert step.extra_bytes_up == sum(a.numel() * 4 + y.numel() * 8 for a, y in sent)
    # Through a Flower record and back, as the reply carries it.
    back = unpack_smashed(record_to_state(state_to_record(arrays)))
    assert len(back) == len(sent)
    for (a, y), (ra, ry) in zip(back, sent, strict=True):
        assert torch.allclose(a, ra, atol=1e-6) and torch.equal(y, ry)
    bad = dict(arrays) | {"batch-sizes": torch.tensor([4, 4, 3])}
    with pytest.raises(ValueError, match="sum to 11"):
        unpack_smashed(bad)
    with pytest.raises(ValueError, match="lacks \\['labels'\\]"):
        unpack_smashed({k: v for k, v in arrays.items() if k != "labels"})


# --- streaming into the smashed-data session -------------------------------------------


def test_streaming_sends_every_batch_before_a_slow_trunk_trained_them(
    trunk_server_factory, gate
):
    model = digits_like_model()
    cut, n = 1, 6
    server = gated_server(trunk_server_factory, model, gate)
    session = server.handler
    channel = server.channel(server.token(cut), window=n)  # over gRPC
    batches = smashed(model, cut, n)
    for acts, labels in batches:
        channel.send_smashed(acts, labels)
    channel.flush()  # every frame is queued at the trunk (acked) ...
    assert session.trunk.steps == 0  # ... and none trained: the trunk is held at the gate
    assert session.pending == n and channel.in_flight == 0
    channel.close()
    gate.set()
    session.finish_round(["c0"])
    assert session.trunk.steps == n and session.trained["c0"] == n and session.pending == 0
    # In arrival order, exactly as plain SGD on the batches.
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for acts, labels in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(nn.Sequential(*ref.stages[cut:])(acts), labels).backward()
        opt.step()
    assert max_param_diff(session.trunk.model, ref) <= 1e-6


def test_back_pressure_bounds_the_frames_in_flight(trunk_server_factory, gate):
    model = digits_like_model()
    cut, n, window = 1, 8, 2
    batches = smashed(model, cut, n)
    # The queue holds one batch; a frame that does not fit waits (the stream stops).
    server = gated_server(trunk_server_factory, model, gate,
                          max_queue_bytes=batch_bytes(*batches[0]), put_timeout_s=30.0)
    session = server.handler
    channel = server.channel(server.token(cut), window=window)
    sent, most_in_flight = [], [0]

    def stream() -> None:
        for acts, labels in batches:
            channel.send_smashed(acts, labels)
            sent.append(1)
            most_in_flight[0] = max(most_in_flight[0], channel.in_flight)
        channel.flush()

    sender = threading.Thread(target=stream)
    sender.start()
    # Batch 1 waits at the gate, batch 2 waits for room: the trunk reads no further.
    wait_for(lambda: session.trunk.entered == 1 and session.pending == 1, "first batch held")
    wait_for(lambda: len(sent) >= window + 1, "the window filled")
    sender.join(0.3)  # give a broken window time to run ahead
    # Acked: batch 1; unacked: batches 2 and 3 (the window); the 4th send waits.
    assert sender.is_alive() and len(sent) == window + 1
    assert most_in_flight[0] <= window
    gate.set()
    sender.join(30)
    assert not sender.is_alive() and len(sent) == n
    session.finish_round(["c0"])
    assert session.trunk.steps == n and session.trained["c0"] == n
    channel.close()


def test_the_session_trains_exactly_the_valid_frames_and_refuses_the_rest(
    trunk_server_factory,
):
    model = digits_like_model()
    cut = 2
    server = trunk_server_factory(model, protocol="local_loss", lr=LR,
                                  options=LocalLossOptions(queue_bytes=1 << 22))
    channel = server.local_channel(server.token(cut, client="mixed"))
    shape = model.cut_shape(cut)
    labels4 = torch.zeros(4, dtype=torch.int64)
    bad = [
        ("BAD_TENSOR", "for this client's cut",
         {"activations": torch.randn(4, *shape[:-1], shape[-1] + 1), "labels": labels4}),
        ("NOT_FINITE", "NaN", {"activations": torch.full((4, *shape), float("nan")),
                               "labels": labels4}),
        ("OUT_OF_RANGE", "labels outside", {"activations": torch.randn(4, *shape),
                                            "labels": torch.full((4,), 10)}),
        ("BAD_TENSOR", "no labels", {"activations": torch.randn(4, *shape)}),
    ]
    good = smashed(model, cut, 5)
    for i, (acts, labels) in enumerate(good):
        reply = send_raw(channel, smashed_request(channel, activations=acts, labels=labels))
        assert reply.WhichOneof("kind") == "ack" and reply.ack.queued >= 1
        if i < len(bad):
            reason, detail, tensors = bad[i]
            refused = send_raw(channel, smashed_request(channel, **tensors))
            assert refused.WhichOneof("kind") == "refusal"
            assert pb.Refusal.Reason.Name(refused.refusal.reason) == reason
            assert detail in refused.refusal.detail
    wrong_kind = pb.Request(seq=channel.next_seq(), forward=pb.Forward(
        activations=encode_tensor(good[0][0]).to_proto(),
        labels=encode_tensor(good[0][1]).to_proto()))
    reply = send_raw(channel, wrong_kind.SerializeToString())
    assert pb.Refusal.Reason.Name(reply.refusal.reason) == "UNEXPECTED_KIND"
    server.handler.finish_round(["mixed"])
    assert server.trunk.steps == len(good) and server.handler.trained["mixed"] == len(good)
    assert server.endpoint.refusals["in-process"] == len(bad) + 1
    # The trunk saw exactly the valid batches, in order: plain SGD on them.
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for acts, labels in good:
        opt.zero_grad()
        nn.functional.cross_entropy(nn.Sequential(*ref.stages[cut:])(acts), labels).backward()
        opt.step()
    assert max_param_diff(server.model, ref) <= 1e-6
    channel.close()


def test_the_queue_is_bounded_in_bytes_as_stored(trunk_server_factory, gate):
    model = digits_like_model()
    cut = 2
    (a1, y1), (a2, y2), (a3, y3) = smashed(model, cut, 3, batch=4)
    stored = batch_bytes(a1, y1)
    half = a1.numel() * 2 + y1.numel() * 8  # the same batch in float16, as sent
    # Room for 2 batches as stored, and for 3 if float16 counted at its wire size.
    capacity = 3 * stored - 1
    assert 2 * stored <= capacity and stored + 2 * half <= capacity
    server = gated_server(trunk_server_factory, model, gate, max_queue_bytes=capacity,
                          put_timeout_s=0.01)
    session = server.handler
    channel = server.local_channel(server.token(cut))
    ok = send_raw(channel, smashed_request(channel, activations=a1, labels=y1))
    assert ok.WhichOneof("kind") == "ack"
    wait_for(lambda: session.trunk.entered == 1, "the first batch is held at the gate")
    ok = send_raw(channel, smashed_request(channel, activations=a2.half(), labels=y2))
    assert ok.WhichOneof("kind") == "ack"
    full = send_raw(channel, smashed_request(channel, activations=a3.half(), labels=y3))
    assert full.WhichOneof("kind") == "refusal", "a float16 frame was counted at half size"
    assert pb.Refusal.Reason.Name(full.refusal.reason) == "BUSY"
    assert "stayed full" in full.refusal.detail
    # A batch that could never fit is refused at once, as too large.
    small = gated_server(trunk_server_factory, model, gate, max_queue_bytes=stored - 1,
                         put_timeout_s=30.0)
    too_big = small.local_channel(small.token(cut))
    reply = send_raw(too_big, smashed_request(too_big, activations=a1, labels=y1))
    assert pb.Refusal.Reason.Name(reply.refusal.reason) == "TOO_LARGE"
    gate.set()
    session.finish_round(["c0"])
    assert session.trained["c0"] == 2 and session.trunk.steps == 2
    channel.close()
    too_big.close()


def test_the_queue_budget_comes_from_the_options():
    model = digits_like_model()
    session = local_loss_sessions(Trunk(copy.deepcopy(model), lr=LR),
                                  LocalLossOptions(queue_bytes=12345), LIMITS)
    assert session.max_queue_bytes == 12345
    with pytest.raises(ValueError, match="max_queue_bytes"):
        SmashedSession(SharedTrunk(Trunk(model, lr=LR)), dataplane=LIMITS, max_queue_bytes=0)


def test_round_end_drops_queued_batches_of_unfinished_clients_and_drains_the_rest(
    trunk_server_factory, gate
):
    model = digits_like_model()
    server = gated_server(trunk_server_factory, model, gate)
    session = server.handler
    channels = {c: server.local_channel(server.token(1, client=c)) for c in ("a", "b")}
    batches = smashed(model, 1, 5)
    channels["a"].send_smashed(*batches[0])
    wait_for(lambda: session.trunk.entered == 1, "a's first batch is held at the gate")
    for client, (acts, labels) in zip(("b", "a", "b"), batches[1:4], strict=True):
        channels[client].send_smashed(acts, labels)
    for channel in channels.values():
        channel.flush()
    assert session.pending == 4
    done = threading.Event()
    finisher = threading.Thread(target=lambda: (session.finish_round(["a"]), done.set()))
    finisher.start()
    wait_for(lambda: session.dropped["b"] == 2, "b's batches dropped")
    assert not done.is_set(), "finish_round returned before the queue was drained"
    gate.set()
    finisher.join(30)
    assert done.is_set()
    assert session.trained == {"a": 2} and session.dropped == {"b": 2}
    assert session.trunk.steps == 2 and session.pending == 0
    # The next round's first batch is trained (a new worker starts with it).
    channels["a"].send_smashed(*batches[4])
    channels["a"].flush()
    session.finish_round(["a"])
    assert session.trunk.steps == 3 and session.trained["a"] == 3
    for channel in channels.values():
        channel.close()


def test_a_round_end_that_cannot_drain_in_time_drops_what_is_left(trunk_server_factory, gate):
    model = digits_like_model()
    server = gated_server(trunk_server_factory, model, gate, drain_timeout_s=0.01)
    session = server.handler
    channel = server.local_channel(server.token(1))
    for acts, labels in smashed(model, 1, 3):
        channel.send_smashed(acts, labels)
    channel.flush()
    wait_for(lambda: session.trunk.entered == 1, "the first batch is held at the gate")
    session.finish_round(["c0"])  # the gate never opens before the drain timeout
    assert session.dropped["c0"] == 2
    gate.set()
    wait_for(lambda: session.pending == 0, "the held batch finished")
    assert session.trained["c0"] == 1
    channel.close()


def test_smashed_frames_need_a_local_loss_session(trunk_server_factory):
    model = digits_like_model()
    server = trunk_server_factory(model)  # splitfed_v2: the trunk holds the loss
    channel = server.local_channel(server.token(1))
    channel.send_smashed(*smashed(model, 1, 1)[0])
    with pytest.raises(TrunkRejected, match="^UNEXPECTED_KIND: .*not 'smashed'"):
        channel.flush()
    assert server.trunk.steps == 0


def test_a_refused_frame_fails_the_clients_round_over_grpc(trunk_server_factory):
    model = digits_like_model()
    server = trunk_server_factory(model, protocol="local_loss",
                                  options=LocalLossOptions(queue_bytes=1 << 22))
    (acts, labels), = smashed(model, 2, 1)  # shaped for cut 2, the token says cut 1
    channel = server.channel(server.token(1))
    channel.send_smashed(acts, labels)
    with pytest.raises(TrunkRejected, match="^BAD_TENSOR: .*for this client's cut"):
        channel.flush()
    channel.close()
    assert server.trunk.steps == 0


def test_bulk_batches_are_validated_like_frames_before_the_trunk_sees_them():
    model = digits_like_model()
    session = SmashedSession(SharedTrunk(Trunk(copy.deepcopy(model), lr=LR)), dataplane=LIMITS,
                             max_queue_bytes=1 << 22)
    (acts, labels), = smashed(model, 1, 1)
    session.train_bulk("c", 1, acts, labels, server_round=1)
    with pytest.raises(FrameError, match="NaN") as nan:
        session.train_bulk("c", 1, torch.full_like(acts, float("nan")), labels, server_round=1)
    assert nan.value.reason == Reason.NOT_FINITE
    with pytest.raises(FrameError, match="for this client's cut") as cut:
        session.train_bulk("c", 2, acts, labels, server_round=1)
    assert cut.value.reason == Reason.BAD_TENSOR
    assert session.trunk.steps == 1 and session.trained["c"] == 1


def test_a_vanishing_streamer_leaves_the_trunk_serving(trunk_server_factory, gate):
    model = digits_like_model()
    cut, n = 1, 4
    server = gated_server(trunk_server_factory, model, gate)
    session = server.handler
    gone = server.channel(server.token(cut, client="gone"))
    for acts, labels in smashed(model, cut, n):
        gone.send_smashed(acts, labels)
    wait_for(lambda: session.pending == n, "every frame reached the queue")
    gone.abort()  # no flush, no clean close
    gone.close()  # still safe: does not wait or raise
    wait_for(lambda: server.endpoint.open_sessions == 0, "the trunk noticed the stream end")
    done = threading.Event()
    finisher = threading.Thread(target=lambda: (session.finish_round([]), done.set()))
    finisher.start()  # its reply never came: what is still queued is dropped
    wait_for(lambda: session.dropped["gone"] == n - 1, "the queued batches dropped")
    gate.set()
    finisher.join(30)
    assert done.is_set()
    assert session.trained["gone"] == 1 and session.dropped["gone"] == n - 1
    # The trunk carries on with the next client.
    other = server.local_channel(server.token(cut, client="next"))
    other.send_smashed(*smashed(model, cut, 1, seed=1)[0])
    other.flush()
    session.finish_round(["next"])
    assert session.trained["next"] == 1 and session.trunk.steps == 2
    other.close()
