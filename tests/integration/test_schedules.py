"""A schedule's rate reaches both sides each round: at rate 0 nothing trains anywhere."""

from __future__ import annotations

import pytest

from experiments.local import run_local
from tests.conftest import small_config

#: Round 1 at the base rate, every later round at 0 (StepLR: x0 after each round).
STOP_AFTER_ROUND_1 = ("strategy.schedule._target_=torch.optim.lr_scheduler.StepLR",
                      "+strategy.schedule.options.step_size=1",
                      "+strategy.schedule.options.gamma=0.0")


@pytest.mark.parametrize("overrides", [
    (),  # SplitFed v2: devices and the shared trunk, SGD with momentum
    ("strategy=ushaped", "strategy.optimizer._target_=torch.optim.Adam", "strategy.lr=0.01"),
    ("strategy=fedavg", "strategy.optimizer._target_=torch.optim.AdamW", "strategy.lr=0.01"),
    ("strategy.optimizer._target_=torch.optim.Adam", "strategy.lr=0.01",
     "strategy.trunk_optimizer._target_=torch.optim.SGD", "strategy.trunk_optimizer.lr=0.1"),
], ids=["splitfed_v2-sgd", "ushaped-adam", "fedavg-adamw", "adam-devices-sgd-trunk"])
def test_a_schedule_at_zero_stops_training_on_devices_and_trunk_alike(tmp_path, overrides):
    result = run_local(small_config("strategy.num_rounds=3", *STOP_AFTER_ROUND_1, *overrides,
                                    run_dir=str(tmp_path)))
    losses = [r["test_loss"] for r in result.history]
    assert losses[1] != pytest.approx(losses[0], rel=1e-4)  # round 1 trained
    # Rounds 2 and 3 trained at rate 0 on every side: the merged model stays as it was
    # (to the rounding of averaging equal copies). A side that missed the factor would move.
    assert losses[2] == pytest.approx(losses[1], rel=1e-6)
    assert losses[3] == pytest.approx(losses[1], rel=1e-6)
