"""Build the configured network: a zoo model by name, or a user's module cut by ``auto_split``."""

from __future__ import annotations

import copy
import json
import threading
from typing import Any

import torch
from torch import nn

from splitlearn.config import DatasetConfig, ModelConfig
from splitlearn.data import describe_dataset
from splitlearn.models import SplittableModel, build_model
from splitlearn.models.autosplit import AutoSplitModel, auto_split


def build_model_from_config(
    model: ModelConfig, dataset: DatasetConfig, *, seed: int | None = None
) -> SplittableModel:
    """Build ``model`` for ``dataset``'s inputs and check its cut.

    With ``model._target_`` set, the class it names is instantiated the Hydra way
    (``hydra.utils.instantiate``) with ``model.options`` as keyword arguments, and
    cut with :func:`~splitlearn.models.autosplit.auto_split` unless it is already a
    :class:`SplittableModel`. The original module stays reachable through
    :func:`source_module` (its parameters are the split model's).

    Raises
    ------
    ValueError
        If the cut is out of range (listing the valid ones) or the network's
        output does not have the dataset's number of classes.
    """
    spec = describe_dataset(dataset.name, image_size=dataset.image_size)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        if model._target_ is None:
            net = build_model(
                model.name, in_channels=spec.in_channels, image_size=spec.image_size,
                num_classes=spec.num_classes, **model.options,
            )
        else:
            net = _user_model(
                model._target_, model.options,
                (spec.in_channels, spec.image_size, spec.image_size),
            )
    if net.num_classes != spec.num_classes:
        raise ValueError(
            f"model {model._target_ or model.name} outputs {net.num_classes} classes; "
            f"dataset {dataset.name} has {spec.num_classes}"
        )
    try:
        net.check_cut(model.cut)
    except ValueError as err:
        raise ValueError(f"model.cut: {err}") from None
    return net


def _user_model(target: str, options: dict[str, Any], input_shape: tuple[int, ...]) -> nn.Module:
    from hydra.utils import instantiate

    module = instantiate({"_target_": target, **options})
    if isinstance(module, SplittableModel):
        return module
    if not isinstance(module, nn.Module):
        raise ValueError(f"model._target_={target} built a {type(module).__name__}, not a module")
    key = (target, json.dumps(options, sort_keys=True, default=repr), input_shape)
    return _split_once_per_process(module, key, input_shape)


#: A split of each configured module, traced once per process (see _split_once_per_process).
_SPLITS: dict[tuple[str, str, tuple[int, ...]], AutoSplitModel] = {}
_SPLITS_LOCK = threading.Lock()


def _split_once_per_process(module: nn.Module, key: tuple[str, str, tuple[int, ...]],
                            input_shape: tuple[int, ...]) -> AutoSplitModel:
    """Split ``module``, tracing only the first module of its kind in this process.

    Later modules get a copy of the first split holding their own weights. Tracing
    patches torch for the whole process, so a trace while other threads train
    (clients run as threads in one process) breaks their forward passes: the
    process's first build, before its threads start, is its only trace.
    """
    with _SPLITS_LOCK:
        template = _SPLITS.get(key)
        if template is None:
            split = auto_split(module, torch.zeros(2, *input_shape))
            # Kept outside the module tree (no duplicate state-dict entries): the
            # original module whose state dict a run hands back at the end.
            split.__dict__["source"] = module
            _SPLITS[key] = copy.deepcopy(split)
            return split
        split = copy.deepcopy(template)  # the split's stages and its source, still shared
    source_module(split).load_state_dict(module.state_dict())
    return split


def source_module(model: SplittableModel) -> nn.Module:
    """Return the module the user configured (the split model itself for zoo networks)."""
    return model.__dict__.get("source", model) if isinstance(model, AutoSplitModel) else model
