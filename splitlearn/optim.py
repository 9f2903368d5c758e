"""Each side's optimiser, and the learning rate's schedule over rounds.

Devices and the trunk each train with an optimiser named by Hydra's ``_target_``
(``strategy.optimizer``; ``strategy.trunk_optimizer``, else the devices'): any
``torch.optim.Optimizer`` class. Plain SGD, the default, steps through
:class:`~splitlearn.light_sgd.LightSGD`: the same update without the seconds that
torch's first optimiser costs a fresh process (a device starts one per message).

``strategy.schedule`` names a ``torch.optim.lr_scheduler`` class, stepped once per
round. The server computes each round's factor (:func:`lr_factor`, a pure function
of the round) and sends it with the round, so no side keeps a scheduler's state: a
resumed run continues the schedule exactly, and the trunk's optimiser state (Adam's
moments, SGD's momentum) is in the checkpoint with its weights. A device's optimiser
starts afresh each round, as its process does.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from splitlearn.config import OptimizerConfig, StrategyConfig
from splitlearn.light_sgd import LightSGD

#: The default optimiser; :class:`LightSGD` steps it unless its options need torch's.
SGD_TARGET = "torch.optim.SGD"
#: Options :class:`LightSGD` takes (anything else, e.g. ``nesterov``, needs torch's SGD).
_LIGHT_OPTIONS = frozenset({"momentum", "weight_decay"})
#: Keyword arguments a schedule's length may go by (filled with ``strategy.num_rounds``).
_LENGTH_KEYS = ("T_max", "total_iters")

Optimizer = torch.optim.Optimizer | LightSGD


def side_config(strategy: StrategyConfig, side: str) -> tuple[OptimizerConfig, str]:
    """Return the optimiser of ``side`` (``"device"`` or ``"trunk"``) and its config key."""
    if side == "trunk" and strategy.trunk_optimizer._target_ is not None:
        return strategy.trunk_optimizer, "strategy.trunk_optimizer"
    if side not in ("device", "trunk"):
        raise ValueError(f"side must be 'device' or 'trunk', got {side!r}")
    return strategy.optimizer, "strategy.optimizer"


def _import(target: str) -> Any:
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError, ValueError):
        return None


def optimizer_class(target: str | None, key: str) -> type[torch.optim.Optimizer]:
    """Return the ``torch.optim.Optimizer`` class ``target`` names (ValueError naming ``key``)."""
    found = _import(target) if target else None
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        raise ValueError(f"{key}._target_={target!r} is not a torch.optim.Optimizer class "
                         "(e.g. torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)")
    return found


def optimizer_kwargs(config: OptimizerConfig, *, lr: float, momentum: float,
                     weight_decay: float) -> dict[str, Any]:
    """Return the keyword arguments ``config``'s optimiser is built with.

    ``lr`` is the rate to train at (the side's base times the schedule's factor);
    ``weight_decay``, and for SGD ``momentum``, apply unless ``config.options`` set them.
    """
    kwargs: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if config._target_ == SGD_TARGET:
        kwargs["momentum"] = momentum
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in config.options.items()}
    return kwargs | options


def is_light(config: OptimizerConfig) -> bool:
    """Whether :class:`LightSGD` steps ``config`` (plain SGD: momentum, weight decay)."""
    return config._target_ == SGD_TARGET and set(config.options) <= _LIGHT_OPTIONS


def make_optimizer(params: Iterable[Tensor], config: OptimizerConfig, *, lr: float,
                   momentum: float = 0.0, weight_decay: float = 0.0,
                   key: str = "strategy.optimizer", torch_only: bool = False) -> Optimizer:
    """Return ``config``'s optimiser over ``params`` (see :func:`optimizer_kwargs`).

    ``torch_only`` builds torch's class even for plain SGD (a wrapper such as
    Opacus's needs one); otherwise plain SGD is a :class:`LightSGD`.
    """
    kwargs = optimizer_kwargs(config, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if is_light(config) and not torch_only:
        return LightSGD(params, **kwargs)
    return optimizer_class(config._target_, key)(params, **kwargs)


def base_lr(strategy: StrategyConfig, side: str) -> float:
    """Return ``side``'s learning rate before the schedule: its own, else ``strategy.lr``."""
    config, _ = side_config(strategy, side)
    return strategy.lr if config.lr is None else config.lr


def build_optimizer(params: Iterable[Tensor], strategy: StrategyConfig, side: str, *,
                    lr_factor: float = 1.0, torch_only: bool = False) -> Optimizer:
    """Return ``side``'s optimiser over ``params`` at this round's learning rate.

    Parameters
    ----------
    params : Iterable[Tensor]
        The trained parameters.
    strategy : StrategyConfig
        The run's training settings.
    side : str
        ``"device"`` or ``"trunk"``.
    lr_factor : float
        The schedule's factor this round (:func:`lr_factor`).
    torch_only : bool
        Build torch's class even for plain SGD.
    """
    config, key = side_config(strategy, side)
    return make_optimizer(params, config, lr=base_lr(strategy, side) * lr_factor,
                          momentum=strategy.momentum, weight_decay=strategy.weight_decay,
                          key=key, torch_only=torch_only)


def set_lr(optimizer: Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate (the state, e.g. Adam's moments, stays)."""
    if isinstance(optimizer, LightSGD):
        optimizer.lr = lr
        return
    for group in optimizer.param_groups:
        group["lr"] = lr


def trained_params(optimizer: Optimizer) -> list[Tensor]:
    """Return every parameter ``optimizer`` steps, in its order."""
    if isinstance(optimizer, LightSGD):
        return optimizer.params
    return [p for group in optimizer.param_groups for p in group["params"]]


def lr_factor(strategy: StrategyConfig, server_round: int) -> float:
    """Return the schedule's factor for ``server_round`` (1 without a schedule).

    The scheduler, on a one-parameter SGD at learning rate 1, is stepped
    ``server_round - 1`` times; the rate it then sets is the factor.
    """
    schedule = strategy.schedule
    if schedule._target_ is None:
        return 1.0
    if server_round < 1:
        raise ValueError(f"server_round must be >= 1, got {server_round}")
    return _factors(schedule._target_, _frozen(schedule.options), strategy.num_rounds,
                    server_round)[-1]


def scale_lr(strategy: StrategyConfig, factor: object) -> None:
    """Scale every base learning rate in ``strategy`` by the round's ``factor``, in place.

    A device receives the factor with its round (:func:`lr_factor` on the server) and
    trains at its base rate times it.

    Raises
    ------
    ValueError
        The factor is not a finite number >= 0.
    """
    try:
        value = float(factor)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"the round's lr_factor={factor!r} is not a finite number >= 0")
    strategy.lr *= value
    for config in (strategy.optimizer, strategy.trunk_optimizer):
        if config.lr is not None:
            config.lr *= value


def _frozen(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


@functools.lru_cache(maxsize=64)
def _factors(target: str, options: tuple[tuple[str, Any], ...], num_rounds: int,
             rounds: int) -> tuple[float, ...]:
    found = scheduler_class(target)
    kwargs = dict(options)
    accepted = inspect.signature(found).parameters
    for name in _LENGTH_KEYS:
        if name in accepted and name not in kwargs:
            kwargs[name] = num_rounds
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = found(optimizer, **kwargs)
    factors = []
    for _ in range(rounds):
        factors.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()  # no gradient: nothing moves; the scheduler expects a step first
        scheduler.step()
    return tuple(factors)


def scheduler_class(target: str) -> type:
    """Return the learning-rate scheduler class ``target`` names (ValueError naming the key)."""
    found = _import(target)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    if isinstance(found, type) and issubclass(found, plateau):
        raise ValueError(f"strategy.schedule._target_={target!r} steps on a metric; give a "
                         "schedule over rounds (e.g. torch.optim.lr_scheduler.CosineAnnealingLR)")
    if not (isinstance(found, type) and issubclass(found, torch.optim.lr_scheduler.LRScheduler)):
        raise ValueError(f"strategy.schedule._target_={target!r} is not a torch.optim."
                         "lr_scheduler class (e.g. torch.optim.lr_scheduler.CosineAnnealingLR)")
    return found


def _check_light(kwargs: dict[str, Any], key: str) -> None:
    """Refuse plain SGD's values as ``torch.optim.SGD`` would (its first build costs seconds)."""
    for name in ("lr", "momentum", "weight_decay"):
        value = kwargs[name]
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{key}: torch.optim.SGD refuses {name}={value!r} (a finite "
                             "number >= 0)")


def check_optimizers(strategy: StrategyConfig, *, light_only_devices: str | None = None) -> None:
    """Refuse, naming the key, an optimiser or schedule that could only fail once training.

    Each side's optimiser is built on a probe parameter with its options, and the
    schedule is played out over the run's rounds.

    Parameters
    ----------
    strategy : StrategyConfig
        The run's training settings.
    light_only_devices : str | None
        The setting whose device runtime steps plain SGD only (e.g. ``devices.web=true``);
        None: devices may use any optimiser.

    Raises
    ------
    ValueError
        Naming the offending key and why.
    """
    trunk = strategy.trunk_optimizer
    if trunk._target_ is None and (trunk.lr is not None or trunk.options):
        raise ValueError("strategy.trunk_optimizer sets lr or options without _target_ (the "
                         "trunk then trains with strategy.optimizer); name its _target_ too")
    for side in ("device", "trunk"):
        config, key = side_config(strategy, side)
        if config._target_ is None:
            raise ValueError(f"{key}._target_ is null; name a torch.optim.Optimizer class")
        if {"lr", "params"} & set(config.options):
            raise ValueError(f"{key}.options sets {sorted({'lr', 'params'} & set(config.options))}"
                             f": the learning rate is {key}.lr (None: strategy.lr)")
        if config.lr is not None and not config.lr > 0:
            raise ValueError(f"{key}.lr must be > 0, got {config.lr}")
        found = optimizer_class(config._target_, key)
        kwargs = optimizer_kwargs(config, lr=base_lr(strategy, side),
                                  momentum=strategy.momentum, weight_decay=strategy.weight_decay)
        if is_light(config):  # checked as torch's SGD checks them, without building one
            _check_light(kwargs, key)
            continue
        try:
            found([nn.Parameter(torch.zeros(2))], **kwargs)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{key}: {config._target_} refuses its options: {err}") from err
    if light_only_devices and not is_light(strategy.optimizer):
        raise ValueError(f"{light_only_devices} with strategy.optimizer._target_="
                         f"{strategy.optimizer._target_} and options "
                         f"{sorted(strategy.optimizer.options)}: that runtime steps plain SGD "
                         "(momentum, weight decay) only")
    if strategy.schedule._target_ is None:
        return
    try:
        factors = _factors(strategy.schedule._target_, _frozen(strategy.schedule.options),
                           strategy.num_rounds, strategy.num_rounds)
    except (TypeError, ValueError, KeyError) as err:
        if str(err).startswith("strategy.schedule"):
            raise
        raise ValueError(f"strategy.schedule: {strategy.schedule._target_} refuses its options: "
                         f"{err}") from err
    if not all(math.isfinite(f) and f >= 0 for f in factors):
        raise ValueError(f"strategy.schedule gives learning-rate factors {factors[:5]}...: "
                         "each must be finite and >= 0")
