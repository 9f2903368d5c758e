"""A node's own privacy floor: read from its node config, enforced against the task."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from splitlearn.config import PrivacyConfig
from splitlearn.privacy.floor import PrivacyFloor, PrivacyFloorViolation

GAUSSIAN = PrivacyConfig(name="activation_gaussian", noise_multiplier=1.0, clip_norm=1.0)


def test_a_node_without_a_floor_accepts_what_the_server_asks():
    floor = PrivacyFloor.from_node_config({"partition-id": 0, "num-partitions": 3})
    assert not floor.required
    floor.check(PrivacyConfig())
    floor.check(GAUSSIAN)
    assert floor.budget(None) is None and floor.budget(4.0) == 4.0


@pytest.mark.parametrize("node_config,task,reason", [
    ({"privacy-min-noise-multiplier": 0.5}, PrivacyConfig(), "no privacy"),
    ({"privacy-option": "dpsgd_client"}, GAUSSIAN, "requires dpsgd_client"),
    ({"privacy-min-noise-multiplier": 1.5}, GAUSSIAN, "at least 1.5"),
    ({"privacy-max-delta": 1e-6}, GAUSSIAN, "at most 1e-06"),
    ({"privacy-epsilon-max": 3.0}, PrivacyConfig(), "no privacy"),
])
def test_a_task_below_the_floor_is_refused_with_the_reason(node_config, task, reason):
    floor = PrivacyFloor.from_node_config(node_config)
    with pytest.raises(PrivacyFloorViolation, match=reason):
        floor.check(task)


def test_the_tighter_budget_applies_so_a_server_cannot_raise_it():
    floor = PrivacyFloor.from_node_config({"privacy-epsilon-max": "3"})  # text, as a CLI gives
    assert floor.budget(None) == 3.0
    assert floor.budget(10.0) == 3.0
    assert floor.budget(2.0) == 2.0
    floor.check(GAUSSIAN)


@pytest.mark.parametrize("node_config,key", [
    ({"privacy-min-noise-multiplier": "lots"}, "privacy-min-noise-multiplier"),
    ({"privacy-min-noise-multiplier": -1}, "privacy-min-noise-multiplier"),
    ({"privacy-min-noise-multiplier": float("nan")}, "privacy-min-noise-multiplier"),
    ({"privacy-epsilon-max": 0}, "privacy-epsilon-max"),
    ({"privacy-epsilon-max": float("inf")}, "privacy-epsilon-max"),
    ({"privacy-epsilon-max": True}, "privacy-epsilon-max"),
    ({"privacy-max-delta": 1.5}, "privacy-max-delta"),
    ({"privacy-option": "none"}, "privacy-option"),
])
def test_a_malformed_floor_fails_naming_its_key(node_config, key):
    with pytest.raises(ValueError, match=key):
        PrivacyFloor.from_node_config(node_config)


@given(floor_sigma=st.floats(0, 10), task_sigma=st.floats(0.01, 10),
       option=st.sampled_from(["activation_gaussian", "dpsgd_client"]))
def test_a_task_passes_exactly_when_its_noise_reaches_the_floor(floor_sigma, task_sigma, option):
    floor = PrivacyFloor(min_noise_multiplier=floor_sigma)
    task = PrivacyConfig(name=option, noise_multiplier=task_sigma)
    if task_sigma >= floor_sigma:
        floor.check(task)
    else:
        with pytest.raises(PrivacyFloorViolation):
            floor.check(task)
