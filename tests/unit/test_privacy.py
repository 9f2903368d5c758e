"""Privacy: clipping, noise on the wire, accounting against Opacus, DP-SGD, budgets."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch
from opacus.accountants import RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clients.train import train_bottom
from server.trunk import Trunk
from server.trunk_service import TokenRegistry, TrunkEndpoint
from splitlearn.privacy import (
    DPSGDBottom,
    GaussianActivationMechanism,
    PrivacyAccountant,
    PrivacyBudgetExhausted,
    PrivacySettings,
    clip_per_sample,
    compute_epsilon,
    make_client_privacy,
    per_sample_norms,
    poisson_batches,
)
from splitlearn.split import split
from splitlearn.transport import InProcessTrunkSession
from splitlearn.wire import decode_frame
from tests.conftest import digits_like_model, fixed_batches

# --- clipping ---------------------------------------------------------------------------


def test_clipping_bounds_every_sample_and_keeps_small_ones():
    g = torch.Generator().manual_seed(0)
    scales = torch.tensor([1e-3, 0.5, 0.99, 1.0, 3.0, 1e4]).reshape(-1, 1, 1, 1)
    x = torch.randn(6, 4, 3, 3, generator=g)
    x = x / per_sample_norms(x).reshape(-1, 1, 1, 1) * scales
    clipped = clip_per_sample(x, max_norm=1.0)
    norms = per_sample_norms(clipped)
    assert (norms <= 1.0 + 1e-6).all()
    # Inside the ball: unchanged (up to the 1e-6 guard); outside: scaled onto the sphere.
    torch.testing.assert_close(clipped[:3], x[:3], rtol=1e-5, atol=0)
    torch.testing.assert_close(norms[4:], torch.ones(2), rtol=1e-5, atol=0)
    # Direction is preserved.
    cos = nn.functional.cosine_similarity(clipped.flatten(1), x.flatten(1))
    torch.testing.assert_close(cos, torch.ones(6), rtol=1e-5, atol=1e-6)


def test_clipping_gradient_matches_a_per_sample_reference():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 7, generator=g) * torch.tensor([[0.1], [1.0], [2.0], [5.0], [0.5]]))
    upstream = torch.randn(5, 7, generator=g)
    xb = x.clone().requires_grad_(True)
    clip_per_sample(xb, max_norm=1.0).backward(upstream)
    expected = []
    for i in range(5):  # slow reference: one sample at a time, explicit formula
        xi = x[i].clone().requires_grad_(True)
        norm = xi.norm()
        out = xi * torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        (out * upstream[i]).sum().backward()
        expected.append(xi.grad)
    torch.testing.assert_close(xb.grad, torch.stack(expected))


def test_mechanism_noise_has_std_sigma_c_and_is_reproducible_from_its_generator():
    mech = GaussianActivationMechanism(
        clip_norm=2.0, noise_multiplier=0.5, generator=torch.Generator().manual_seed(3)
    )
    released = mech(torch.zeros(4000, 8, 4, 4))
    assert released.std().item() == pytest.approx(1.0, rel=0.02)  # sigma * C
    assert abs(released.mean().item()) < 0.01
    again = GaussianActivationMechanism(
        clip_norm=2.0, noise_multiplier=0.5, generator=torch.Generator().manual_seed(3)
    )(torch.zeros(4000, 8, 4, 4))
    torch.testing.assert_close(released, again)
    assert mech.accounting_noise_multiplier == pytest.approx(0.25)  # sigma / 2: sensitivity 2C


@pytest.mark.parametrize("kwargs", [{"clip_norm": 0.0, "noise_multiplier": 1.0},
                                    {"clip_norm": 1.0, "noise_multiplier": -1.0}])
def test_mechanism_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError, match="must be"):
        GaussianActivationMechanism(**kwargs)


# --- noise on the wire -----------------------------------------------------------------------


def local_trunk(model, lr=0.1):
    endpoint = TrunkEndpoint(Trunk(copy.deepcopy(model), lr=lr), TokenRegistry(), max_batch=64)
    return endpoint, endpoint.tokens.issue(client="c0", cut=1, server_round=1, ttl_s=60)


def capturing_session(endpoint, token, frames):
    def handle(data: bytes) -> bytes:
        frames.append(decode_frame(data, max_bytes=1 << 24))
        return endpoint.handle(data, token)

    return InProcessTrunkSession(handle)


def test_noise_is_applied_before_the_frame_is_sent():
    model = digits_like_model("cnn")
    endpoint, token = local_trunk(model)
    bottom, _ = split(copy.deepcopy(model), 1)
    clip, sigma = 2.0, 0.5
    mech = GaussianActivationMechanism(
        clip_norm=clip, noise_multiplier=sigma, generator=torch.Generator().manual_seed(7)
    )
    raw, released = [], []

    def release(activations):
        raw.append(activations.detach().clone())
        out = mech(activations)
        released.append(out.detach().clone())
        return out

    frames = []
    batches = fixed_batches(4)
    report = train_bottom(
        bottom, lambda: batches, capturing_session(endpoint, token, frames),
        epochs=1, lr=0.1, release=release,
    )
    assert report.steps == 4 and len(frames) == 4
    for frame, a, r in zip(frames, raw, released, strict=True):
        sent = frame.tensors["activations"]
        torch.testing.assert_close(sent, r)  # exactly the released rows went out
        assert not torch.allclose(sent, a, atol=0.1)  # ... not the raw activations
        noise = sent - clip_per_sample(a, max_norm=clip)
        assert noise.std().item() == pytest.approx(sigma * clip, rel=0.05)
        assert abs(noise.mean().item()) < 0.05
    # The first frame is reproducible from the initial bottom and the generator's seed.
    first = clip_per_sample(split(copy.deepcopy(model), 1)[0](batches[0][0]), max_norm=clip)
    noise = torch.randn(first.shape, generator=torch.Generator().manual_seed(7)) * sigma * clip
    torch.testing.assert_close(frames[0].tensors["activations"], first + noise)


def test_release_backward_runs_through_the_clip():
    # With the clip binding and no noise, the update is the clipped network's SGD step.
    model = digits_like_model("cnn")
    batches = fixed_batches(1)
    endpoint, token = local_trunk(model)
    bottom, _ = split(copy.deepcopy(model), 1)
    mech = GaussianActivationMechanism(clip_norm=0.5, noise_multiplier=0.0)
    train_bottom(bottom, lambda: batches, endpoint.local_session(token), epochs=1, lr=0.1,
                 release=mech)
    ref_bottom, ref_trunk = split(copy.deepcopy(model), 1)
    x, y = batches[0]
    loss = nn.functional.cross_entropy(ref_trunk(clip_per_sample(ref_bottom(x), max_norm=0.5)), y)
    grads = torch.autograd.grad(loss, list(ref_bottom.parameters()))
    for p, p0, gr in zip(bottom.parameters(), ref_bottom.parameters(), grads, strict=True):
        torch.testing.assert_close(p, p0 - 0.1 * gr, rtol=1e-5, atol=1e-6)


def test_none_privacy_changes_nothing_in_the_round():
    data = TensorDataset(torch.rand(40, 1, 8, 8), torch.randint(0, 10, (40,)))
    loader = DataLoader(data, batch_size=16)
    privacy = make_client_privacy(PrivacySettings(), loader)
    assert privacy.release is None and privacy.round_steps(epochs=3) == []
    assert privacy.make_optimizer(nn.Linear(2, 2), lr=0.1, momentum=0, weight_decay=0) is None
    assert privacy.batches()() is loader


# --- accounting -------------------------------------------------------------------------------


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.01), (0.7, 0.2), (2.0, 1.0)])
def test_epsilon_grows_with_steps_and_equals_opacus(sigma, q):
    ours, opacus = PrivacyAccountant(), RDPAccountant()
    epsilons = []
    for steps in range(1, 31):
        ours.step(noise_multiplier=sigma, sample_rate=q)
        opacus.step(noise_multiplier=sigma, sample_rate=q)
        if steps in (1, 2, 5, 12, 30):  # each epsilon costs ~0.1 s of RDP maths
            epsilons.append(ours.epsilon(1e-5))
            assert epsilons[-1] == pytest.approx(opacus.get_epsilon(delta=1e-5), rel=1e-12)
    assert all(b > a for a, b in zip(epsilons, epsilons[1:], strict=False))
    assert compute_epsilon(history=[(sigma, q, 30)], delta=1e-5) == pytest.approx(epsilons[-1])


def test_accountant_history_survives_plain_lists():
    acc = PrivacyAccountant()
    acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=5)
    acc.step(noise_multiplier=1.0, sample_rate=0.1, num_steps=2)  # merged
    acc.step(noise_multiplier=0.3, sample_rate=1.0, num_steps=1)
    lists = acc.to_lists()
    assert lists == {"noise-multiplier": [1.0, 0.3], "sample-rate": [0.1, 1.0], "num-steps": [7, 1]}
    again = PrivacyAccountant.from_lists(lists)
    assert again.history == acc.history and again.num_steps == 8
    assert again.epsilon(1e-5) == acc.epsilon(1e-5)
    opacus = RDPAccountant()
    for s, q, n in [(1.0, 0.1, 7), (0.3, 1.0, 1)]:
        for _ in range(n):
            opacus.step(noise_multiplier=s, sample_rate=q)
    assert acc.epsilon(1e-5) == pytest.approx(opacus.get_epsilon(delta=1e-5), rel=1e-12)


def test_spend_refuses_past_the_budget_and_changes_nothing():
    acc = PrivacyAccountant()
    round_cost = [(0.5, 1.0, 1)]
    first = acc.spend(round_cost, delta=1e-5, epsilon_max=60.0)
    second = acc.spend(round_cost, delta=1e-5, epsilon_max=60.0)
    assert 0 < first < second <= 60.0
    history = acc.history
    with pytest.raises(PrivacyBudgetExhausted) as info:
        for _ in range(100):
            acc.spend(round_cost, delta=1e-5, epsilon_max=60.0)
    assert info.value.epsilon_spent <= 60.0 < info.value.epsilon_next
    assert acc.epsilon(1e-5) == pytest.approx(info.value.epsilon_spent)
    assert len(acc.history) == len(history) and acc.num_steps <= 100


def test_round_costs_per_option():
    data = TensorDataset(torch.rand(100, 1, 8, 8), torch.randint(0, 10, (100,)))
    loader = DataLoader(data, batch_size=32, shuffle=True)  # 4 batches per epoch
    act = make_client_privacy(
        PrivacySettings(name="activation_gaussian", clip_norm=1.0, noise_multiplier=2.0), loader
    )
    # Every example is released once per epoch: one unamplified Gaussian step each.
    assert act.round_steps(epochs=3) == [(1.0, 1.0, 3)]
    dp = make_client_privacy(
        PrivacySettings(name="dpsgd_client", clip_norm=1.0, noise_multiplier=1.1), loader
    )
    assert dp.round_steps(epochs=3) == [(1.1, 0.25, 12)]
    assert dp.expected_batch_size == pytest.approx(25.0)


def test_settings_reject_unknown_names_and_missing_noise():
    with pytest.raises(ValueError, match="accepted"):
        PrivacySettings(name="laplace")
    with pytest.raises(ValueError, match="noise_multiplier"):
        PrivacySettings(name="activation_gaussian", noise_multiplier=0.0)


# --- DP-SGD with the trunk's gradient ---------------------------------------------------------


def external_gradient(bottom, head, x, y):
    """What the trunk returns: d(mean cross-entropy)/d(activations)."""
    acts = bottom(x).detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(nn.functional.cross_entropy(head(acts), y), acts)
    return grad


def micro_batch_reference(bottom, x, grad, *, clip, expected_batch_size):
    """Slow reference: one backward per sample, clip its whole gradient, sum, scale."""
    total = [torch.zeros_like(p) for p in bottom.parameters()]
    for i in range(len(x)):
        bottom.zero_grad()
        # Sample i's own loss is B times its share of the mean.
        bottom(x[i:i + 1]).backward(grad[i:i + 1] * len(x))
        per_sample = [p.grad.clone() for p in bottom.parameters()]
        norm = torch.sqrt(sum(g.pow(2).sum() for g in per_sample))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        total = [t + factor * g for t, g in zip(total, per_sample, strict=True)]
    return [t / expected_batch_size for t in total]


@pytest.mark.parametrize("clip", [0.05, 1e6])
def test_dpsgd_clips_per_sample_gradients_driven_by_the_trunk(clip):
    model = digits_like_model("cnn")
    bottom, trunk = split(copy.deepcopy(model), 2)
    reference_bottom = copy.deepcopy(bottom)
    x, y = fixed_batches(1, batch=12)[0]
    grad = external_gradient(bottom, trunk, x, y)
    expected_batch_size = 10.0  # Poisson: the expected, not the actual, batch size
    dp = DPSGDBottom(bottom, lr=1.0, noise_multiplier=0.0, max_grad_norm=clip,
                     expected_batch_size=expected_batch_size)
    before = [p.detach().clone() for p in bottom.parameters()]
    dp.optimizer.zero_grad(set_to_none=True)
    bottom(x).backward(grad)
    dp.optimizer.step()
    dp.close()
    expected = micro_batch_reference(
        reference_bottom, x, grad, clip=clip, expected_batch_size=expected_batch_size
    )
    for p, p0, step in zip(bottom.parameters(), before, expected, strict=True):
        torch.testing.assert_close(p0 - p, step, rtol=1e-4, atol=1e-7)
    if clip > 1e5:  # no clipping, B == expected: plain SGD on the mean loss, scaled B/E
        plain = copy.deepcopy(reference_bottom)
        plain.zero_grad()
        plain(x).backward(grad)
        for p, p0, q in zip(bottom.parameters(), before, plain.parameters(), strict=True):
            torch.testing.assert_close(p0 - p, q.grad * len(x) / expected_batch_size,
                                       rtol=1e-4, atol=1e-7)
    assert not any(hasattr(p, "grad_sample") for p in bottom.parameters())


def test_dpsgd_empty_batch_takes_a_noise_only_step():
    bottom = nn.Sequential(nn.Flatten(), nn.Linear(64, 200))
    dp = DPSGDBottom(bottom, lr=1.0, noise_multiplier=2.0, max_grad_norm=0.5,
                     expected_batch_size=4.0, generator=torch.Generator().manual_seed(0))
    before = bottom[1].weight.detach().clone()
    dp.optimizer.zero_grad(set_to_none=True)
    dp.optimizer.step()  # no forward, no backward: an empty Poisson batch
    moved = (before - bottom[1].weight).flatten()
    assert moved.std().item() == pytest.approx(2.0 * 0.5 / 4.0, rel=0.05)


def test_dpsgd_round_trains_through_the_trunk():
    model = digits_like_model("cnn")
    endpoint, token = local_trunk(model)
    bottom, _ = split(copy.deepcopy(model), 1)
    data = TensorDataset(torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,)))
    loader = DataLoader(data, batch_size=16)
    privacy = make_client_privacy(
        PrivacySettings(name="dpsgd_client", clip_norm=1.0, noise_multiplier=1.0), loader,
        generator=torch.Generator().manual_seed(0),
    )
    before = copy.deepcopy(bottom.state_dict())
    report = train_bottom(
        bottom, privacy.batches(), endpoint.local_session(token), epochs=2, lr=0.1,
        release=privacy.release,
        optimizer=privacy.make_optimizer(bottom, lr=0.1, momentum=0.0, weight_decay=0.0),
    )
    privacy.close()
    assert report.steps == 8  # 4 Poisson batches per epoch, 2 epochs
    assert 0 < report.examples < 2 * 64 * 1.6
    assert any(not torch.equal(before[k], v) for k, v in bottom.state_dict().items())


def test_poisson_batches_sample_each_example_at_the_rate():
    data = TensorDataset(torch.arange(1000).float(), torch.zeros(1000, dtype=torch.long))
    sizes = [len(b[0]) for b in poisson_batches(
        data, sample_rate=0.05, num_batches=200, generator=torch.Generator().manual_seed(0))]
    assert sum(sizes) / len(sizes) == pytest.approx(50, rel=0.05)
    empties = list(poisson_batches(
        data, sample_rate=1e-6, num_batches=3, generator=torch.Generator().manual_seed(0)))
    assert [len(b[0]) for b in empties] == [0, 0, 0]


# --- budget in a round ------------------------------------------------------------------------


def test_in_process_clients_stop_at_the_budget():
    from experiments.inprocess import run_in_process
    from splitlearn.config import compose_config

    one_round = compute_epsilon(history=[(0.5 / 2, 1.0, 1)], delta=1e-5)
    two_rounds = compute_epsilon(history=[(0.5 / 2, 1.0, 2)], delta=1e-5)
    cfg = compose_config([
        "logger=none", "num_clients=2", "strategy.num_rounds=3", "strategy.local_epochs=1",
        "privacy=activation_gaussian", "privacy.noise_multiplier=0.5", "privacy.clip_norm=5",
        f"privacy.epsilon_max={(one_round + two_rounds) / 2}",
    ])
    cfg.run_dir = "unused"
    started = time.perf_counter()
    history = run_in_process(cfg)
    assert [r["clients_budget"] for r in history] == [0, 2, 2]
    assert [r["examples"] > 0 for r in history] == [True, False, False]
    assert all(math.isclose(r["epsilon"], one_round) for r in history)
    assert time.perf_counter() - started < 20
