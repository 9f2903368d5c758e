"""The trunk and its split sessions against reference maths.

The update primitive (``Trunk.step``: all or nothing, booked once), SplitFed v1's
per-client copies (merged by samples over the clients that finished), and the
batching barrier of SplitFed v2 (one step over the attached sessions' batches,
each client getting the gradient of its own batch's mean loss; a timeout instead
of waiting for absent clients).
"""

from __future__ import annotations

import copy
import itertools
import math
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

import server.trunk as trunk_module
from server.app import build_trunk
from server.sessions.split import (
    BatchingSplitSession,
    SharedTrunk,
    SplitSession,
    TrunkPerClient,
    train_on_batch,
)
from server.trunk import Trunk
from splitlearn.config import DataPlaneConfig, OptimizerConfig
from splitlearn.dataplane import FrameError, Reason, Session, SessionGrant, TrunkRejected
from splitlearn.dataplane import trunk_pb2 as pb
from splitlearn.dataplane.codec import decode_tensor, encode_tensor
from splitlearn.merge import stage_of
from splitlearn.stages import bottom_state
from tests.conftest import digits_like_model, fixed_batches, small_config
from tests.helpers import imports_in_a_fresh_process, max_param_diff

CUT = 2
LR = 0.1
LIMITS = DataPlaneConfig(max_frame_bytes=1 << 20, max_batch=64)


def activations(model, seed: int, batch: int = 8, cut: int = CUT) -> tuple[Tensor, Tensor]:
    """A batch's activations at ``cut`` (computed on a copy) and its labels."""
    x, y = fixed_batches(1, batch=batch, seed=seed)[0]
    with torch.no_grad():
        acts = x
        for stage in copy.deepcopy(model).stages[:cut]:
            acts = stage(acts)
    return acts, y


def reference_grad(model, acts: Tensor, labels: Tensor, cut: int = CUT) -> tuple[Tensor, float]:
    """Gradient of the batch's mean loss at the cut, on an independent copy of ``model``."""
    ref = copy.deepcopy(model)
    leaf = acts.clone().requires_grad_(True)
    out = leaf
    for stage in ref.stages[cut:]:
        out = stage(out)
    loss = nn.functional.cross_entropy(out, labels)
    loss.backward()
    assert leaf.grad is not None
    return leaf.grad, float(loss.detach())


def reference_sgd(model, batches: list[tuple[Tensor, Tensor]], *, lr: float = LR,
                  momentum: float = 0.0, cut: int = CUT):
    """Plain SGD on the stages above ``cut`` of a copy of ``model``, one step per batch."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    for acts, labels in batches:
        opt.zero_grad()
        out = acts
        for stage in ref.stages[cut:]:
            out = stage(out)
        nn.functional.cross_entropy(out, labels).backward()
        opt.step()
    return ref, opt


def grant_session(client: str, *, cut: int = CUT, protocol: str = "splitfed_v2") -> Session:
    return Session(f"token-{client}", SessionGrant(client, protocol, cut, 1, math.inf))


def forward_request(acts: Tensor, labels: Tensor, seq: int = 1) -> pb.Request:
    return pb.Request(seq=seq, forward=pb.Forward(
        activations=encode_tensor(acts).to_proto(), labels=encode_tensor(labels).to_proto()))


def reply_grad(reply: pb.Reply) -> Tensor:
    assert reply.WhichOneof("kind") == "gradient", reply
    return decode_tensor(reply.gradient.grad, name="grad", max_bytes=1 << 26)


@pytest.fixture
def fake_clock(monkeypatch) -> None:
    """Every perf_counter() the trunk reads is one second after the previous one.

    So each time the trunk is held adds exactly 1.0 to ``busy_s``: the books can
    be checked by counting, without measuring time.
    """
    ticks = itertools.count()
    monkeypatch.setattr(trunk_module, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))


# --- the update primitive ------------------------------------------------------


def good_body(trunk: Trunk, backward, acts: Tensor, labels: Tensor) -> None:  # noqa: ANN001
    backward(nn.functional.cross_entropy(trunk.run(acts, CUT), labels))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_step_with_non_finite_gradients_applies_nothing_and_a_good_step_after_it_works(poison):
    model = digits_like_model("resnet")  # batch norm: buffers must not move either
    first, second = activations(model, 1), activations(model, 2)
    trunk = Trunk(copy.deepcopy(model), lr=LR, momentum=0.9)
    with trunk.step(samples=8, from_stage=CUT) as backward:
        good_body(trunk, backward, *first)
    state = copy.deepcopy(trunk.model.state_dict())
    momenta = [trunk.optimizer.state[p]["momentum_buffer"].clone()
               for p in trunk.model.parameters() if p in trunk.optimizer.state]
    assert momenta  # the first step created the optimiser state that must survive

    with pytest.raises(FrameError, match="not finite") as refused, \
            trunk.step(samples=99, from_stage=CUT) as backward:
        logits = trunk.run(second[0], CUT)
        backward(nn.functional.cross_entropy(logits, second[1]) * poison)
    assert refused.value.reason == Reason.STEP_NOT_FINITE
    assert all(torch.equal(v, trunk.model.state_dict()[k]) for k, v in state.items())
    after = [trunk.optimizer.state[p]["momentum_buffer"]
             for p in trunk.model.parameters() if p in trunk.optimizer.state]
    assert len(after) == len(momenta)
    assert all(torch.equal(a, b) for a, b in zip(momenta, after, strict=True))
    assert (trunk.steps, trunk.samples) == (1, 8)
    assert all(p.grad is None for p in trunk.model.parameters())

    with trunk.step(samples=8, from_stage=CUT) as backward:
        good_body(trunk, backward, *second)
    # Reference: the two good steps alone, on an independent copy.
    ref, _ = reference_sgd(model, [first, second], momentum=0.9)
    ref.train()
    assert max_param_diff(trunk.model, ref) <= 1e-6
    assert (trunk.steps, trunk.samples) == (2, 16)


def test_a_body_that_raises_applies_nothing_and_the_error_propagates():
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    acts, labels = activations(model, 1)
    with pytest.raises(RuntimeError, match="client went away"), \
            trunk.step(samples=8, from_stage=CUT) as backward:
        good_body(trunk, backward, acts, labels)  # finite gradients, but the body stops
        raise RuntimeError("client went away")
    assert max_param_diff(trunk.model, model) == 0.0
    assert (trunk.steps, trunk.samples) == (0, 0)


def test_a_fresh_server_process_steps_the_trunk_without_importing_torchs_compiler():
    """torch.optim.SGD's first construction imports torch._dynamo (~2-3 s per process here)."""
    assert not imports_in_a_fresh_process("""
        import torch
        from server.trunk import Trunk
        from splitlearn.models import build_model
        trunk = Trunk(build_model("cnn", in_channels=1, image_size=8, num_classes=10, seed=0),
                      lr=0.1, momentum=0.5)
        with trunk.step(samples=2, from_stage=0) as backward:
            logits = trunk.run(torch.zeros(2, 1, 8, 8), 0)
            backward(torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1])))
        trunk.load_state_dict(trunk.state_dict())
        assert trunk.steps == 1
        """, "torch._dynamo")


def test_steps_samples_and_busy_seconds_are_booked_once_per_step(fake_clock):
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    acts, labels = activations(model, 1, batch=8)
    result = train_on_batch(trunk, CUT, acts, labels)
    assert (trunk.steps, trunk.samples, trunk.busy_s) == (1, 8, 1.0)
    assert result.losses.shape == (8,) and result.grad.shape == acts.shape
    with pytest.raises(FrameError), trunk.step(samples=8, from_stage=CUT) as backward:
        backward(trunk.run(acts, CUT).sum() * float("nan"))
    assert (trunk.steps, trunk.samples, trunk.busy_s) == (1, 8, 2.0)  # held, not counted
    with torch.no_grad(), trunk.forward_only(train=False):
        trunk.run(acts, CUT)
    assert (trunk.steps, trunk.samples, trunk.busy_s) == (1, 8, 3.0)
    # Through a split session: one forward is one step; an evaluation holds it once.
    handler = SplitSession(SharedTrunk(trunk), dataplane=LIMITS)
    session = grant_session("c0")
    handler.handle(session, forward_request(acts[:5], labels[:5]))
    assert (trunk.steps, trunk.samples, trunk.busy_s) == (2, 13, 4.0)
    evaluate = pb.Request(seq=2, evaluate=pb.Evaluate(
        activations=encode_tensor(acts).to_proto(), labels=encode_tensor(labels).to_proto()))
    assert handler.handle(session, evaluate).WhichOneof("kind") == "metrics"
    assert (trunk.steps, trunk.samples, trunk.busy_s) == (2, 13, 5.0)


def test_fork_is_independent_and_a_merge_adds_the_copies_books():
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    train_on_batch(trunk, CUT, *activations(model, 1))
    fork = trunk.fork()
    assert (fork.steps, fork.samples, fork.busy_s) == (0, 0, 0.0)
    assert max_param_diff(fork.model, trunk.model) == 0.0
    train_on_batch(fork, CUT, *activations(model, 2))
    assert max_param_diff(fork.model, trunk.model) > 0  # the original did not move
    snapshot = trunk.snapshot()
    trunk.load_stages(fork.stage_state())
    trunk.add_books(steps=fork.steps, samples=fork.samples, busy_s=fork.busy_s)
    assert max_param_diff(trunk.model, fork.model) == 0.0
    assert (trunk.steps, trunk.samples) == (2, 16)
    assert max_param_diff(snapshot, trunk.model) > 0  # a snapshot is a copy


# --- values near float32's limit through a split session --------------------------


def huge_batch(model, cut: int) -> tuple[Tensor, Tensor]:
    acts = torch.full((4, *model.cut_shape(cut)), 3.0e38)  # finite, overflows the first layer
    return acts, torch.arange(4)


def test_near_float32_max_without_a_bound_is_refused_as_a_non_finite_step(
    trunk_server_factory,
):
    model = digits_like_model("resnet")  # batch norm after the cut
    unbounded = DataPlaneConfig(max_frame_bytes=1 << 20, max_batch=64, max_abs_value=float("inf"))
    server = trunk_server_factory(model, lr=LR, dataplane=unbounded)
    before = copy.deepcopy(server.model.state_dict())
    channel = server.local_channel(server.token(CUT))
    with pytest.raises(TrunkRejected, match="^STEP_NOT_FINITE: "):
        channel.forward(*huge_batch(model, CUT))
    # Nothing changed: weights, batch-norm statistics, books.
    assert all(torch.equal(v, server.model.state_dict()[k]) for k, v in before.items())
    assert server.trunk.steps == 0 and server.trunk.samples == 0
    assert server.endpoint.refusals["in-process"] == 1
    # The session and the trunk carry on.
    acts, labels = activations(model, 1)
    grad, loss, _ = channel.forward(acts, labels)
    ref_grad, ref_loss = reference_grad(model, acts, labels)
    assert torch.allclose(grad, ref_grad, atol=1e-6) and abs(loss - ref_loss) < 1e-5
    assert server.trunk.steps == 1
    channel.close()


def test_near_float32_max_with_the_default_bound_is_refused_as_out_of_range(
    trunk_server_factory,
):
    model = digits_like_model("resnet")
    assert DataPlaneConfig().max_abs_value < 3.0e38
    server = trunk_server_factory(model, lr=LR, dataplane=DataPlaneConfig(max_frame_bytes=1 << 20))
    before = copy.deepcopy(server.model.state_dict())
    channel = server.local_channel(server.token(CUT))
    with pytest.raises(TrunkRejected, match="^OUT_OF_RANGE: activations reach"):
        channel.forward(*huge_batch(model, CUT))
    assert all(torch.equal(v, server.model.state_dict()[k]) for k, v in before.items())
    assert server.trunk.steps == 0
    channel.close()


# --- SplitFed v1: a trunk copy per client ---------------------------------------------


def test_per_client_copies_merge_weighted_by_samples_and_drop_unfinished(fake_clock):
    model = digits_like_model()
    pool = TrunkPerClient(Trunk(copy.deepcopy(model), lr=LR))
    batches = {"a": activations(model, 1, batch=8), "b": activations(model, 2, batch=24),
               "gone": activations(model, 3, batch=8)}
    for client, (acts, y) in batches.items():
        train_on_batch(pool.trunk_for(client), CUT, acts, y)
    assert pool.trunk.steps == 0  # the global trunk waits for the round's end
    # Reference: train separate copies by hand, average a and b by samples (8 : 24).
    refs = {c: reference_sgd(model, [batches[c]])[0].state_dict() for c in ("a", "b")}
    pool.finish_round(["a", "b", "never-started"])  # "gone" did not finish: dropped
    pool.merge_round([], upto=CUT)  # no client copies: the trunk copies alone
    merged = pool.trunk.model.state_dict()
    for key, value in merged.items():
        expected = refs["a"][key].double() * 0.25 + refs["b"][key].double() * 0.75
        assert torch.allclose(value.double(), expected, atol=1e-6), key
    # "gone"'s update is nowhere in the merge.
    with_gone = reference_sgd(model, [batches["gone"]])[0].state_dict()
    key = "stages.4.weight"
    assert not torch.allclose(merged[key], with_gone[key])
    # The books: the finished copies' steps, samples and busy seconds, once each.
    assert (pool.trunk.steps, pool.trunk.samples, pool.trunk.busy_s) == (2, 32, 2.0)
    # Copies are gone after the round: a new round forks the merged trunk.
    fresh = pool.trunk_for("a")
    assert fresh.samples == 0
    assert max_param_diff(fresh.model, pool.trunk.model) == 0.0


def test_a_round_where_nobody_finished_leaves_the_trunk_as_it_was():
    model = digits_like_model()
    pool = TrunkPerClient(Trunk(copy.deepcopy(model), lr=LR))
    train_on_batch(pool.trunk_for("gone"), CUT, *activations(model, 1))
    pool.finish_round([])
    assert pool.merge_round([], upto=CUT).keys() == set(bottom_state(model, CUT))
    assert max_param_diff(pool.trunk.model, model) == 0.0 and pool.trunk.steps == 0


# --- SplitFed v2 with batch_concurrent: the barrier -----------------------------------


def run_clients(handler, sessions, requests) -> dict[int, pb.Reply]:
    replies: dict[int, pb.Reply] = {}

    def client(i: int) -> None:
        replies[i] = handler.handle(sessions[i], requests[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return replies


def test_batching_session_steps_once_and_returns_each_clients_own_gradient(fake_clock):
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    handler = BatchingSplitSession(SharedTrunk(trunk), dataplane=LIMITS, timeout_s=30.0)
    sessions = [grant_session("a"), grant_session("b")]
    for s in sessions:
        handler.attach(s)
    inputs = [activations(model, 1, batch=8), activations(model, 2, batch=16)]
    replies = run_clients(handler, sessions, [forward_request(*i) for i in inputs])

    assert handler.steps == 1 and trunk.steps == 1 and trunk.samples == 24
    assert trunk.busy_s == 1.0
    # Reference: each client's gradient of its own mean loss at the pre-step weights.
    for i, (acts, y) in enumerate(inputs):
        ref_grad, ref_loss = reference_grad(model, acts, y)
        assert torch.allclose(reply_grad(replies[i]), ref_grad, atol=1e-6)
        assert abs(replies[i].gradient.loss - ref_loss) < 1e-5
    # ... and one SGD step on the union's mean loss.
    union = (torch.cat([a for a, _ in inputs]), torch.cat([y for _, y in inputs]))
    ref, _ = reference_sgd(model, [union])
    assert max_param_diff(trunk.model, ref) <= 1e-6


def test_the_barrier_times_out_instead_of_waiting_for_absent_clients():
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    handler = BatchingSplitSession(SharedTrunk(trunk), dataplane=LIMITS, timeout_s=0.01)
    sessions = [grant_session(c) for c in ("a", "absent-1", "absent-2")]
    for s in sessions:
        handler.attach(s)
    acts, labels = activations(model, 1)
    reply = handler.handle(sessions[0], forward_request(acts, labels))
    assert handler.attached == 3  # the others are still attached: the timeout released it
    assert handler.steps == 1 and trunk.steps == 1
    ref_grad, _ = reference_grad(model, acts, labels)
    assert torch.allclose(reply_grad(reply), ref_grad, atol=1e-6)


class SignallingBatchingSession(BatchingSplitSession):
    """Tells the test when a batch reaches the barrier."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.arrived = threading.Event()

    def train(self, session, trunk, acts, labels):
        self.arrived.set()
        return super().train(session, trunk, acts, labels)


def test_a_session_that_detaches_releases_the_batches_waiting_for_it():
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    # A barrier that would wait a minute: only the detach can release it in time.
    handler = SignallingBatchingSession(SharedTrunk(trunk), dataplane=LIMITS, timeout_s=60.0)
    waiting, leaving = grant_session("waiting"), grant_session("leaving")
    handler.attach(waiting)
    handler.attach(leaving)
    acts, labels = activations(model, 1)
    replies: list[pb.Reply] = []
    thread = threading.Thread(
        target=lambda: replies.append(handler.handle(waiting, forward_request(acts, labels))))
    thread.start()
    assert handler.arrived.wait(10)
    handler.detach(leaving)  # the other client's stream ended: no batch will come
    thread.join(10)
    assert not thread.is_alive(), "the batch still waits for a client that left"
    assert trunk.steps == 1 and handler.attached == 1
    assert torch.allclose(reply_grad(replies[0]), reference_grad(model, acts, labels)[0],
                          atol=1e-6)


def test_a_refused_batching_step_refuses_every_batch_in_it_and_changes_nothing():
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    unbounded = DataPlaneConfig(max_frame_bytes=1 << 20, max_batch=64, max_abs_value=float("inf"))
    handler = BatchingSplitSession(SharedTrunk(trunk), dataplane=unbounded, timeout_s=30.0)
    sessions = [grant_session("a"), grant_session("b")]
    for s in sessions:
        handler.attach(s)
    outcomes: dict[int, object] = {}

    def client(i: int, batch: tuple[Tensor, Tensor]) -> None:
        try:
            outcomes[i] = handler.handle(sessions[i], forward_request(*batch))
        except FrameError as err:
            outcomes[i] = err

    threads = [threading.Thread(target=client, args=(0, activations(model, 1))),
               threading.Thread(target=client, args=(1, huge_batch(model, CUT)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    # One union step: the huge batch makes it non-finite, so neither batch is applied.
    assert all(isinstance(o, FrameError) and o.reason == Reason.STEP_NOT_FINITE
               for o in outcomes.values()) and len(outcomes) == 2
    assert max_param_diff(trunk.model, model) == 0.0 and trunk.steps == 0
    assert handler.steps == 1  # the barrier did flush once


# --- what trunk workers exchange: momentum and books ---------------------------------


@pytest.mark.parametrize("optimizer", [
    OptimizerConfig(),
    OptimizerConfig(_target_="torch.optim.AdamW", options={"betas": [0.8, 0.99]}),
], ids=["sgd", "adamw"])
def test_optimizer_state_round_trips_and_parameters_it_lacks_start_afresh(optimizer):
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR, momentum=0.9, optimizer=optimizer)
    assert trunk.optimizer_state() == {}  # nothing stepped yet
    train_on_batch(trunk, CUT, *activations(model, 1))
    state = trunk.optimizer_state()
    # Keyed by the stages' state keys; only the stages the trunk trained have any.
    trained = {n for n, _ in trunk.model.stages.named_parameters() if int(n.split(".")[0]) >= CUT}
    assert trained and {k.rpartition("|")[0] for k in state} == trained
    assert all(stage_of(k) >= CUT for k in state)  # merged per stage, as the weights are
    other = Trunk(copy.deepcopy(model), lr=LR, momentum=0.9, optimizer=optimizer)
    other.load_optimizer_state(state)
    # The same next step from the same weights and optimiser state gives the same weights.
    other.load_stages(trunk.stage_state())
    batch = activations(model, 2)
    train_on_batch(trunk, CUT, *batch)
    train_on_batch(other, CUT, *batch)
    assert max_param_diff(trunk.model, other.model) == 0.0
    dropped = {k: v for k, v in other.optimizer_state().items() if not k.startswith(f"{CUT}.")}
    other.load_optimizer_state(dropped)
    assert set(other.optimizer_state()) == set(dropped)


def test_take_books_returns_the_counts_since_the_last_take(fake_clock):
    model = digits_like_model()
    trunk = Trunk(copy.deepcopy(model), lr=LR)
    train_on_batch(trunk, CUT, *activations(model, 1, batch=8))
    train_on_batch(trunk, CUT, *activations(model, 2, batch=4))
    books = trunk.take_books()
    assert (books["steps"], books["samples"], books["busy_s"]) == (2, 12, 2.0)
    assert books["stage_samples"][:CUT] == [0] * CUT
    assert books["stage_samples"][CUT:] == [12] * (model.num_stages - CUT)
    again = trunk.take_books()
    assert (again["steps"], again["samples"], again["busy_s"]) == (0, 0, 0.0)
    assert again["stage_samples"] == [0] * model.num_stages


# --- the activations' layout ---------------------------------------------------------


def entering_layouts(trunk: Trunk, cut: int) -> list[bool]:
    """Record, per forward, whether the first trunk stage got its input channels-last."""
    seen: list[bool] = []
    trunk.model.stages[cut].register_forward_pre_hook(
        lambda _, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last)
                                    and not args[0].is_contiguous()))
    return seen


@pytest.mark.parametrize(("name", "cut"), [("cnn", 1), ("cnn", 4), ("resnet", 1)])
def test_a_channels_last_trunk_takes_plain_sgds_steps_and_returns_a_standard_gradient(name, cut):
    """The layout is the trunk's business: the same steps, and the gradient goes back NCHW."""
    model = digits_like_model(name)
    trunk = Trunk(copy.deepcopy(model), lr=LR, momentum=0.5, channels_last=True)
    layouts = entering_layouts(trunk, cut)
    batches = [activations(model, seed, cut=cut) for seed in range(3)]
    for step, (acts, labels) in enumerate(batches):
        got = train_on_batch(trunk, cut, acts, labels).grad
        # Plain PyTorch in the standard layout, as far as the trunk had come.
        before, _ = reference_sgd(model, batches[:step], momentum=0.5, cut=cut)
        want, _ = reference_grad(before, acts, labels, cut=cut)
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    # Only 4-D activations change layout (cut 4 sends the hidden layer's vectors).
    assert layouts == [acts.dim() == 4] * len(batches)
    reference, _ = reference_sgd(model, batches, momentum=0.5, cut=cut)
    assert max_param_diff(trunk.model, reference) < 1e-5


def test_the_layout_is_the_models_unless_the_config_says_and_a_fork_keeps_it():
    cnn, lenet = digits_like_model("cnn"), digits_like_model("lenet5")
    assert Trunk(copy.deepcopy(cnn), lr=LR).channels_last is cnn.channels_last is True
    assert Trunk(copy.deepcopy(lenet), lr=LR).channels_last is lenet.channels_last is False
    standard = Trunk(copy.deepcopy(cnn), lr=LR, channels_last=False)
    assert standard.fork().channels_last is False
    trunk, *_ = build_trunk(small_config("dataplane.channels_last=false"))
    assert trunk.channels_last is False
    trunk, *_ = build_trunk(small_config())
    assert trunk.channels_last is trunk.model.channels_last
