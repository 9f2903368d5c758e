"""Splittable models and a name-based registry."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from splitlearn.models.base import SplittableModel, StageCost, total_cost
from splitlearn.models.cnn import SmallCNN
from splitlearn.models.resnet import ResNet

__all__ = [
    "MODELS",
    "ResNet",
    "SmallCNN",
    "SplittableModel",
    "StageCost",
    "build_model",
    "total_cost",
]

# Read-only so that no caller can register models as a global side effect.
MODELS: Mapping[str, type[SplittableModel]] = MappingProxyType(
    {"cnn": SmallCNN, "resnet": ResNet}
)


def build_model(
    name: str,
    *,
    in_channels: int,
    image_size: int,
    num_classes: int,
    seed: int | None = None,
    **kwargs: Any,
) -> SplittableModel:
    """Build a registered model.

    Parameters
    ----------
    name : str
        Registry key, one of ``MODELS`` (``"cnn"``, ``"resnet"``).
    in_channels : int
        Input channels.
    image_size : int
        Height and width of the square input.
    num_classes : int
        Number of output logits.
    seed : int | None, optional
        If given, parameter initialisation is deterministic for this seed.
        The global RNG state is forked and restored, so building a model does
        not perturb other random streams.
    **kwargs : Any
        Model-specific keyword arguments (see the model classes).

    Returns
    -------
    SplittableModel
        The freshly initialised model.

    Raises
    ------
    ValueError
        If ``name`` is not registered.
    """
    if name not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; accepted names are {sorted(MODELS)}"
        )
    cls = MODELS[name]
    if seed is None:
        return cls(
            in_channels=in_channels,
            image_size=image_size,
            num_classes=num_classes,
            **kwargs,
        )
    # devices=[] : CPU init only; avoids touching (or warning about) CUDA RNGs.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(
            in_channels=in_channels,
            image_size=image_size,
            num_classes=num_classes,
            **kwargs,
        )
