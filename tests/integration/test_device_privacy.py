"""Per-device privacy in a mixed fleet (``privacy.per_device``), through the shipped apps.

Each device applies its class's own sigma and budget: its epsilon is its own
accountant's, and a class with a small budget declines (status ``budget``) while
the others train on.
"""

from __future__ import annotations

import pytest

from clients.device import device_profile
from protocols import check_config, compose_config
from splitlearn.config import run_spec
from splitlearn.privacy.accounting import compute_epsilon
from tests.integration.test_simulation import read_clients, run_in_process

#: The mixed fleet, every device reachable and staying (the test is about privacy).
MIX = ("low_end_phone", "mid_range_phone", "flagship_phone", "raspberry_pi_4", "jetson_nano")
FLEET = ("logger=none", "devices=mixed", "num_clients=4", "strategy.num_rounds=2",
         "strategy.local_epochs=1", "privacy=activation_gaussian", "privacy.clip_norm=10",
         "privacy.noise_multiplier=0.5",
         *(f"devices.profiles.{d}.{k}={v}" for d in MIX for k, v in (("availability", 1.0),
                                                                     ("dropout", 0.0))))


def profiles() -> dict[str, str]:
    """Partition id -> its device preset, as every device derives it."""
    spec = run_spec(compose_config(list(FLEET)), host_flops_per_s=0.0)
    return {str(p): device_profile(spec, partition_id=p, num_partitions=4).name for p in range(4)}


def test_each_device_class_applies_its_own_noise_and_budget(tmp_path):
    by_partition = profiles()
    noisy, frugal = sorted(set(by_partition.values()))[:2]
    run_dir = run_in_process(tmp_path, *FLEET, f"+privacy.per_device={{{noisy}: "
                             f"{{noise_multiplier: 2.0}}, {frugal}: {{epsilon_max: 1e-3}}}}")
    rows = read_clients(run_dir)
    frugal_rows = [r for r in rows if by_partition[r["client"]] == frugal]
    # Declined in round 1, never sampled again (the budget guard); the others train on.
    assert [(r["round"], r["status"]) for r in frugal_rows] == [("1", "budget")]
    assert len(rows) == 8 - 1
    for row in rows:
        device = by_partition[row["client"]]
        if device == frugal:  # its first round would exceed its own budget
            assert row["status"] == "budget"
            continue
        assert row["status"] == "ok"
        sigma = 2.0 if device == noisy else 0.5
        # One release of every example per local epoch, replace-one: multiplier sigma / 2.
        epochs = int(row["round"])
        assert float(row["epsilon"]) == pytest.approx(
            compute_epsilon(history=[(sigma / 2, 1.0, epochs)], delta=1e-5), rel=1e-6)


def test_a_per_device_entry_must_name_a_preset():
    for entry, reason in (
        ("toaster: {epsilon_max: 1}", r"names \['toaster'\], not device presets"),
        ("wearable: {epsilon_max: -1}", "per_device.wearable.epsilon_max must be"),
    ):
        cfg = compose_config([*FLEET, f"+privacy.per_device={{{entry}}}"])
        cfg.run_dir = "unused"
        with pytest.raises(ValueError, match=reason):
            check_config(cfg)
