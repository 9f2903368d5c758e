"""Splittable models and a name-based registry."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from splitlearn.models.base import SplittableModel, StageCost, total_cost
from splitlearn.models.cnn import SmallCNN
from splitlearn.models.densenet import DenseNet
from splitlearn.models.lenet import LeNet5
from splitlearn.models.mobilenet import MobileNetV2
from splitlearn.models.resnet import ResNet, ResNet18
from splitlearn.models.vgg import VGG11BN
from splitlearn.models.vit import ViT

__all__ = [
    "MODELS",
    "ZOO",
    "DenseNet",
    "LeNet5",
    "MobileNetV2",
    "ResNet",
    "ResNet18",
    "SmallCNN",
    "VGG11BN",
    "ViT",
    "SplittableModel",
    "StageCost",
    "build_model",
    "total_cost",
]

# Read-only so that no caller can register models as a global side effect.
# MODELS: the project's small default networks (five stages, deterministic in
# train mode, fast at 8x8); the generic model and split tests run over them.
MODELS: Mapping[str, type[SplittableModel]] = MappingProxyType(
    {"cnn": SmallCNN, "resnet": ResNet}
)
# ZOO: published architectures for 8x8 to 224x224 inputs (docs/zoo.md), with
# their own stage counts and dropout; tests/unit/test_zoo.py covers them.
ZOO: Mapping[str, type[SplittableModel]] = MappingProxyType(
    {
        "lenet5": LeNet5,
        "vgg11_bn": VGG11BN,
        "resnet18": ResNet18,
        "mobilenetv2": MobileNetV2,
        "densenet121": DenseNet,
        "vit": ViT,
    }
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
        Registry key, one of ``MODELS`` (``"cnn"``, ``"resnet"``) or ``ZOO``
        (``"lenet5"``, ``"vgg11_bn"``, ``"resnet18"``, ``"mobilenetv2"``,
        ``"densenet121"``, ``"vit"``).
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
    registry = {**MODELS, **ZOO}
    if name not in registry:
        raise ValueError(
            f"unknown model {name!r}; accepted names are {sorted(registry)}"
        )
    cls = registry[name]
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
