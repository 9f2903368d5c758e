"""The trunk's guard: one device cannot wreck a shared trunk with values inside every fixed bound.

The reference failure (measured before the guard): three forward frames of activations
all equal to ``dataplane.max_abs_value`` pushed a shared trunk's weights to ~1e15, and
from then on an honest device's batches were refused ``STEP_NOT_FINITE``. These tests
replay it through the real endpoint and sessions, with and without the guard.
"""

from __future__ import annotations

import copy
import functools
import math
import threading

import pytest
import torch
from torch import nn

from protocols.splitfed import SplitFedV2Options
from protocols.ushaped import UShapedOptions
from server.guard import TrunkGuard, reference_rows
from server.standalone import build_trunk_side
from splitlearn.config import DataPlaneConfig, GuardConfig
from splitlearn.dataplane import InProcessTransport, TrunkChannel, TrunkRejected
from splitlearn.stages import split
from tests.conftest import digits_like_model, fixed_batches

CUT = 1


def honest_rows(n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 16, generator=generator)  # norms about 2.3, spread about 0.3


def test_a_row_far_beyond_the_recent_rows_is_refused_and_honest_ones_are_not():
    guard = TrunkGuard(GuardConfig(min_rows=64))
    for i in range(8):
        guard.admit("honest", 1, "activations", CUT, honest_rows(32, seed=i))
    bound = guard.bound("activations", CUT)
    assert bound == pytest.approx(20 * 2.3, rel=0.05)  # 20 x the median, not the fixed 1e6
    guard.admit("honest", 1, "activations", CUT, honest_rows(32, seed=99))
    with pytest.raises(Exception, match="OUT_OF_RANGE|beyond the bound") as refused:
        guard.admit("liar", 1, "activations", CUT, torch.full((4, 16), 1e6))
    assert refused.value.reason_name == "OUT_OF_RANGE"
    assert guard.bound("activations", CUT) == bound  # refused rows move nothing


def test_a_device_is_quarantined_for_the_round_after_its_strikes():
    guard = TrunkGuard(GuardConfig(min_rows=32, strikes=2))
    guard.seed("activations", CUT, honest_rows(64))
    for _ in range(2):
        with pytest.raises(Exception, match="beyond the bound"):
            guard.admit("liar", 3, "activations", CUT, torch.full((4, 16), 500.0))
    with pytest.raises(Exception, match="quarantined for round 3") as quarantined:
        guard.admit("liar", 3, "activations", CUT, honest_rows(4))  # even honest-looking rows
    assert quarantined.value.reason_name == "QUARANTINED"
    guard.admit("other", 3, "activations", CUT, honest_rows(4))  # the others carry on
    guard.admit("liar", 4, "activations", CUT, honest_rows(4))  # a new round, a new start
    assert guard.take_books() == {"guard_refused": 2, "guard_loss_refused": 0,
                                  "guard_clipped": 0, "guard_quarantined": 1}


def test_a_minority_of_rows_at_the_bound_cannot_drag_the_bound_up():
    """A slow drift: every liar's row just inside the bound, one row in ten."""
    guard = TrunkGuard(GuardConfig(min_rows=64, window_rows=1024))
    guard.seed("activations", CUT, honest_rows(256))
    first = guard.bound("activations", CUT)
    for i in range(200):
        bound = guard.bound("activations", CUT)
        edge = torch.zeros(4, 16)
        edge[:, 0] = 0.999 * bound
        guard.admit("drifter", 1, "activations", CUT, edge)
        guard.admit("honest", 1, "activations", CUT, honest_rows(36, seed=i))
    assert guard.bound("activations", CUT) < 1.5 * first


def test_a_step_beyond_the_recent_steps_is_clipped_to_their_bound():
    guard = TrunkGuard(GuardConfig(min_steps=5, update_clip=5.0))
    for _ in range(10):
        assert guard.clip([torch.ones(4)], 2.0) == 2.0
    grads = [torch.full((4,), 100.0)]
    assert guard.clip(grads, 200.0) == pytest.approx(10.0)  # 5 x the median of 2
    assert torch.allclose(grads[0], torch.full((4,), 5.0))
    assert guard.take_books()["guard_clipped"] == 1


def test_seeded_statistics_bound_the_first_frame_of_a_round():
    model = digits_like_model("cnn")
    x, y = fixed_batches(1, batch=64)[0]
    rows = reference_rows(model, x, y, cuts=[1, 2], tail_cut=None, batch_size=32)
    assert set(rows) == {("activations", 1), ("activations", 2), ("loss", 1), ("loss", 2),
                         ("labels", 0)}
    assert torch.equal(rows["labels", 0], y)
    assert rows["loss", 1].shape == (2,)  # a mean loss per batch of 32
    guard = TrunkGuard(GuardConfig())
    assert guard.bound("activations", 1) is None
    guard.seed("activations", 1, rows["activations", 1])
    assert guard.bound("activations", 1) is not None  # no warm-up left to an attacker


def test_a_tail_gradient_reference_is_the_devices_mean_loss_gradient():
    model = digits_like_model("cnn")
    x, y = fixed_batches(1, batch=8)[0]
    tail = model.num_stages - 1
    rows = reference_rows(model, x, y, cuts=[1], tail_cut=tail, batch_size=4)
    features = torch.nn.Sequential(*list(model.stages)[:tail])(x[:4]).detach().requires_grad_()
    loss = torch.nn.functional.cross_entropy(list(model.stages)[tail](features), y[:4])
    expected = torch.autograd.grad(loss, features)[0]
    assert torch.allclose(rows["gradient", tail][:4], expected, atol=1e-6)


# --- the measured attack, through the real endpoint and sessions --------------------------

def attacked_trunk(*, guard: bool):
    """A shared trunk, an honest device that trained a while, and a liar at the value bound."""
    dataplane = DataPlaneConfig(max_frame_bytes=1 << 22, guard=GuardConfig(enabled=guard))
    side = build_trunk_side(digits_like_model("cnn"), SplitFedV2Options(lr=0.05), dataplane)
    reference = digits_like_model("cnn")
    bottom = split(reference, CUT)[0]

    def channel(client: str) -> TrunkChannel:
        token = side.tokens.issue(client=client, protocol="splitfed_v2", cut=CUT,
                                  server_round=1, ttl_s=60)
        return TrunkChannel(InProcessTransport(side.endpoint, token))

    honest, liar = channel("honest"), channel("liar")
    batches = fixed_batches(16, batch=32)
    for x, y in batches[:8]:  # the guard calibrates on these (no seeding here)
        honest.forward(bottom(x).detach(), y)
    return side, bottom, honest, liar, batches


@pytest.mark.parametrize("guard", [True, False], ids=["guarded", "unguarded"])
def test_three_frames_at_the_value_bound_do_not_wreck_a_guarded_trunk(guard):
    side, bottom, honest, liar, batches = attacked_trunk(guard=guard)
    x, y = batches[8]
    poison = torch.full_like(bottom(x).detach(), 1e6)  # equal to max_abs_value: accepted
    refusals = []
    for _ in range(3):
        try:
            liar.forward(poison, y)
        except TrunkRejected as err:
            refusals.append(err.reason)
    refused_honest = 0
    for x, y in batches[9:]:
        try:
            honest.forward(bottom(x).detach(), y)
        except TrunkRejected:
            refused_honest += 1
    largest = max(float(p.detach().abs().max()) for p in side.trunk.model.parameters())
    if guard:
        assert refusals == ["OUT_OF_RANGE", "OUT_OF_RANGE", "QUARANTINED"]
        assert refused_honest == 0 and largest < 10.0
    else:  # the reference failure the guard exists for: it must still reproduce
        assert len(refusals) < 3 and (largest > 1e6 or refused_honest > 0), (
            refusals, largest, refused_honest)


def test_a_ushaped_device_returning_extreme_gradients_is_refused_and_quarantined():
    """U-shaped devices return d loss / d features: the trunk learns from them as from
    activations, so they are bounded the same way (seeded from the run's reference)."""
    model = digits_like_model("cnn")
    tail = model.num_stages - 1
    side = build_trunk_side(model, UShapedOptions(lr=0.05), DataPlaneConfig())
    reference = digits_like_model("cnn")
    stages = list(reference.stages)
    x, y = fixed_batches(1, batch=128)[0]
    for (what, cut), rows in reference_rows(reference, x, y, cuts=[CUT], tail_cut=tail,
                                            batch_size=32).items():
        side.trunk.guard.seed(what, cut, rows)
    token = side.tokens.issue(client="liar", protocol="ushaped", cut=CUT, server_round=1,
                              ttl_s=60)
    liar = TrunkChannel(InProcessTransport(side.endpoint, token))
    acts = torch.nn.Sequential(*stages[:CUT])(x[:32]).detach()
    refusals = []
    for _ in range(3):
        try:
            features = liar.forward_features(acts)
            liar.backward(torch.full_like(features, 1e5))  # within max_abs_value
        except TrunkRejected as err:
            refusals.append(err.reason)
    assert refusals == ["OUT_OF_RANGE", "OUT_OF_RANGE", "QUARANTINED"]
    assert side.trunk.steps == 0


# --- rows of mean kinds: the returned gradients ------------------------------------------

def gradient_rows(n: int, *, wrong: int, scale: float = 1.0) -> torch.Tensor:
    """A U-shaped device's returned gradient once the model is confident: most rows near 0,
    ``wrong`` misclassified rows at the full 1/n."""
    rows = torch.zeros(n, 16)
    rows[:, 0] = 0.01 / n
    rows[:wrong, 0] = 1.0 / n
    return rows * scale


def test_heavy_tailed_returned_gradients_pass_a_seeded_bound_and_failed_the_median():
    """The false positive this bound fixes: honest U-shaped batches were refused after a few
    rounds, a misclassified row's gradient being 100x the (confident) median's."""
    seeded = TrunkGuard(GuardConfig(min_rows=64))
    seeded.seed("gradient", 4, gradient_rows(256, wrong=8) * 256 / 32)  # batches of 32, as run
    median_only = TrunkGuard(GuardConfig(min_rows=64))
    for guard in (seeded, median_only):
        for _ in range(4):
            guard.admit("honest", 1, "gradient", 4, gradient_rows(32, wrong=0))
    seeded.admit("honest", 1, "gradient", 4, gradient_rows(32, wrong=2))
    with pytest.raises(Exception, match="beyond the bound"):
        median_only.admit("honest", 1, "gradient", 4, gradient_rows(32, wrong=2))
    with pytest.raises(Exception, match="beyond the bound"):  # 5x an honest row: still refused
        seeded.admit("liar", 1, "gradient", 4, gradient_rows(32, wrong=2, scale=5.0))


def test_a_short_batchs_gradient_rows_are_compared_as_a_full_batchs():
    guard = TrunkGuard(GuardConfig(seed_factor=1.5))
    guard.seed("gradient", 4, gradient_rows(256, wrong=8) * 256 / 32)
    for _ in range(8):
        guard.admit("honest", 1, "gradient", 4, gradient_rows(32, wrong=2))
    guard.admit("honest", 1, "gradient", 4, gradient_rows(8, wrong=2))  # rows 4x, over 8 rows
    with pytest.raises(Exception, match="beyond the bound"):
        guard.admit("liar", 1, "gradient", 4, gradient_rows(32, wrong=2, scale=4.0))


# --- the loss check: a step far outside the recent range is not applied --------------------

@functools.cache
def digits_batches(batch: int = 32) -> tuple[list[tuple[torch.Tensor, torch.Tensor]],
                                           tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's digits: training batches and a held-out split (the last 297)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    train = [(x[i:i + batch], y[i:i + batch]) for i in range(0, 1500 - batch + 1, batch)]
    return train, (x[1500:], y[1500:])


def trunk_accuracy(side, bottom, test) -> float:
    x, y = test
    with torch.no_grad():
        logits = side.trunk.run(bottom(x), CUT)
    return float((logits.argmax(dim=1) == y).float().mean())


def label_flipping_attack(guard: GuardConfig):
    """Honest training on digits, then a persistent liar sending flipped labels."""
    from server.sessions.split import admit, train_on_batch

    torch.manual_seed(0)
    dataplane = DataPlaneConfig(max_frame_bytes=1 << 22, guard=guard)
    side = build_trunk_side(digits_like_model("cnn"), SplitFedV2Options(lr=0.05, momentum=0.9),
                            dataplane)
    bottom = split(digits_like_model("cnn"), CUT)[0].requires_grad_(False)
    train, test = digits_batches()
    for _ in range(5):  # what an honest split session does per frame, without the wire
        for x, y in train:
            acts = bottom(x)
            admit(side.trunk, "honest", 1, "activations", CUT, acts)
            train_on_batch(side.trunk, CUT, acts, y)
    before = trunk_accuracy(side, bottom, test)
    weights = copy.deepcopy(side.trunk.model.state_dict())
    token = side.tokens.issue(client="liar", protocol="splitfed_v2", cut=CUT, server_round=1,
                              ttl_s=60)
    liar = TrunkChannel(InProcessTransport(side.endpoint, token))
    refusals = []
    for x, y in train[:20]:
        try:
            liar.forward(bottom(x), 9 - y)
        except TrunkRejected as err:
            refusals.append(err.reason)
    return side, before, trunk_accuracy(side, bottom, test), weights, refusals


def test_a_label_flipping_device_is_refused_for_its_loss_and_quarantined():
    side, before, after, weights, refusals = label_flipping_attack(GuardConfig())
    assert before > 0.7
    assert refusals == ["OUT_OF_RANGE", "OUT_OF_RANGE"] + ["QUARANTINED"] * 18
    assert after == before  # no flipped batch reached the weights
    assert all(torch.equal(v, weights[k]) for k, v in side.trunk.model.state_dict().items())
    books = side.trunk.guard.take_books()
    assert books["guard_loss_refused"] == 2 and books["guard_quarantined"] == 1


def test_without_the_loss_check_flipped_labels_wreck_the_trunk():
    """The reference the check exists for: the same attack with every other bound on."""
    _, before, after, _, refusals = label_flipping_attack(GuardConfig(loss_factor=0))
    assert refusals == []
    assert after < before - 0.3, (before, after)


def skewed_trunk(label_factor: float):
    """A trunk that learned digits 0-4 only, its guard seeded with held-out rows of all ten."""
    from server.sessions.split import admit, train_on_batch

    torch.manual_seed(0)
    dataplane = DataPlaneConfig(max_frame_bytes=1 << 22,
                                guard=GuardConfig(label_factor=label_factor))
    side = build_trunk_side(digits_like_model("cnn"), SplitFedV2Options(lr=0.05, momentum=0.9),
                            dataplane)
    bottom = split(digits_like_model("cnn"), CUT)[0].requires_grad_(False)
    train, test = digits_batches()
    for _ in range(3):
        for x, y in train:
            acts, labels = bottom(x[y < 5]), y[y < 5]
            admit(side.trunk, "others", 1, "activations", CUT, acts)
            train_on_batch(side.trunk, CUT, acts, labels)
    # What the ServerApp seeds each round (its loss statistics aside: those are tested above).
    rows = reference_rows(side.trunk.snapshot(), *test, cuts=[CUT], tail_cut=None, batch_size=32)
    side.trunk.guard.seed_all({k: v for k, v in rows.items() if k[0] != "loss"})
    return side, bottom, train


def frames_refused(side, bottom, batches, *, flip: bool) -> list[str]:
    token = side.tokens.issue(client="device", protocol="splitfed_v2", cut=CUT, server_round=1,
                              ttl_s=60)
    channel = TrunkChannel(InProcessTransport(side.endpoint, token))
    refused = []
    for x, y in batches:
        try:
            channel.forward(bottom(x), 9 - y if flip else y)
        except TrunkRejected as err:
            refused.append(err.reason)
    return refused


def high_digits(train, count: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[y >= 5], y[y >= 5]) for x, y in train[:count]]


def test_an_honest_device_of_classes_the_trunk_forgot_is_taken_and_a_liar_is_not():
    side, bottom, train = skewed_trunk(label_factor=3.0)
    batches = high_digits(train)
    x, y = batches[0]
    with torch.no_grad():  # the honest batch is far beyond the recent batches' bound ...
        loss = float(nn.functional.cross_entropy(side.trunk.run(bottom(x), CUT), y))
    assert loss > side.trunk.guard.config.loss_factor * 0.2 and loss > math.log(10)
    assert frames_refused(side, bottom, batches, flip=False) == []  # ... and taken
    side, bottom, train = skewed_trunk(label_factor=3.0)
    # Flipped, the same rows claim digits 0-4, whose true rows the trunk knows well.
    assert frames_refused(side, bottom, high_digits(train), flip=True) == [
        "OUT_OF_RANGE", "OUT_OF_RANGE", "QUARANTINED", "QUARANTINED", "QUARANTINED",
        "QUARANTINED"]


def test_without_the_same_label_reference_the_honest_skewed_device_was_refused():
    side, bottom, train = skewed_trunk(label_factor=0.0)
    refused = frames_refused(side, bottom, high_digits(train), flip=False)
    assert refused[:2] == ["OUT_OF_RANGE", "OUT_OF_RANGE"] and set(refused[2:]) == {"QUARANTINED"}


def test_a_step_over_several_frames_is_not_charged_to_the_first_ones_sender():
    # SGLR steps once over a group's frames, each run through the trunk on its own: the
    # step's loss (their scaled sum) is no device's, though the first run is a view of
    # one device's admitted frame.
    from server.sessions.split import admit

    trunk = build_trunk_side(digits_like_model("cnn"), SplitFedV2Options(lr=0.0),
                             DataPlaneConfig(guard=GuardConfig(min_steps=4))).trunk
    bottom = split(digits_like_model("cnn"), CUT)[0]
    x, y = fixed_batches(1, batch=16)[0]
    frames = {name: bottom(x).detach() for name in ("alice", "bob")}
    for name, rows in frames.items():
        admit(trunk, name, 1, "activations", CUT, rows)

    def step(runs: list[torch.Tensor], loss: float) -> None:
        with trunk.step(samples=16 * len(runs), from_stage=CUT) as backward:
            outputs = [trunk.run(rows, CUT) for rows in runs]
            backward(sum(o.sum() * 0 for o in outputs) + loss)

    for _ in range(4):
        step([frames["alice"]], 0.5)  # one device's batches set the statistics
    step([frames["alice"], frames["bob"]], 50.0)  # a group's: not checked
    with pytest.raises(Exception, match="loss 50 at cut 1 is beyond"):
        step([frames["alice"]], 50.0)  # alice's own: checked
    assert trunk.guard.take_books()["guard_loss_refused"] == 1


def test_the_loss_check_charges_the_sender_of_the_rows_the_step_trains_on():
    guard = TrunkGuard(GuardConfig(min_rows=4, min_steps=4))
    rows = honest_rows(8)
    guard.admit("alice", 2, "activations", CUT, rows)
    assert guard.sender_of(rows.detach().requires_grad_(True)) == ("alice", 2)  # a view
    assert guard.sender_of(torch.cat([rows, rows])) is None  # several frames together
    assert guard.sender_of(rows.clone()) is None
    for _ in range(4):
        guard.check_loss(0.1, CUT, classes=10, rows=rows)
    with pytest.raises(Exception, match="loss 5 .* beyond the bound 2.303") as refused:
        guard.check_loss(5.0, CUT, classes=10, rows=rows)
    assert refused.value.reason_name == "OUT_OF_RANGE"
    guard.check_loss(5.0, CUT, classes=10, rows=torch.cat([rows, rows]))  # not one sender's
    guard.check_loss(float("nan"), CUT, classes=10, rows=rows)  # the finite check's
    assert guard.take_books()["guard_loss_refused"] == 1


# --- batch_concurrent: a poisoned batch does not take honest rows with it -------------------

def batching_side():
    from server.sessions.split import BatchingSplitSession, SharedTrunk
    from server.trunk import Trunk
    from splitlearn.dataplane import Session, SessionGrant

    model = digits_like_model("cnn")
    trunk = Trunk(model, lr=0.05, guard=TrunkGuard(GuardConfig()))
    bottom = split(digits_like_model("cnn"), CUT)[0].requires_grad_(False)
    x, y = digits_batches()[0][0]
    trunk.guard.seed("activations", CUT, bottom(x))
    handler = BatchingSplitSession(SharedTrunk(trunk), dataplane=DataPlaneConfig(),
                                   timeout_s=0.2)
    sessions = [Session(f"token-{c}", SessionGrant(c, "splitfed_v2", CUT, 1, math.inf))
                for c in ("honest", "liar")]
    for session in sessions:
        handler.attach(session)
    return trunk, bottom, handler, sessions


def in_parallel(handler, sessions, batches) -> list[object]:
    from splitlearn.dataplane import FrameError
    from splitlearn.dataplane import trunk_pb2 as pb
    from splitlearn.dataplane.codec import encode_tensor

    outcomes: list[object] = [None, None]

    def client(i: int) -> None:
        acts, labels = batches[i]
        request = pb.Request(seq=1, forward=pb.Forward(
            activations=encode_tensor(acts).to_proto(), labels=encode_tensor(labels).to_proto()))
        try:
            outcomes[i] = handler.handle(sessions[i], request)
        except FrameError as err:
            outcomes[i] = err.reason_name

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcomes


def test_batch_concurrent_refuses_only_the_poisoned_slot():
    trunk, bottom, handler, sessions = batching_side()
    (x, y), (x2, y2) = digits_batches()[0][1:3]
    honest = bottom(x)
    reference = copy.deepcopy(trunk.model)
    outcomes = in_parallel(handler, sessions, [(honest, y), (torch.full_like(bottom(x2), 1e6), y2)])
    assert outcomes[1] == "OUT_OF_RANGE"
    assert outcomes[0].WhichOneof("kind") == "gradient"  # stepped on its own rows alone
    torch.nn.functional.cross_entropy(torch.nn.Sequential(*reference.stages[CUT:])(honest),
                                      y).backward()
    with torch.no_grad():  # plain SGD (torch.optim's first optimiser imports the compiler: 5 s)
        for param in reference.parameters():
            if param.grad is not None:
                param -= 0.05 * param.grad
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in
               zip(trunk.model.parameters(), reference.parameters(), strict=True))


def test_batch_concurrent_does_not_refuse_a_union_for_its_loss():
    """A union's loss mixes honest and poisoned rows: refusing it would refuse honest ones
    (the limit the guard's docstring states)."""
    from server.sessions.split import admit, train_on_batch

    trunk, bottom, handler, sessions = batching_side()
    batches = digits_batches()[0]
    for x, y in batches[1:25]:  # warm the loss statistics up with single-device steps
        acts = bottom(x)
        admit(trunk, "honest", 1, "activations", CUT, acts)
        train_on_batch(trunk, CUT, acts, y)
    (x, y), (x2, y2) = batches[25:27]
    outcomes = in_parallel(handler, sessions, [(bottom(x), y), (bottom(x2), 9 - y2)])
    assert [o.WhichOneof("kind") for o in outcomes] == ["gradient", "gradient"]


def test_local_loss_queued_batches_are_checked_and_their_sender_quarantined():
    """Local loss trains queued batches on a worker thread, long after their frame was
    acknowledged: the loss check still charges the device that sent them."""
    from server.sessions.local_loss import SmashedSession
    from server.sessions.split import SharedTrunk, admit, train_on_batch
    from server.trunk import Trunk
    from splitlearn.dataplane import FrameError, Session, SessionGrant
    from splitlearn.dataplane import trunk_pb2 as pb
    from splitlearn.dataplane.codec import encode_tensor

    trunk = Trunk(digits_like_model("cnn"), lr=0.05, momentum=0.9,
                  guard=TrunkGuard(GuardConfig()))
    bottom = split(digits_like_model("cnn"), CUT)[0].requires_grad_(False)
    train, _ = digits_batches()
    for _ in range(5):
        for x, y in train:
            acts = bottom(x)
            admit(trunk, "honest", 1, "activations", CUT, acts)
            train_on_batch(trunk, CUT, acts, y)
    weights = copy.deepcopy(trunk.model.state_dict())
    handler = SmashedSession(SharedTrunk(trunk), dataplane=DataPlaneConfig(),
                             max_queue_bytes=1 << 24)
    liar = Session("token-liar", SessionGrant("liar", "local_loss", CUT, 1, math.inf))
    refusals = []
    for seq, (x, y) in enumerate(train[:6], start=1):
        request = pb.Request(seq=seq, smashed=pb.Smashed(
            activations=encode_tensor(bottom(x)).to_proto(),
            labels=encode_tensor(9 - y).to_proto()))
        try:
            handler.handle(liar, request)
        except FrameError as err:
            refusals.append(err.reason_name)
        handler.finish_round(["liar"])  # drains the queue: the worker trains (or refuses) it
    assert handler.errors == 2 and refusals == ["QUARANTINED"] * 4
    assert all(torch.equal(v, weights[k]) for k, v in trunk.model.state_dict().items())


def test_a_round_whose_model_moved_far_restarts_the_loss_statistics_from_the_servers_own():
    """After an average of poisoned copies every device's loss is high: the recent median
    alone would refuse all of them from then on (measured: a x1000 device's average left
    every device refused in round 2). The held-out losses through the round's model, far
    beyond the bound, restart the statistics; ordinary ones leave them."""
    guard = TrunkGuard(GuardConfig(min_steps=4))
    rows = honest_rows(8)
    guard.admit("honest", 1, "activations", CUT, rows)
    for _ in range(8):
        guard.check_loss(0.1, CUT, classes=10, rows=rows)
    guard.seed("loss", CUT, torch.full((8,), 0.15))  # an ordinary round: nothing changes
    with pytest.raises(Exception, match="beyond the bound 2.303"):
        guard.check_loss(5.0, CUT, classes=10, rows=rows)
    guard.seed("loss", CUT, torch.tensor([28.0, 30.0, 31.0, 35.0]))
    guard.check_loss(33.0, CUT, classes=10, rows=rows)  # the model, not the device
    with pytest.raises(Exception, match="beyond the bound"):
        guard.check_loss(1000.0, CUT, classes=10, rows=rows)
