"""Tests for the splittable models, the registry and the cost model."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from splitlearn.models import (
    MODELS,
    ResNet,
    SmallCNN,
    SplittableModel,
    StageCost,
    build_model,
    total_cost,
)


def _model(name: str, channels: int = 1, size: int = 8, seed: int = 0) -> SplittableModel:
    return build_model(
        name, in_channels=channels, image_size=size, num_classes=10, seed=seed
    )


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("size", [8, 28, 32])
@pytest.mark.parametrize("channels", [1, 3])
def test_forward_shape(name: str, size: int, channels: int) -> None:
    model = _model(name, channels, size)
    out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, 10)
    assert model.input_shape == (channels, size, size)
    assert model.num_classes == 10


def test_registry_classes() -> None:
    assert MODELS["cnn"] is SmallCNN
    assert MODELS["resnet"] is ResNet
    with pytest.raises(TypeError):
        MODELS["x"] = SmallCNN  # type: ignore[index]


def test_unknown_name_lists_accepted() -> None:
    with pytest.raises(ValueError, match="'mlp'.*cnn.*resnet"):
        build_model("mlp", in_channels=1, image_size=8, num_classes=10)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_seed_is_deterministic_and_local(name: str) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = _model(name, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # global RNG untouched
    b = _model(name, seed=7)
    c = _model(name, seed=8)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert any(
        not torch.equal(pa, pc)
        for pa, pc in zip(a.parameters(), c.parameters(), strict=True)
    )


def test_model_kwargs_forwarded() -> None:
    model = build_model(
        "resnet",
        in_channels=3,
        image_size=16,
        num_classes=5,
        widths=(8, 16),
        blocks_per_stage=2,
    )
    assert model.num_stages == 4  # stem + 2 groups + head
    assert len(model.stages[1]) == 2
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"in_channels": 0, "image_size": 8, "num_classes": 10},
        {"in_channels": 1, "image_size": 8, "num_classes": 0},
        {"in_channels": 1, "image_size": 8.0, "num_classes": 10},
    ],
)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_bad_dims_rejected(name: str, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        build_model(name, **kwargs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_valid_cuts(name: str) -> None:
    model = _model(name)
    assert model.num_stages == 5
    assert model.valid_cuts == [1, 2, 3, 4]


def test_cut_shapes_cnn() -> None:
    model = _model("cnn", size=28)
    assert model.cut_shape(1) == (32, 28, 28)
    assert model.cut_shape(2) == (64, 14, 14)
    assert model.cut_shape(3) == (128, 2, 2)
    assert model.cut_shape(4) == (128,)


def test_cut_shapes_resnet() -> None:
    model = _model("resnet", size=32)
    assert [model.cut_shape(k) for k in model.valid_cuts] == [
        (16, 32, 32),
        (16, 32, 32),
        (32, 16, 16),
        (64, 8, 8),
    ]


def test_resnet_stem_downsamples_large_inputs() -> None:
    model = _model("resnet", size=64)
    assert model.cut_shape(1) == (16, 32, 32)


@pytest.mark.parametrize("cut", [0, 5, -1, 2.5, "1", True])
def test_cut_shape_invalid(cut: object) -> None:
    with pytest.raises(ValueError, match=r"\[1, 2, 3, 4\]"):
        _model("cnn").cut_shape(cut)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("channels,size", [(1, 8), (3, 32)])
def test_stage_costs_consistent(name: str, channels: int, size: int) -> None:
    model = _model(name, channels, size)
    costs = model.stage_costs()
    assert len(costs) == model.num_stages
    assert all(isinstance(c, StageCost) for c in costs)
    assert sum(c.params for c in costs) == sum(p.numel() for p in model.parameters())
    for cut in model.valid_cuts:
        expected = 4 * math.prod(model.cut_shape(cut))
        assert costs[cut - 1].activation_bytes_per_sample == expected
    assert costs[-1].activation_bytes_per_sample == 4 * 10
    assert all(c.flops_per_sample > 0 for c in costs)
    assert all(c.train_memory_bytes_per_sample > 0 for c in costs)


def test_cnn_flops_hand_count() -> None:
    model = _model("cnn", channels=1, size=8)
    costs = model.stage_costs()
    # Stage 0: conv3x3 1->32 "same" on 8x8 with bias, then ReLU.
    outputs = 32 * 8 * 8
    assert costs[0].flops_per_sample == 2 * 1 * 9 * outputs + outputs + outputs
    # Stage 3: flatten, Linear(128*2*2 -> 128) with bias, ReLU.
    assert costs[3].flops_per_sample == 2 * 512 * 128 + 128 + 128
    # Stage 4 is a bare Linear(128 -> 10): 2*in*out + out (bias).
    assert isinstance(model.stages[4], nn.Linear)
    assert costs[4].flops_per_sample == 2 * 128 * 10 + 10


def test_cnn_train_memory_hand_count() -> None:
    costs = _model("cnn", channels=1, size=8).stage_costs()
    # Stage 0 keeps the input (for the conv weight grad) and the ReLU output.
    assert costs[0].train_memory_bytes_per_sample == 4 * (1 * 64 + 32 * 64)
    # Stage 4 (Linear) keeps only its input.
    assert costs[4].train_memory_bytes_per_sample == 4 * 128


def test_stage_costs_has_no_side_effects() -> None:
    model = _model("resnet")
    model.train()
    model.stages[1].eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.stage_costs()
    model.cut_shape(2)
    assert model.training and not model.stages[1].training
    assert model.stages[2].training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_total_cost() -> None:
    costs = _model("cnn").stage_costs()
    client = total_cost(costs[:2], name="client")
    assert client.name == "client"
    assert client.params == costs[0].params + costs[1].params
    assert client.flops_per_sample == costs[0].flops_per_sample + costs[1].flops_per_sample
    assert client.activation_bytes_per_sample == costs[1].activation_bytes_per_sample
    with pytest.raises(ValueError):
        total_cost([])


@pytest.mark.parametrize("name", ["resnet", "resnet18"])
def test_group_norm_replaces_every_batch_norm_and_evaluates_as_it_trains(name: str) -> None:
    batch = build_model(name, in_channels=1, image_size=16, num_classes=10, seed=0)
    group = build_model(name, in_channels=1, image_size=16, num_classes=10, seed=0,
                        norm="group")
    norms = [m for m in group.modules() if isinstance(m, nn.GroupNorm)]
    assert len(norms) == sum(isinstance(m, nn.BatchNorm2d) for m in batch.modules()) > 0
    assert not any(isinstance(m, nn.BatchNorm2d) for m in group.modules())
    assert all(m.num_channels % m.num_groups == 0 for m in norms)
    assert group.valid_cuts == batch.valid_cuts
    assert [group.cut_shape(c) for c in group.valid_cuts] == [
        batch.cut_shape(c) for c in batch.valid_cuts]
    x = torch.rand(4, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(group.train()(x), group.eval()(x))  # no running statistics
    with pytest.raises(ValueError, match="unknown norm 'layer'"):
        build_model(name, in_channels=1, image_size=16, num_classes=10, norm="layer")
