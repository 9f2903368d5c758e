"""Attack metrics against slow reference formulas; attacks on synthetic data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from splitlearn.attacks import (
    bias_corrected_distance_correlation,
    cut_layer_gradients,
    direction_attack_auc,
    distance_correlation,
    invert,
    mse,
    norm_attack_auc,
    one_vs_rest_norm_auc,
    roc_auc,
    ssim,
)
from splitlearn.attacks.similarity import K1, K2, gaussian_window, window_size_for

# --- SSIM ------------------------------------------------------------------------------------


def slow_ssim(x: np.ndarray, y: np.ndarray, *, window_size=11, sigma=1.5, data_range=1.0):
    """Wang et al.'s SSIM for one grey image, one window position at a time."""
    size = window_size_for(*x.shape, window_size)
    w = gaussian_window(size, sigma).numpy()
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    values = []
    for i in range(x.shape[0] - size + 1):
        for j in range(x.shape[1] - size + 1):
            px, py = x[i:i + size, j:j + size], y[i:i + size, j:j + size]
            mx, my = (w * px).sum(), (w * py).sum()
            vx, vy = (w * (px - mx) ** 2).sum(), (w * (py - my) ** 2).sum()
            cov = (w * (px - mx) * (py - my)).sum()
            values.append(((2 * mx * my + c1) * (2 * cov + c2))
                          / ((mx**2 + my**2 + c1) * (vx + vy + c2)))
    return float(np.mean(values))


def images(n, size=8, seed=0):
    return torch.rand(n, 1, size, size, generator=torch.Generator().manual_seed(seed))


def test_ssim_of_identical_images_is_one():
    x = images(5)
    torch.testing.assert_close(ssim(x, x), torch.ones(5))
    torch.testing.assert_close(ssim(images(2, 16), images(2, 16)), torch.ones(2))


@pytest.mark.parametrize("size", [8, 16])
def test_ssim_matches_the_per_window_reference(size):
    x = images(3, size, seed=1)
    y = (x + 0.2 * images(3, size, seed=2)).clamp(0, 1)
    expected = [slow_ssim(a[0].numpy().astype(np.float64), b[0].numpy().astype(np.float64))
                for a, b in zip(x, y, strict=True)]
    np.testing.assert_allclose(ssim(x, y).numpy(), expected, rtol=1e-5)


def test_ssim_falls_with_noise_and_is_symmetric():
    x = images(4)
    noisy = [(x + s * torch.randn(x.shape, generator=torch.Generator().manual_seed(3))).clamp(0, 1)
             for s in (0.05, 0.2, 0.5)]
    scores = [float(ssim(x, n).mean()) for n in noisy]
    assert 1 > scores[0] > scores[1] > scores[2]
    torch.testing.assert_close(ssim(x, noisy[1]), ssim(noisy[1], x))


def test_mse_per_image():
    x = torch.zeros(2, 1, 2, 2)
    y = torch.tensor([[[[1.0, 1.0], [1.0, 1.0]]], [[[2.0, 0.0], [0.0, 0.0]]]])
    torch.testing.assert_close(mse(x, y), torch.tensor([1.0, 1.0]))


# --- distance correlation ---------------------------------------------------------------------


def slow_dcor(x: np.ndarray, y: np.ndarray) -> float:
    """Székely et al. (2007), with explicit O(n^2) loops."""
    n = len(x)

    def centred(z):
        d = [[float(np.linalg.norm(z[i] - z[j])) for j in range(n)] for i in range(n)]
        row = [sum(d[i]) / n for i in range(n)]
        col = [sum(d[i][j] for i in range(n)) / n for j in range(n)]
        grand = sum(row) / n
        return [[d[i][j] - row[i] - col[j] + grand for j in range(n)] for i in range(n)]

    a, b = centred(x), centred(y)
    dcov = sum(a[i][j] * b[i][j] for i in range(n) for j in range(n)) / n**2
    vx = sum(a[i][j] ** 2 for i in range(n) for j in range(n)) / n**2
    vy = sum(b[i][j] ** 2 for i in range(n) for j in range(n)) / n**2
    return math.sqrt(max(dcov, 0.0) / math.sqrt(vx * vy))


def test_distance_correlation_matches_the_slow_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(25, 3, 2, generator=g)
    y = torch.tanh(x.flatten(1) @ torch.randn(6, 4, generator=g))
    y = y + 0.3 * torch.randn(25, 4, generator=g)
    expected = slow_dcor(x.flatten(1).double().numpy(), y.double().numpy())
    assert distance_correlation(x, y) == pytest.approx(expected, rel=1e-9)


def test_distance_correlation_extremes():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 5, generator=g)
    assert distance_correlation(x, 3 * x + 1) == pytest.approx(1.0, abs=1e-9)
    # The sample statistic is biased upwards for independent data (~0.24 here).
    assert distance_correlation(x, torch.randn(300, 5, generator=g)) < 0.3
    assert distance_correlation(x, torch.ones(300, 2)) == 0.0


def slow_bias_corrected_dcor(x, y) -> float:
    """Székely and Rizzo (2014), eq. (3.1) and the inner product above it, with loops."""
    n = len(x)

    def u_centered(z):
        d = [[math.dist(z[i], z[j]) for j in range(n)] for i in range(n)]
        row = [sum(r) for r in d]
        total = sum(row)
        return [[0.0 if i == j else d[i][j] - row[i] / (n - 2) - row[j] / (n - 2)
                 + total / ((n - 1) * (n - 2)) for j in range(n)] for i in range(n)]

    a, b = u_centered(x), u_centered(y)

    def dot(p, q):
        return sum(p[i][j] * q[i][j] for i in range(n) for j in range(n) if i != j) / (
            n * (n - 3))

    return dot(a, b) / math.sqrt(dot(a, a) * dot(b, b))


def test_bias_corrected_distance_correlation_matches_the_slow_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 3, 2, generator=g)
    y = torch.tanh(x.flatten(1) @ torch.randn(6, 4, generator=g)) + 0.3 * torch.randn(20, 4,
                                                                                    generator=g)
    expected = slow_bias_corrected_dcor(x.flatten(1).double().tolist(), y.double().tolist())
    assert bias_corrected_distance_correlation(x, y) == pytest.approx(expected, rel=1e-9)


def test_bias_corrected_distance_correlation_sees_independence_in_high_dimension():
    # 144 "images" of 64 pixels against noise of the same size: the plain statistic sits far
    # above 0 (the floor the issue measured, 0.667); the corrected one is about 0.
    g = torch.Generator().manual_seed(2)
    images, noise = torch.rand(144, 64, generator=g), torch.randn(144, 64, generator=g)
    assert distance_correlation(images, noise) > 0.5
    assert abs(bias_corrected_distance_correlation(images, noise)) < 0.02
    assert bias_corrected_distance_correlation(images, 3 * images + 1) == pytest.approx(1.0)
    assert bias_corrected_distance_correlation(images, torch.ones(144, 2)) == 0.0
    with pytest.raises(ValueError, match=">= 4"):
        bias_corrected_distance_correlation(images[:3], noise[:3])


# --- label leakage ----------------------------------------------------------------------------


def test_roc_auc_counts_pairs_and_half_ties():
    # Slow reference: every (positive, negative) pair, a tie counts one half.
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (40,), generator=g).double()  # many ties
    positives = torch.rand(40, generator=g) < 0.4
    pos, neg = scores[positives], scores[~positives]
    pairs = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    assert roc_auc(scores, positives) == pytest.approx(float(pairs.mean()), rel=1e-12)
    with pytest.raises(ValueError, match="positives and negatives"):
        roc_auc(scores, torch.ones(40, dtype=torch.bool))

def test_norm_attack_on_synthetic_gradients():
    g = torch.Generator().manual_seed(0)
    positives = torch.rand(400, generator=g) < 0.1  # rare positive class, as in Li et al.
    grads = torch.randn(400, 16, generator=g)
    grads[positives] *= 3.0  # the model is less sure about the rare class
    assert norm_attack_auc(grads, positives) > 0.95
    same = torch.randn(400, 16, generator=g)
    assert abs(norm_attack_auc(same, positives) - 0.5) < 0.1


def test_direction_attack_on_synthetic_gradients():
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (400,), generator=g)
    directions = torch.randn(4, 32, generator=g)
    grads = directions[labels] + 0.5 * torch.randn(400, 32, generator=g)
    assert direction_attack_auc(grads, labels, generator=g) > 0.95
    # Norms alone say nothing here: every class has the same norm distribution.
    assert abs(one_vs_rest_norm_auc(grads / grads.norm(dim=1, keepdim=True), labels) - 0.5) < 0.05
    assert abs(direction_attack_auc(torch.randn(400, 32, generator=g), labels, generator=g)
               - 0.5) < 0.1


def test_cut_layer_gradients_are_the_trunks_mean_loss_gradient():
    trunk = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    released = torch.randn(5, 3, 2, 2)
    labels = torch.tensor([0, 1, 2, 1, 0])
    grads = cut_layer_gradients(trunk, released, labels)
    for i in range(5):  # sample i's own loss gradient, divided by the batch size
        a = released[i:i + 1].clone().requires_grad_(True)
        nn.functional.cross_entropy(trunk(a), labels[i:i + 1]).backward()
        torch.testing.assert_close(grads[i:i + 1], a.grad / 5)


# --- inversion --------------------------------------------------------------------------------


def test_inversion_reconstructs_through_an_invertible_release_and_fails_through_noise():
    g = torch.Generator().manual_seed(0)
    data = (images(400, 4, seed=5) > 0.5).float()  # 4x4 binary images
    aux, targets = data[:300], data[300:]
    mixing = torch.randn(16, 32, generator=g)

    def clean(x):
        return x.flatten(1) @ mixing

    def noisy(x):
        return clean(x) + 30.0 * torch.randn(len(x), 32, generator=g)

    good = invert(clean, aux_inputs=aux, targets=targets, epochs=60, generator=g)
    bad = invert(noisy, aux_inputs=aux, targets=targets, epochs=60, generator=g)
    assert good.ssim > 0.8 and good.mse < 0.05
    assert bad.ssim < good.ssim - 0.4 and bad.mse > 4 * good.mse
    assert good.reconstructions.shape == targets.shape


def test_white_box_inversion_finds_the_inputs_through_the_layers_and_not_through_noise():
    from splitlearn.attacks import optimise_inversion

    g = torch.Generator().manual_seed(1)
    targets = (images(64, 4, seed=7) > 0.5).float()
    mixing = torch.randn(16, 32, generator=g)

    def forward(x):
        return torch.relu(x.flatten(1) @ mixing)

    released = forward(targets)
    found = optimise_inversion(forward, released, shape=targets.shape[1:], steps=400)
    noised = optimise_inversion(forward, released + 30.0 * torch.randn(released.shape, generator=g),
                                shape=targets.shape[1:], steps=400)
    assert found.shape == targets.shape and 0 <= float(found.min()) <= float(found.max()) <= 1
    assert float(ssim(found, targets).mean()) > 0.8
    assert float(ssim(noised, targets).mean()) < float(ssim(found, targets).mean()) - 0.4


def test_linking_releases_averages_their_noise_down_by_the_root_of_their_number():
    from splitlearn.attacks import linked_releases

    g = torch.Generator().manual_seed(3)
    x = torch.zeros(2000, 4)

    def release(inputs):
        return inputs + torch.randn(inputs.shape, generator=g)

    assert float(linked_releases(release, 16)(x).std()) == pytest.approx(0.25, rel=0.05)
    with pytest.raises(ValueError, match="count"):
        linked_releases(release, 0)


def test_the_tables_linked_release_is_one_release_at_sigma_over_root_k():
    """experiments.attack draws the average of k Gaussian releases at once, at sigma/sqrt(k)."""
    from splitlearn.attacks import linked_releases
    from splitlearn.privacy import GaussianActivationMechanism

    g = torch.Generator().manual_seed(4)
    rows = torch.randn(4000, 6, generator=g)
    averaged = linked_releases(GaussianActivationMechanism(
        clip_norm=1.0, noise_multiplier=0.8, generator=g), 10)(rows)
    at_once = GaussianActivationMechanism(clip_norm=1.0, noise_multiplier=0.8 / 10 ** 0.5,
                                          generator=g)(rows)
    clipped = rows / rows.norm(dim=1, keepdim=True).clamp(min=1.0)
    assert float((averaged - clipped).std()) == pytest.approx(float((at_once - clipped).std()),
                                                              rel=0.05)


def test_the_differentiable_dcor_is_the_statistic_and_its_gradient_lowers_it():
    from splitlearn.attacks.dcor import distance_correlation_tensor

    g = torch.Generator().manual_seed(2)
    x = torch.randn(32, 6, generator=g)
    y = (x @ torch.randn(6, 4, generator=g) + 0.1 * torch.randn(32, 4, generator=g))
    y.requires_grad_(True)
    value = distance_correlation_tensor(x, y)
    assert value.item() == pytest.approx(distance_correlation(x, y.detach()), abs=1e-5)
    value.backward()
    assert torch.isfinite(y.grad).all()  # coinciding rows (the diagonal) included
    lower = distance_correlation(x, (y - 0.5 * y.grad / y.grad.norm()).detach())
    assert lower < value.item()
    constant = torch.ones(32, 4, requires_grad=True)
    distance_correlation_tensor(x, constant).backward()
    assert float(constant.grad.abs().sum()) == 0.0


def test_the_server_sees_ushaped_gradients_at_the_trunks_features_noised_as_the_device_sends():
    from experiments.attack import server_seen_gradients
    from protocols import compose_config
    from splitlearn.config import PrivacyConfig
    from tests.conftest import digits_like_model

    model = digits_like_model()
    cfg = compose_config(["strategy=ushaped", "strategy.tail_cut=3", "model.cut=1"])
    released = torch.randn(16, *model.cut_shape(1))
    labels = torch.arange(16) % 10
    plain = server_seen_gradients(cfg, model, released, labels, PrivacyConfig(),
                                  generator=torch.Generator().manual_seed(0))
    # Reference: the device's tail and loss on the trunk's features, by hand.
    with torch.no_grad():
        features = model.stages[2](model.stages[1](released))
    leaf = features.clone().requires_grad_(True)
    out = leaf
    for stage in model.stages[3:]:
        out = stage(out)
    nn.functional.cross_entropy(out, labels).backward()
    torch.testing.assert_close(plain, leaf.grad)
    noised = server_seen_gradients(
        cfg, model, released, labels, PrivacyConfig(gradient_noise_multiplier=1.0),
        generator=torch.Generator().manual_seed(0))
    assert noised.shape == plain.shape and not torch.allclose(noised, plain)
    split = compose_config(["model.cut=1"])  # the trunk holds the loss: the gradient at the cut
    at_cut = server_seen_gradients(split, model, released, labels, PrivacyConfig(),
                                   generator=torch.Generator())
    assert at_cut.shape == released.shape
