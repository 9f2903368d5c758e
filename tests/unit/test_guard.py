"""The trunk's guard: one device cannot wreck a shared trunk with values inside every fixed bound.

The reference failure (measured before the guard): three forward frames of activations
all equal to ``dataplane.max_abs_value`` pushed a shared trunk's weights to ~1e15, and
from then on an honest device's batches were refused ``STEP_NOT_FINITE``. These tests
replay it through the real endpoint and sessions, with and without the guard.
"""

from __future__ import annotations

import pytest
import torch

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
    assert guard.take_books() == {"guard_refused": 2, "guard_clipped": 0,
                                  "guard_quarantined": 1}


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
    assert set(rows) == {("activations", 1), ("activations", 2)}
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
    largest = max(float(p.abs().max()) for p in side.trunk.model.parameters())
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
