"""The web runtime's stage descriptions (splitlearn/web.py); the runtime itself is tested in
tests/integration/test_web_step.py, in Chromium."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from splitlearn.models import build_model
from splitlearn.stages import split
from splitlearn.web import (
    FORMAT,
    WebRefusal,
    decode_tensor,
    describe_stages,
    encode_tensor,
    stages_refusal,
    state_from_web,
)


@pytest.mark.parametrize(("name", "channels", "size"), [("cnn", 1, 8), ("cnn", 3, 32),
                                                         ("lenet5", 1, 28), ("lenet5", 3, 32)])
def test_every_cut_of_the_small_models_is_described(name, channels, size):
    model = build_model(name, in_channels=channels, image_size=size, num_classes=10, seed=0)
    for cut in model.valid_cuts:
        bottom = split(model, cut)[0]
        assert stages_refusal(bottom, model.input_shape) is None
        description = json.loads(json.dumps(describe_stages(bottom, model.input_shape)))
        assert description["format"] == FORMAT
        assert tuple(description["output_shape"]) == model.cut_shape(cut)
        state = bottom.state_dict()
        assert sorted(description["state"]) == sorted(state)
        for key, value in state.items():
            assert torch.equal(decode_tensor(description["state"][key]), value)


def test_an_adaptive_pool_becomes_a_fixed_one_and_flatten_keeps_torchs_order():
    model = build_model("cnn", in_channels=1, image_size=8, num_classes=10, seed=0)
    layers = describe_stages(split(model, 4)[0], model.input_shape)["layers"]
    pool = next(layer for layer in layers if layer["module"] == "AdaptiveMaxPool2d")
    assert (pool["type"], pool["kernel_size"], pool["stride"]) == ("MaxPool2d", [2, 2], [2, 2])
    assert [layer["type"] for layer in layers][-4:] == ["MaxPool2d", "Flatten", "Linear", "ReLU"]


def test_the_resnet_stem_is_described_with_its_batchnorm_and_the_blocks_refused():
    model = build_model("resnet", in_channels=3, image_size=32, num_classes=10, seed=0)
    description = describe_stages(split(model, 1)[0], model.input_shape)
    norm = next(layer for layer in description["layers"] if layer["type"] == "BatchNorm2d")
    assert (norm["eps"], norm["momentum"], norm["affine"]) == (1e-5, 0.1, True)
    assert description["counters"] == {"0.1.num_batches_tracked": 0}
    refusal = stages_refusal(split(model, 2)[0], model.input_shape)
    assert refusal is not None and "layer 3 (1.0: BasicBlock)" in refusal


@pytest.mark.parametrize(("stage", "named"), [
    (nn.Sequential(nn.Linear(16, 8), nn.GELU()), "layer 1 (1: GELU)"),
    (nn.Sequential(nn.Flatten(), nn.LSTM(16, 8)), "layer 1 (1: LSTM)"),
    (nn.Sequential(nn.Sequential(nn.Conv2d(1, 2, 3, groups=1), nn.ReLU()),
                   nn.Conv2d(2, 2, 3, groups=2)), "layer 2 (1: Conv2d): groups=2"),
    (nn.Sequential(nn.AdaptiveAvgPool2d(3)), "layer 0 (0: AdaptiveAvgPool2d): pools 4x4 to 3x3"),
    (nn.Sequential(nn.Linear(12, 8)), "layer 0 (0: Linear): 12 input features, the inputs are"),
])
def test_a_layer_the_runtime_does_not_run_is_refused_by_position_and_class(stage, named):
    shape = (16,) if isinstance(stage[0], nn.Linear) else (1, 4, 4)
    assert named in (stages_refusal(stage, shape) or "")
    with pytest.raises(WebRefusal, match=named.replace("(", r"\(").replace(")", r"\)")):
        describe_stages(stage, shape)


def test_tensors_and_state_round_trip_bit_for_bit():
    value = torch.randn(2, 3, 4)
    assert torch.equal(decode_tensor(encode_tensor(value)), value)
    state = state_from_web({"tensors": {"w": encode_tensor(value)},
                            "counters": {"bn.num_batches_tracked": 3}})
    assert torch.equal(state["w"], value)
    assert state["bn.num_batches_tracked"].dtype == torch.long
