"""Each side's optimiser by ``_target_``, and the learning rate's schedule over rounds."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from protocols import check_config, compose_config
from splitlearn.config import OptimizerConfig, ScheduleConfig, StrategyConfig
from splitlearn.light_sgd import LightSGD
from splitlearn.optim import (
    build_optimizer,
    check_optimizers,
    lr_factor,
    scale_lr,
    set_lr,
)
from tests.helpers import imports_in_a_fresh_process


def composed(*overrides: str):
    return compose_config(["logger=none", "num_clients=3", *overrides])


def torch_schedule(scheduler, rounds: int, **kwargs) -> list[float]:
    """The rates torch's own scheduler sets, stepped once per round, on SGD at lr 1."""
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    schedule = scheduler(optimizer, **kwargs)
    rates = []
    for _ in range(rounds):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return rates


@pytest.mark.parametrize(("target", "options", "expected"), [
    ("CosineAnnealingLR", {}, {"T_max": 12}),  # the run's rounds fill in its length
    ("CosineAnnealingLR", {"T_max": 5, "eta_min": 0.1}, {"T_max": 5, "eta_min": 0.1}),
    ("StepLR", {"step_size": 4, "gamma": 0.5}, {"step_size": 4, "gamma": 0.5}),
    ("LinearLR", {"start_factor": 0.25}, {"start_factor": 0.25, "total_iters": 12}),
    ("ExponentialLR", {"gamma": 0.9}, {"gamma": 0.9}),
])
def test_each_rounds_factor_is_what_torchs_scheduler_sets_that_round(target, options, expected):
    strategy = StrategyConfig(name="splitfed_v2", num_rounds=12, schedule=ScheduleConfig(
        _target_=f"torch.optim.lr_scheduler.{target}", options=options))
    reference = torch_schedule(getattr(torch.optim.lr_scheduler, target), 12, **expected)
    assert [lr_factor(strategy, r) for r in range(1, 13)] == pytest.approx(reference, abs=1e-12)
    assert len(set(reference)) > 1  # the schedule does change the rate


def test_without_a_schedule_every_round_trains_at_the_base_rate():
    strategy = StrategyConfig(name="splitfed_v2")
    assert {lr_factor(strategy, r) for r in (1, 2, 1000)} == {1.0}


def test_plain_sgd_steps_light_and_the_others_are_torchs_own_classes():
    params = [nn.Parameter(torch.zeros(3))]
    plain = StrategyConfig(name="splitfed_v2", lr=0.2, momentum=0.3, weight_decay=0.01)
    light = build_optimizer(params, plain, "device", lr_factor=0.5)
    assert isinstance(light, LightSGD)
    assert (light.lr, light.momentum, light.weight_decay) == (0.1, 0.3, 0.01)
    adam = StrategyConfig(name="splitfed_v2", lr=0.2, trunk_optimizer=OptimizerConfig(
        _target_="torch.optim.Adam", lr=0.004, options={"betas": [0.5, 0.9], "eps": 1e-6}))
    trunk = build_optimizer(params, adam, "trunk", lr_factor=0.5)
    assert type(trunk) is torch.optim.Adam
    group = trunk.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (0.002, (0.5, 0.9), 1e-6)
    assert isinstance(build_optimizer(params, adam, "device"), LightSGD)  # devices: SGD still
    nesterov = StrategyConfig(name="splitfed_v2", momentum=0.5,
                              optimizer=OptimizerConfig(options={"nesterov": True}))
    assert type(build_optimizer(params, nesterov, "device")) is torch.optim.SGD
    set_lr(trunk, 0.5)
    assert trunk.param_groups[0]["lr"] == 0.5


def test_a_device_scales_its_rates_by_the_rounds_factor_and_refuses_a_broken_one():
    strategy = StrategyConfig(name="splitfed_v2", lr=0.1,
                              optimizer=OptimizerConfig(_target_="torch.optim.Adam", lr=0.01))
    scale_lr(strategy, 0.5)
    assert (strategy.lr, strategy.optimizer.lr) == (0.05, 0.005)
    for broken in (math.nan, -1.0, math.inf, "x", None):
        with pytest.raises(ValueError, match="lr_factor"):
            scale_lr(strategy, broken)


@pytest.mark.parametrize(("overrides", "key"), [
    (["strategy.optimizer._target_=torch.optim.Adamm"], "strategy.optimizer._target_"),
    (["strategy.optimizer._target_=torch.nn.Linear"], "strategy.optimizer._target_"),
    (["strategy.trunk_optimizer._target_=os.system"], "strategy.trunk_optimizer._target_"),
    (["strategy.optimizer._target_=torch.optim.Adam", "+strategy.optimizer.options.bettas=1"],
     "strategy.optimizer: torch.optim.Adam refuses its options"),
    (["strategy.optimizer._target_=torch.optim.Adam",
      "+strategy.optimizer.options.betas=[2.0,0.9]"], "strategy.optimizer"),
    (["+strategy.optimizer.options.lr=0.1"], "strategy.optimizer.options sets ['lr']"),
    (["strategy.optimizer.lr=-0.1"], "strategy.optimizer.lr must be > 0"),
    (["strategy.trunk_optimizer.lr=0.1"], "strategy.trunk_optimizer sets lr or options without"),
    (["strategy.optimizer._target_=null"], "strategy.optimizer._target_ is null"),
    (["strategy.schedule._target_=torch.optim.lr_scheduler.ReduceLROnPlateau"],
     "strategy.schedule._target_"),
    (["strategy.schedule._target_=torch.optim.SGD"], "strategy.schedule._target_"),
    (["strategy.schedule._target_=torch.optim.lr_scheduler.StepLR"],
     "strategy.schedule: torch.optim.lr_scheduler.StepLR refuses its options"),
    (["strategy.schedule._target_=torch.optim.lr_scheduler.ExponentialLR",
      "+strategy.schedule.options.gamma=-2"], "strategy.schedule gives"),
    (["devices.web=true", "dataplane.websocket_port=0",
      "strategy.optimizer._target_=torch.optim.Adam"], "devices.web=true with strategy.optimizer"),
])
def test_a_wrong_optimiser_or_schedule_is_refused_before_the_run_naming_its_key(overrides, key):
    cfg = composed(*overrides)
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        check_config(cfg)


def test_adamw_on_both_sides_with_a_cosine_schedule_passes_preflight():
    check_config(composed(
        "strategy.optimizer._target_=torch.optim.AdamW", "strategy.lr=0.003",
        "+strategy.optimizer.options.betas=[0.9,0.99]",
        "strategy.trunk_optimizer._target_=torch.optim.Adam",
        "strategy.schedule._target_=torch.optim.lr_scheduler.CosineAnnealingLR",
        "+strategy.schedule.options.eta_min=0.0001"))


def test_a_run_without_a_trunk_optimiser_gives_the_trunk_the_devices_one():
    strategy = StrategyConfig(name="splitfed_v2", lr=0.05,
                              optimizer=OptimizerConfig(_target_="torch.optim.AdamW"))
    params = [nn.Parameter(torch.zeros(2))]
    assert type(build_optimizer(params, strategy, "trunk")) is torch.optim.AdamW
    check_optimizers(strategy)


@pytest.mark.parametrize(("overrides", "message"), [
    (["strategy.momentum=-0.5"], "torch.optim.SGD refuses momentum=-0.5"),
    (["strategy.weight_decay=-1"], "torch.optim.SGD refuses weight_decay=-1"),
    (["strategy.lr=-0.1"], "torch.optim.SGD refuses lr=-0.1"),
])
def test_plain_sgd_is_checked_as_torch_checks_it_without_building_torchs(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(composed(*overrides))
    # The values torch's own SGD refuses, for the same reason.
    strategy = composed(*overrides).strategy
    with pytest.raises(ValueError):
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=strategy.lr,
                        momentum=strategy.momentum, weight_decay=strategy.weight_decay)


def test_preflight_of_the_default_job_builds_no_torch_optimiser():
    # The first torch optimiser a process builds imports its compiler (seconds).
    code = ("from protocols import check_config, compose_config\n"
            "check_config(compose_config(['logger=none']))")
    assert not imports_in_a_fresh_process(code, "torch._dynamo")
    with_adam = code.replace("'logger=none'", "'logger=none', "
                             "'strategy.optimizer._target_=torch.optim.Adam'")
    assert imports_in_a_fresh_process(with_adam, "torch._dynamo")  # what the test would see
