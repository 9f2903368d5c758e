"""Secure aggregation and DP-FedAvg: config refusals, the device's clipping, the accounting."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM
from hypothesis import given, settings
from hypothesis import strategies as st
from opacus.accountants import RDPAccountant

from clients.secagg import clip_update
from protocols import check_config, compose_config
from splitlearn.privacy.floor import PrivacyFloor, PrivacyFloorViolation
from strategies.privacy import update_epsilon
from strategies.secure_aggregation import _count_or_fraction


def composed(*overrides: str):  # noqa: ANN201 - a DictConfig ready for preflight
    cfg = compose_config(["logger=none", *overrides])
    cfg.run_dir = "unused"
    return cfg


@pytest.mark.parametrize("overrides, key", [
    (["aggregation.num_shares=2"], "aggregation.num_shares"),
    (["aggregation.num_shares=4.5"], "aggregation.num_shares"),
    (["aggregation.num_shares=5", "aggregation.reconstruction_threshold=5"],
     "aggregation.reconstruction_threshold"),
    (["aggregation.clipping_range=0"], "aggregation.clipping_range"),
    (["aggregation.max_weight=-1"], "aggregation.max_weight"),
    (["aggregation.update_noise_multiplier=1.0"], "aggregation.update_noise_multiplier"),
    (["aggregation.update_clip_norm=-1"], "aggregation.update_clip_norm"),
    (["aggregation.update_clip_norm=1", "aggregation.update_delta=1"], "aggregation.update_delta"),
    (["aggregation.secure=true", "strategy=sequential"], "strategy=sequential"),
    (["aggregation.update_clip_norm=1", "strategy=local_loss", "strategy.bulk=true"],
     "strategy.bulk"),
    (["aggregation.secure=true", "planner=greedy"], "planner=uniform"),
    (["aggregation.secure=true", "strategy.min_train_nodes=1"], "strategy.min_train_nodes"),
])
def test_a_setting_that_cannot_hold_is_refused_naming_its_key(overrides, key):
    with pytest.raises(Exception) as err:
        check_config(composed(*overrides))
    text = str(err.value) + str(err.value.__cause__ or "")
    assert key in text


@pytest.mark.parametrize("strategy", ["fedavg", "splitfed_v1", "splitfed_v2", "ushaped", "sglr",
                                      "local_loss"])
def test_every_averaging_protocol_accepts_secure_aggregation_with_dp(strategy):
    check_config(composed(f"strategy={strategy}", "aggregation.secure=true",
                          "aggregation.update_clip_norm=1.0",
                          "aggregation.update_noise_multiplier=1.0"))


def test_counts_and_fractions_follow_flowers_convention():
    assert _count_or_fraction(5.0) == 5 and isinstance(_count_or_fraction(5.0), int)
    assert _count_or_fraction(0.5) == 0.5 and isinstance(_count_or_fraction(1.0), float)


def record(**arrays: np.ndarray) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


@settings(max_examples=40, deadline=None)
@given(scale=st.floats(1e-3, 1e3), clip=st.floats(1e-2, 10.0), seed=st.integers(0, 2**16))
def test_clipping_bounds_the_update_and_keeps_its_direction(scale, clip, seed):
    rng = np.random.default_rng(seed)
    sent = record(w=rng.normal(size=(4, 3)).astype(np.float32),
                  b=rng.normal(size=3).astype(np.float32), n=np.array(7, dtype=np.int64))
    moved = {k: sent[k].numpy() + scale * rng.normal(size=sent[k].shape).astype(np.float32)
             for k in ("w", "b")}
    returned = record(**moved, n=np.array(19, dtype=np.int64))
    clipped = clip_update(returned, sent, {KEY_CLIPPING_NORM: clip})
    before = np.concatenate([(moved[k] - sent[k].numpy()).ravel() for k in ("w", "b")])
    after = np.concatenate([(clipped[k].numpy() - sent[k].numpy()).ravel() for k in ("w", "b")])
    norm = np.linalg.norm(before)
    assert np.linalg.norm(after) == pytest.approx(min(norm, clip), rel=1e-4, abs=1e-5)
    # Same direction, to float32's rounding of the weights themselves: a tiny update on
    # large weights (clip 0.01 on a move of 1e3) keeps only their last bits.
    def rounding(a: dict, b: ArrayRecord) -> float:  # float32 error of one a - b, per entry
        eps = np.finfo(np.float32).eps
        return max(eps * (np.abs(a[k]).max() + np.abs(b[k].numpy()).max()) for k in ("w", "b"))

    after_error = rounding({k: clipped[k].numpy() for k in ("w", "b")}, sent)
    tolerance = 1e-5 + 2 * (after_error / np.linalg.norm(after) + rounding(moved, sent) / norm)
    np.testing.assert_allclose(after / np.linalg.norm(after), before / norm, rtol=0,
                               atol=tolerance)
    assert int(clipped["n"].numpy()) == 19  # a batch counter is not a learned weight
    assert clipped["w"].dtype == sent["w"].dtype


def test_without_a_bound_in_the_task_nothing_is_clipped():
    sent, returned = record(w=np.zeros(3, np.float32)), record(w=np.full(3, 100.0, np.float32))
    assert clip_update(returned, sent, {}) is returned


@pytest.mark.parametrize("sigma, releases", [(0.5, 1), (1.0, 10), (2.0, 50)])
def test_update_epsilon_is_opacus_rdp_of_unsampled_gaussian_releases(sigma, releases):
    reference = RDPAccountant()
    reference.history = [(sigma, 1.0, releases)]
    assert update_epsilon(noise_multiplier=sigma, releases=releases, delta=1e-5) == \
        pytest.approx(reference.get_epsilon(1e-5))


def test_a_node_that_requires_secure_aggregation_refuses_an_unmasked_round():
    floor = PrivacyFloor.from_node_config({"privacy-secure-aggregation": "true"})
    floor.check_aggregation(secure=True)
    with pytest.raises(PrivacyFloorViolation, match="aggregation.secure=true"):
        floor.check_aggregation(secure=False)
    PrivacyFloor.from_node_config({}).check_aggregation(secure=False)
    with pytest.raises(ValueError, match="privacy-secure-aggregation"):
        PrivacyFloor.from_node_config({"privacy-secure-aggregation": "perhaps"})


def test_a_resumed_run_goes_on_spending_from_the_releases_it_had():
    from splitlearn.config import RunSpec
    from strategies.privacy import ClippedUpdateNoise
    from strategies.reporting import ReportingFedAvg

    def wrapped() -> ClippedUpdateNoise:
        return ClippedUpdateNoise(ReportingFedAvg(protocol="fedavg", spec=RunSpec()),
                                  noise_multiplier=1.0, clipping_norm=0.5, delta=1e-5)

    before = wrapped()
    before.releases = 3
    after = wrapped()
    after.restore(before.checkpoint())
    # The next round's epsilon is that of the 4th release, not the 1st.
    assert after.strategy.extra_metrics([]) == {
        "update-epsilon": update_epsilon(noise_multiplier=1.0, releases=4, delta=1e-5)}
    assert after.num_sampled_clients == 1  # nothing averaged yet: Flower's divisor stays >= 1
