"""A user's own module through the shipped path: config -> auto_split -> training -> state dict."""

from __future__ import annotations

import pytest
import torch

from protocols import check_config
from splitlearn.autosplit import AutoSplitModel
from splitlearn.config import DatasetConfig, ModelConfig
from splitlearn.models.factory import build_model_from_config, source_module
from tests.conftest import small_config
from tests.user_nets import TinyNet

TARGET = "tests.user_nets.TinyNet"


def test_a_target_is_built_with_its_options_and_cut_where_one_tensor_crosses():
    model = build_model_from_config(
        ModelConfig(_target_=TARGET, cut=2, options={"hidden": 16}), DatasetConfig(), seed=0
    )
    assert isinstance(model, AutoSplitModel) and model.num_stages > 2
    source = source_module(model)
    assert isinstance(source, TinyNet) and source.head[1].out_features == 16
    # The split model's parameters are the user's module's: nothing is copied.
    assert {p.data_ptr() for p in model.parameters()} == {p.data_ptr() for p in source.parameters()}
    x = torch.rand(5, 1, 8, 8)
    assert torch.equal(model.eval()(x), source.eval()(x))


def test_a_bad_target_or_cut_fails_before_anything_starts():
    with pytest.raises(ValueError, match="model.cut"):
        check_config(small_config(f"model._target_={TARGET}", "model.cut=99"))
    with pytest.raises(Exception, match="nope"):
        check_config(small_config("model._target_=tests.user_nets.nope"))
