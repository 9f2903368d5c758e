"""Local-loss split learning: aux head, one-way streaming, async trunk, bulk replies."""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Error, Message, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from clients.local_loss import build_client_side, train_local_loss
from server.async_trunk import AsyncTrunkTrainer, QueueFull, train_smashed_batch
from server.trunk_modes import SharedTrunk
from splitlearn.aux_head import (
    AUX_PREFIX,
    aux_state,
    build_aux_head,
    split_client_state,
    without_aux,
)
from splitlearn.smashed_stream import (
    SMASHED_RECORD_KEY,
    GrpcSmashedStream,
    InProcessSmashedStream,
    SmashedBuffer,
    unpack_smashed,
)
from splitlearn.split import load_bottom_state, split
from splitlearn.task import SplitTask
from splitlearn.transport import TrunkRejected
from splitlearn.wire import FrameError, decode_frame, encode_frame, record_to_state
from strategies.local_loss import LocalLossSplit
from tests.conftest import digits_like_model, fixed_batches

LL_TASK = SplitTask(
    server_round=0, cut=1, model="cnn", model_options="{}", dataset="digits", dataset_path="",
    test_fraction=0.2, image_size=0, partitioner="iid", alpha=0.5, shards_per_partition=2,
    seed=0, local_epochs=1, batch_size=32, lr=0.05, momentum=0.5, weight_decay=0.0,
    trunk_address="127.0.0.1:1", token="", max_frame_bytes=1 << 20,
)


@pytest.fixture(autouse=True)
def run_identity(monkeypatch):
    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1, raising=False)


class SlowTrunk:
    """A trunk whose steps take ``delay_s`` longer (and can be held at a gate)."""

    def __init__(self, trunk, delay_s: float = 0.0, gate: threading.Event | None = None):
        self.trunk, self.model, self.delay_s, self.gate = trunk, trunk.model, delay_s, gate

    def train_step(self, cut, acts, labels):
        if self.gate is not None:
            self.gate.wait(timeout=30)
        time.sleep(self.delay_s)
        return self.trunk.train_step(cut, acts, labels)

    def evaluate_batch(self, cut, acts, labels):
        return self.trunk.evaluate_batch(cut, acts, labels)


def smashed(model, cut: int, n: int, *, batch: int = 8, seed: int = 0):
    bottom, _ = split(copy.deepcopy(model), cut)
    with torch.no_grad():
        return [(bottom(x), y) for x, y in fixed_batches(n, batch=batch, seed=seed)]


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
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                 b.state_dict().values(), strict=True))
    with pytest.raises(ValueError, match="hidden"):
        build_aux_head((4,), 10, hidden=-1)


def test_initial_arrays_hold_bottom_and_head_and_evaluation_ignores_the_head():
    model = digits_like_model()
    strategy = LocalLossSplit(task=LL_TASK, issue_token=lambda c, k, r: "t",
                              revoke_round=lambda r: None, aux_hidden=8)
    state = record_to_state(strategy.initial_arrays(model))
    stages, aux = split_client_state(state)
    assert set(stages) == set(split(model, LL_TASK.cut)[0].state_dict())
    assert set(aux) == {"1.weight", "1.bias", "3.weight", "3.bias"}
    assert aux["1.weight"].shape == (8, int(np.prod(model.cut_shape(LL_TASK.cut))))
    with pytest.raises(ValueError, match="does not name a stage"):
        load_bottom_state(copy.deepcopy(model), state)  # strict about stage keys ...
    load_bottom_state(copy.deepcopy(model), without_aux(state))  # ... so evaluation filters
    # The client rebuilds exactly that bottom and head from the record.
    bottom, head = build_client_side(replace(LL_TASK, aux_hidden=8), state)
    assert all(torch.equal(v, state[AUX_PREFIX + k]) for k, v in head.state_dict().items())
    assert all(torch.equal(v, state[k]) for k, v in bottom.state_dict().items())


def reply(node: int, arrays: dict[str, np.ndarray], examples: int, *, smashed_record=None,
          partition: int | None = None) -> Message:
    request = Message(content=RecordDict(), dst_node_id=node, message_type="train.local_loss")
    metrics = {"num-examples": examples, "partition-id": node if partition is None else partition}
    content = RecordDict({
        "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
        "metrics": MetricRecord(metrics),
    })
    if smashed_record is not None:
        content[SMASHED_RECORD_KEY] = smashed_record
    return Message(content=content, reply_to=request)


def failed(node: int) -> Message:
    request = Message(content=RecordDict(), dst_node_id=node, message_type="train.local_loss")
    return Message(Error(code=0, reason="[dropout] vanished"), reply_to=request)


def test_aux_head_is_fedavgd_with_the_bottom():
    rng = np.random.default_rng(0)
    keys = ("0.0.weight", "aux.1.weight", "aux.1.bias")
    ws = [{k: rng.normal(size=(3, 2)).astype(np.float32) for k in keys} for _ in range(2)]
    finished: list[list[str]] = []
    strategy = LocalLossSplit(task=LL_TASK, issue_token=lambda c, k, r: "t",
                              revoke_round=lambda r: None, merge_round=finished.append)
    strategy._round_started = time.perf_counter()
    arrays, metrics = strategy.aggregate_train(1, [reply(1, ws[0], 10), failed(2),
                                                   reply(3, ws[1], 30)])
    for key in keys:
        expected = np.average([ws[0][key], ws[1][key]], axis=0, weights=[10, 30])
        np.testing.assert_allclose(arrays[key].numpy(), expected, rtol=1e-6)
    assert finished == [["1", "3"]] and metrics["failed-clients"] == 1


# --- client loop ---------------------------------------------------------------


def test_client_update_does_not_depend_on_the_trunk(trunk_server_factory):
    """Bottom and head train on the local loss only: the sink changes nothing client-side."""
    model = digits_like_model()
    cut, batches = 2, fixed_batches(6)
    server = trunk_server_factory(model)
    server.endpoint.smashed = AsyncTrunkTrainer()
    token = server.token(cut)
    results = []
    for sink in (SmashedBuffer(),
                 InProcessSmashedStream(lambda d: server.endpoint.handle(d, token))):
        bottom, _ = split(copy.deepcopy(model), cut)
        head = build_aux_head(model.cut_shape(cut), 10, seed=0)
        report = train_local_loss(bottom, head, lambda: batches, sink, epochs=2, lr=0.1,
                                  momentum=0.5)
        assert report.steps == 12 and report.examples == 12 * 16 and report.bytes_up > 0
        results.append(bottom.state_dict())
    server.endpoint.smashed.finish_round(["c0"])
    assert server.trunk.steps == 12
    assert all(torch.equal(a, b) for a, b in zip(results[0].values(), results[1].values(),
                                                 strict=True))


def test_bulk_payload_round_trips_batch_by_batch():
    buffer = SmashedBuffer()
    batches = [(torch.randn(n, 3), torch.arange(n)) for n in (4, 4, 2)]
    for acts, labels in batches:
        buffer.send(acts, labels)
    assert buffer.bytes_up == sum(a.numel() * 4 + len(y) * 8 for a, y in batches)
    back = unpack_smashed(buffer.to_arrays())
    assert all(torch.equal(a, b) and torch.equal(y, z)
               for (a, y), (b, z) in zip(batches, back, strict=True))
    bad = buffer.to_arrays() | {"batch-sizes": torch.tensor([4, 4, 3])}
    with pytest.raises(ValueError, match="sum to 11"):
        unpack_smashed(bad)
    with pytest.raises(ValueError, match="no smashed data"):
        SmashedBuffer().to_arrays()


# --- streaming over gRPC and the async trainer ----------------------------------


def test_stream_sends_every_batch_before_a_slow_trunk_has_trained_them(trunk_server_factory):
    model = digits_like_model()
    cut, n, delay = 1, 12, 0.1
    server = trunk_server_factory(model)
    server.endpoint.mode = SharedTrunk(SlowTrunk(server.trunk, delay_s=delay))
    trainer = server.endpoint.smashed = AsyncTrunkTrainer(max_queue=64)
    stream = GrpcSmashedStream(server.service.address, server.token(cut), max_frame_bytes=1 << 20,
                               window=n)
    started = time.perf_counter()
    for acts, labels in smashed(model, cut, n):
        stream.send(acts, labels)
    sent_s = time.perf_counter() - started
    trained_when_sent = server.trunk.steps
    stream.flush()  # every frame is queued at the trunk (acked), not necessarily trained
    stream.close()
    assert sent_s < n * delay / 2, f"sending took {sent_s:.2f} s: it waited for the trunk"
    assert trained_when_sent < n
    trainer.finish_round(["c0"])
    assert server.trunk.steps == n and trainer.trained["c0"] == n and trainer.pending == 0
    assert stream.bytes_down > 0 and stream.in_flight == 0


def test_stream_back_pressure_bounds_frames_in_flight(trunk_server_factory):
    model = digits_like_model()
    cut, n, delay = 1, 8, 0.05
    server = trunk_server_factory(model)
    server.endpoint.mode = SharedTrunk(SlowTrunk(server.trunk, delay_s=delay))
    trainer = server.endpoint.smashed = AsyncTrunkTrainer(max_queue=1)
    stream = GrpcSmashedStream(server.service.address, server.token(cut), max_frame_bytes=1 << 20,
                               window=2)
    started, most_in_flight = time.perf_counter(), 0
    for acts, labels in smashed(model, cut, n):
        stream.send(acts, labels)
        most_in_flight = max(most_in_flight, stream.in_flight)
    stream.flush()
    stream.close()
    # window 2 + queue 1 + the batch in training: the client ran at most ~4 ahead.
    assert most_in_flight <= 2
    assert time.perf_counter() - started >= (n - 4) * delay
    trainer.finish_round(["c0"])
    assert server.trunk.steps == n


def test_async_trainer_trains_exactly_the_valid_frames_and_refuses_the_rest(
    trunk_server_factory,
):
    model = digits_like_model()
    cut = 2
    server = trunk_server_factory(model)
    trainer = server.endpoint.smashed = AsyncTrunkTrainer()
    token = server.token(cut, client="mixed")
    shape = server.model.cut_shape(cut)
    labels4 = torch.zeros(4, dtype=torch.int64)
    bad = {
        "expected (batch": {"activations": torch.randn(4, *shape[:-1], shape[-1] + 1),
                            "labels": labels4},
        "NaN": {"activations": torch.full((4, *shape), float("nan")), "labels": labels4},
        "labels outside": {"activations": torch.randn(4, *shape),
                           "labels": torch.full((4,), 10, dtype=torch.int64)},
        "no 'labels'": {"activations": torch.randn(4, *shape)},
    }
    good = smashed(model, cut, 5)
    reasons = []
    for i, (acts, labels) in enumerate(good):
        reply = decode_frame(server.endpoint.handle(
            encode_frame("smashed", {"activations": acts, "labels": labels}), token),
            max_bytes=1 << 20)
        assert reply.kind == "ack" and reply.meta["queued"] >= 1
        if i < len(bad):
            frame = list(bad.values())[i]
            refusal = decode_frame(server.endpoint.handle(encode_frame("smashed", frame), token),
                                   max_bytes=1 << 20)
            assert refusal.kind == "error"
            reasons.append(refusal.meta["reason"])
    for expected, reason in zip(bad, reasons, strict=True):
        assert expected in reason
    trainer.finish_round(["mixed"])
    assert server.trunk.steps == len(good) and trainer.trained["mixed"] == len(good)
    assert server.endpoint.rejected["mixed"] == len(bad)


def test_smashed_frames_need_the_local_loss_trainer(trunk_server_factory):
    model = digits_like_model()
    server = trunk_server_factory(model)  # splitfed: no async trainer on the endpoint
    (acts, labels), = smashed(model, 1, 1)
    stream = InProcessSmashedStream(lambda d: server.endpoint.handle(d, server.token(1)))
    stream.send(acts, labels)
    with pytest.raises(TrunkRejected, match="not 'smashed'"):
        stream.flush()
    assert server.trunk.steps == 0


def test_refused_frame_fails_the_clients_round_over_grpc(trunk_server_factory):
    model = digits_like_model()
    server = trunk_server_factory(model)
    server.endpoint.smashed = AsyncTrunkTrainer()
    (acts, labels), = smashed(model, 2, 1)  # shaped for cut 2, token says cut 1
    stream = GrpcSmashedStream(server.service.address, server.token(1), max_frame_bytes=1 << 20)
    stream.send(acts, labels)
    with pytest.raises(TrunkRejected, match="for this client's cut"):
        stream.flush()
    stream.close()


def test_round_end_drops_queued_batches_of_unfinished_clients_and_drains_the_rest():
    model = digits_like_model()
    from server.trunk import Trunk

    gate = threading.Event()
    trunk = Trunk(copy.deepcopy(model), lr=0.1)
    slow = SlowTrunk(trunk, gate=gate)
    trainer = AsyncTrunkTrainer()
    batches = smashed(model, 1, 4)
    trainer.submit("a", slow, 1, *batches[0])  # the worker takes it and waits at the gate
    deadline = time.monotonic() + 10
    while trainer._queue and time.monotonic() < deadline:
        time.sleep(0.01)
    for client, (acts, labels) in zip(("b", "a", "b"), batches[1:], strict=True):
        trainer.submit(client, slow, 1, acts, labels)
    done = threading.Event()
    finisher = threading.Thread(target=lambda: (trainer.finish_round(["a"]), done.set()))
    finisher.start()
    time.sleep(0.1)
    assert not done.is_set(), "finish_round returned before the queue was drained"
    gate.set()
    finisher.join(timeout=30)
    assert done.is_set()
    assert trainer.trained == {"a": 2} and trainer.dropped == {"b": 2}
    assert trunk.steps == 2 and trainer.pending == 0
    # The worker stops with the round; the next round's first batch starts another.
    deadline = time.monotonic() + 10
    while trainer._worker is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert trainer._worker is None
    trainer.submit("a", trunk, 1, *batches[0])
    trainer.finish_round(["a"])
    assert trunk.steps == 3


def test_full_queue_refuses_after_its_timeout_and_drain_is_bounded_in_time():
    model = digits_like_model()
    from server.trunk import Trunk

    gate = threading.Event()
    slow = SlowTrunk(Trunk(copy.deepcopy(model), lr=0.1), gate=gate)
    trainer = AsyncTrunkTrainer(max_queue=1, put_timeout_s=0.05, drain_timeout_s=0.1)
    (acts, labels), = smashed(model, 1, 1)
    trainer.submit("a", slow, 1, acts, labels)
    deadline = time.monotonic() + 10
    while trainer._queue and time.monotonic() < deadline:
        time.sleep(0.01)
    trainer.submit("a", slow, 1, acts, labels)  # queued behind the one at the gate
    with pytest.raises(QueueFull, match="stayed full"):
        trainer.submit("a", slow, 1, acts, labels)
    started = time.perf_counter()
    trainer.finish_round(["a"])  # the gate never opens in time
    assert time.perf_counter() - started < 5 and trainer.dropped["a"] == 1
    gate.set()


# --- bulk mode -----------------------------------------------------------------------


def bulk_record(model, cut: int, n: int, seed: int) -> ArrayRecord:
    buffer = SmashedBuffer()
    for acts, labels in smashed(model, cut, n, seed=seed):
        buffer.send(acts, labels)
    return ArrayRecord({k: Array(v.numpy()) for k, v in buffer.to_arrays().items()})


def test_bulk_mode_trains_the_trunk_on_finished_clients_in_a_seeded_order():
    model = digits_like_model()
    w = {"0.0.weight": np.ones((2, 2), dtype=np.float32)}

    def run(order: list[int]) -> list[tuple[str, float]]:
        calls: list[tuple[str, float]] = []
        strategy = LocalLossSplit(
            task=LL_TASK, issue_token=lambda c, k, r: "t", revoke_round=lambda r: None,
            train_batch=lambda client, cut, acts, labels: calls.append(
                (client, float(acts.sum()))),
            round_deadline_s=5.0,
        )
        replies = {
            1: reply(1, w, 10, smashed_record=bulk_record(model, 1, 3, seed=1)),
            2: reply(2, w, 10, smashed_record=bulk_record(model, 1, 2, seed=2)),
            3: failed(3),
            4: reply(4, w, 10, smashed_record=bulk_record(model, 1, 4, seed=4)),
        }
        replies[4].content["metrics"]["virtual-s"] = 9.0  # a straggler
        for r in (1, 2):
            replies[r].content["metrics"]["virtual-s"] = 1.0
        strategy._round_started = time.perf_counter()
        arrays, metrics = strategy.aggregate_train(1, [replies[i] for i in order])
        assert arrays is not None and set(arrays) == set(w)  # the smashed record is not FedAvg'd
        assert strategy.bulk_batches[1] == {"trained": 5, "refused": 0}
        return calls

    calls = run([1, 2, 3, 4])
    # Every batch of the finished clients, none of the failed or the late one ...
    expected = [(str(c), float(a.sum())) for c, n in ((1, 3), (2, 2))
                for a, _ in smashed(model, 1, n, seed=c)]
    got, want = sorted(calls), sorted(expected)
    assert [c for c, _ in got] == [c for c, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want])
    # ... in an order set by the seed and the round, not by the order replies came in.
    assert run([4, 3, 2, 1]) == calls


def test_bulk_batches_are_validated_like_frames_before_the_trunk_sees_them(
    trunk_server_factory,
):
    model = digits_like_model()
    server = trunk_server_factory(model)
    (acts, labels), = smashed(model, 1, 1)
    train_smashed_batch(server.endpoint, "c", 1, acts, labels)
    with pytest.raises(FrameError, match="NaN"):
        train_smashed_batch(server.endpoint, "c", 1, torch.full_like(acts, float("nan")), labels)
    with pytest.raises(FrameError, match="for this client's cut"):
        train_smashed_batch(server.endpoint, "c", 2, acts, labels)
    assert server.trunk.steps == 1 and server.endpoint.rejected["c"] == 2


def test_local_loss_handler_is_registered_under_a_valid_message_type():
    from flwr.app.metadata import validate_message_type

    from clients.app import app

    assert validate_message_type(LocalLossSplit.train_message_type)
    assert LocalLossSplit.train_message_type in app._registered_funcs


def test_vanishing_streamer_leaves_the_trunk_serving_and_its_queue_is_dropped(
    trunk_server_factory,
):
    model = digits_like_model()
    cut, n = 1, 6
    server = trunk_server_factory(model)
    server.endpoint.mode = SharedTrunk(SlowTrunk(server.trunk, delay_s=0.2))
    trainer = server.endpoint.smashed = AsyncTrunkTrainer()
    gone = GrpcSmashedStream(server.service.address, server.token(cut, client="gone"),
                             max_frame_bytes=1 << 20)
    for acts, labels in smashed(model, cut, n):
        gone.send(acts, labels)
    deadline = time.monotonic() + 10
    while gone.in_flight and time.monotonic() < deadline:  # every frame reached the queue
        time.sleep(0.01)
    gone.abort()  # no flush, no clean close
    gone.close()  # still safe, does not wait or raise
    trainer.finish_round([])  # its reply never came: what is still queued is dropped
    assert trainer.dropped["gone"] >= 1
    assert trainer.trained["gone"] + trainer.dropped["gone"] == n
    # The trunk carries on with the next client.
    other = InProcessSmashedStream(
        lambda d: server.endpoint.handle(d, server.token(cut, client="next")))
    other.send(*smashed(model, cut, 1)[0])
    other.flush()
    trainer.finish_round(["next"])
    assert trainer.trained["next"] == 1
