"""U-shaped gradients that no labelling explains are refused; honest ones pass exactly.

The reference failure (measured before the check): a U-shaped device returning its
gradient negated, scaled to stay just inside the guard's row bound, cost the default job
0.8-3.9 points from 1 device in 10 and all of it from 2 in 10. These tests replay an
honest device and such a liar through the real endpoint and session, and compare the
server's replica of a device's tail with the tail the device trains.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from protocols.ushaped import UShapedOptions
from server.consistency import DeviceTails, frozen_tail, label_consistency
from server.guard import reference_tail
from server.standalone import build_trunk_side
from splitlearn.config import DataPlaneConfig, GuardConfig
from splitlearn.dataplane import InProcessTransport, TrunkChannel, TrunkRejected
from splitlearn.light_sgd import LightSGD
from tests.conftest import digits_like_model
from tests.unit.test_guard import digits_batches

CUT = 1
HYPER = {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4}


def features_and_gradient(tail: nn.Module, features: torch.Tensor, labels: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """What an honest device returns for ``features``: d (mean loss) / d features."""
    got = features.detach().requires_grad_(True)
    loss = nn.functional.cross_entropy(tail(got), labels)
    return loss.detach(), torch.autograd.grad(loss, got)[0]


@pytest.fixture(scope="module")
def batch():
    model = digits_like_model("cnn")
    stages, tail_cut = list(model.stages), model.num_stages - 1
    train, _ = digits_batches()
    x, y = train[0]
    with torch.no_grad():
        features = nn.Sequential(*stages[:tail_cut])(x)
    return frozen_tail(stages[tail_cut:]), features, y


def test_an_honest_gradient_is_explained_by_its_own_labels(batch):
    tail, features, labels = batch
    loss, grad = features_and_gradient(tail, features, labels)
    found = label_consistency(tail, features, grad)
    assert found.residual < 1e-5
    assert torch.equal(found.labels, labels)
    assert float(found.losses.mean()) == pytest.approx(float(loss), rel=1e-5)


@pytest.mark.parametrize("factor", [-0.25, -1.0, -4.0, -100.0])
def test_a_negated_gradient_is_explained_by_no_labelling(batch, factor):
    tail, features, labels = batch
    _, grad = features_and_gradient(tail, features, labels)
    assert label_consistency(tail, features, factor * grad).residual > 0.9


def test_flipped_labels_are_explained_and_show_in_the_loss(batch):
    """A consistent lie about the labels passes the residual; its loss is what gives it away."""
    tail, features, labels = batch
    honest, _ = features_and_gradient(tail, features, labels)
    flipped_loss, grad = features_and_gradient(tail, features, 9 - labels)
    found = label_consistency(tail, features, grad)
    assert found.residual < 1e-5
    assert torch.equal(found.labels, 9 - labels)
    assert float(found.losses.mean()) == pytest.approx(float(flipped_loss), rel=1e-5)


def test_a_tail_without_logits_is_not_checked(batch):
    _, features, _ = batch
    assert label_consistency(nn.Identity(), features[:, :4, None], features[:, :4, None]) is None


@pytest.mark.parametrize("closed_form", [True, False], ids=["closed-form", "autograd"])
def test_the_replica_follows_the_devices_own_tail_steps(closed_form):
    """Replayed from the labels the check finds, the replica stays the device's tail; the
    round's first tail does not (the drift the replica removes). A Linear tail's step in
    closed form (from the check's softmax) and through autograd alike."""
    model = digits_like_model("cnn")
    stages, tail_cut = list(model.stages), model.num_stages - 1
    device_tail = copy.deepcopy(nn.Sequential(*stages[tail_cut:]))  # the device's own copy
    first = frozen_tail(stages[tail_cut:])
    optimizer = LightSGD(device_tail.parameters(), **HYPER)
    tails = DeviceTails(**HYPER)
    body = nn.Sequential(*stages[:tail_cut]).requires_grad_(False)
    replayed, frozen = [], []
    for x, y in digits_batches()[0][:12]:
        features = body(x)
        replica = tails.tail("device", 1, lambda: stages[tail_cut:])
        _, grad = features_and_gradient(device_tail, features, y)
        found = label_consistency(replica, features, grad)
        replayed.append(found.residual)
        frozen.append(label_consistency(first, features, grad).residual)
        optimizer.zero_grad()
        nn.functional.cross_entropy(device_tail(features), y).backward()  # the device's step
        optimizer.step()
        tails.learn("device", features, found.labels, found.probs if closed_form else None)
    for mine, theirs in zip(tails.tail("device", 1, lambda: stages[tail_cut:]).parameters(),
                            device_tail.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs)
    assert max(replayed) < 1e-4
    assert max(frozen[1:]) > 100 * max(replayed)
    fresh = tails.tail("device", 2, lambda: stages[tail_cut:])  # a new round starts from the merge
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), first.parameters(),
                                                    strict=True))


def test_the_reference_seeds_no_residual_and_a_compressed_one_its_own():
    model = digits_like_model("cnn")
    tail_cut = model.num_stages - 1
    x, y = digits_batches()[1]
    plain = reference_tail(model, x[:128], y[:128], tail_cut=tail_cut, batch_size=32)
    assert float(plain["residual", tail_cut].max()) < 1e-5
    halved = reference_tail(model, x[:128], y[:128], tail_cut=tail_cut, batch_size=32,
                            returned=lambda g: g.to(torch.bfloat16).float())
    assert 0 < float(halved["residual", tail_cut].max()) < 0.05


# --- through the real endpoint and session ------------------------------------------------

class Device:
    """A U-shaped device: head, the trunk's features, tail, loss, step (as clients/ does)."""

    def __init__(self, side, client: str, model, *, lie: float = 1.0, flip: bool = False,
                 server_round: int = 1):
        token = side.tokens.issue(client=client, protocol="ushaped", cut=CUT,
                                  server_round=server_round, ttl_s=60)
        self.channel = TrunkChannel(InProcessTransport(side.endpoint, token))
        stages = list(model.stages)
        self.head = nn.Sequential(*stages[:CUT])
        self.tail = nn.Sequential(*stages[model.num_stages - 1:])
        self.optimizer = LightSGD([*self.head.parameters(), *self.tail.parameters()], **HYPER)
        self.lie, self.flip = lie, flip
        self.refusals: list[str] = []

    def train(self, x: torch.Tensor, y: torch.Tensor) -> None:
        try:
            acts = self.head(x)
            features = self.channel.forward_features(acts.detach()).requires_grad_(True)
            labels = 9 - y if self.flip else y
            loss = nn.functional.cross_entropy(self.tail(features), labels)
            self.optimizer.zero_grad()
            loss.backward()
            acts.backward(self.channel.backward(self.lie * features.grad))
            self.optimizer.step()
        except TrunkRejected as err:
            self.refusals.append(err.reason)


def guarded_side(guard: GuardConfig):
    model = digits_like_model("cnn")
    side = build_trunk_side(model, UShapedOptions(**HYPER), DataPlaneConfig(guard=guard))
    x, y = digits_batches()[1]
    for (what, cut), rows in reference_tail(model, x[:128], y[:128], tail_cut=model.num_stages - 1,
                                            batch_size=32).items():
        side.trunk.guard.seed(what, cut, rows)
    return side


@pytest.mark.parametrize("guard", [GuardConfig(), GuardConfig(residual_floor=0)],
                         ids=["checked", "unchecked"])
def test_a_device_returning_ascent_gradients_is_refused_and_honest_ones_are_not(guard):
    side = guarded_side(guard)
    honest = Device(side, "honest", digits_like_model("cnn"))
    liar = Device(side, "liar", digits_like_model("cnn"), lie=-2.0)  # inside the row bound
    train, _ = digits_batches()
    for x, y in train[:12]:
        honest.train(x, y)
        liar.train(x, y)
    assert honest.refusals == []
    if guard.residual_floor:
        assert liar.refusals == ["OUT_OF_RANGE", "OUT_OF_RANGE"] + ["QUARANTINED"] * 10
        assert side.trunk.steps == 12  # the honest device's only
    else:  # the reference: inside every norm bound, the liar steps the trunk
        assert liar.refusals == [] and side.trunk.steps == 24


def test_a_device_training_on_flipped_labels_is_refused_for_their_loss():
    # Five epochs in one round, never reseeded: the row bound is widened to stay out of it.
    side = guarded_side(GuardConfig(min_steps=8, seed_factor=50.0))
    honest = Device(side, "honest", digits_like_model("cnn"))
    train, _ = digits_batches()
    for _ in range(5):  # the trunk and tail learn: flipped labels' loss is then far beyond
        for x, y in train:
            honest.train(x, y)
    # Round 2 starts from the honest device's head and tail, on both sides (the merge).
    model = digits_like_model("cnn")
    liar = Device(side, "liar", model, flip=True, server_round=2)
    liar.tail.load_state_dict(honest.tail.state_dict())
    liar.head.load_state_dict(honest.head.state_dict())
    tail_cut = model.num_stages - 1
    side.trunk.load_stages({f"{tail_cut}.{k}": v for k, v in honest.tail[0].state_dict().items()})
    for x, y in train[:6]:
        liar.train(x, y)
    assert honest.refusals == []
    assert liar.refusals == ["OUT_OF_RANGE", "OUT_OF_RANGE"] + ["QUARANTINED"] * 4


class _Scale(torch.autograd.Function):
    """x2 with a hand-written backward and no batching rule of its own."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return 2 * x

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return 2 * grad


class UnbatchableTail(nn.Module):
    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(_Scale.apply(x))


@pytest.mark.parametrize("at_once", [1, 3, 64])
def test_labels_found_in_blocks_or_one_by_one_are_the_same(batch, monkeypatch, at_once):
    """Many classes (blocks of labels), and a tail with an operation autograd batches by
    looping (a custom Function without a batching rule)."""
    import server.consistency as consistency

    _, features, labels = batch
    torch.manual_seed(0)
    wide = nn.Linear(features.shape[1], 100).eval()  # 100 classes: two blocks of 64
    targets = (labels * 7) % 100
    reference = []
    for tail in (wide, UnbatchableTail(wide)):
        _, grad = features_and_gradient(tail, features, targets)
        monkeypatch.setattr(consistency, "CLASSES_AT_ONCE", at_once)
        found = label_consistency(tail, features, grad)
        assert torch.equal(found.labels, targets) and found.residual < 1e-5
        reference.append(label_consistency(tail, features, -grad).residual)
    assert reference[0] > 0.9 and reference[1] > 0.9


def test_a_linear_tails_closed_form_equals_autograds(batch):
    """A lone Linear's Jacobian is its weight; the same Linear behind an Identity goes
    through autograd: the same labels, losses and residuals."""
    tail, features, labels = batch
    behind = nn.Sequential(nn.Identity(), tail)
    _, grad = features_and_gradient(tail, features, labels)
    for returned in (grad, -3 * grad, grad + 0.1 * grad.std() * torch.randn_like(grad)):
        fast, slow = label_consistency(tail, features, returned), label_consistency(
            behind, features, returned)
        assert torch.equal(fast.labels, slow.labels)
        torch.testing.assert_close(fast.losses, slow.losses)
        assert fast.residual == pytest.approx(slow.residual, rel=1e-4, abs=1e-6)


def test_labels_that_do_not_explain_a_noised_gradient_are_not_held_against_its_loss(batch):
    """Under gradient noise (privacy) the nearest labels are guesses: their loss is not the
    device's. The residual bound follows the seeded (noised) spread; the loss is not checked."""
    from server.guard import TrunkGuard
    from splitlearn.config import GuardConfig

    tail, features, _ = batch
    tail = copy.deepcopy(tail)
    with torch.no_grad():  # a confident tail, and labels it fits: an honest loss near 0
        for param in tail.parameters():
            param.mul_(300)
        labels = tail(features).argmax(dim=1)
    guard = TrunkGuard(GuardConfig(min_steps=4))
    tail_cut = 4
    guard.seed("residual", tail_cut, torch.full((8,), 1.0))  # the noised reference's spread
    guard.seed("loss", tail_cut, torch.full((8,), 0.01))  # a model that fits: bound 2 ln C
    # A gradient of wrong labels, noised past the floor: its nearest labels (and their loss)
    # are no evidence, as an honest device's under gradient noise are not.
    _, flipped = features_and_gradient(tail, features, (labels + 5) % 10)
    noise = torch.randn(flipped.shape, generator=torch.Generator().manual_seed(0))
    noised = flipped + 0.5 * flipped.norm() / noise.norm() * noise
    found = label_consistency(tail, features, noised)
    assert 0.25 < found.residual < 4.0 and float(found.losses.mean()) > 2 * math.log(10)
    guard.check_returned("noised", 1, tail_cut, tail=tail, features=features, grad=noised)
    with pytest.raises(Exception, match="loss .* beyond the bound"):  # explained: checked
        guard.check_returned("liar", 1, tail_cut, tail=tail, features=features, grad=flipped)
