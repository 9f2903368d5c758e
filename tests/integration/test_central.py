"""The limit the overhead suite divides by: the whole model trained data-parallel on every core."""

from __future__ import annotations

import pytest

from experiments.central import train_central
from tests.conftest import small_config


def test_central_training_runs_on_two_processes_and_learns():
    result = train_central(small_config("strategy.local_epochs=1"), processes=2, epochs=3)
    assert result.processes == 2 and len(result.epoch_s) == 3
    assert result.samples_per_s > 0
    assert result.test_accuracy > 0.5  # 10 classes: chance is 0.1


def test_central_training_needs_a_warm_up_epoch_and_a_measured_one():
    with pytest.raises(ValueError, match="epochs=1: need at least 2"):
        train_central(small_config(), processes=1, epochs=1)
