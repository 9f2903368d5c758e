"""A user's own module through the shipped path: config -> auto_split -> training -> state dict."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from experiments.local import run_local
from protocols import check_config
from splitlearn.autosplit import AutoSplitModel
from splitlearn.config import DatasetConfig, ModelConfig
from splitlearn.data import held_out_dataset
from splitlearn.evaluation import evaluate_model
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


def test_a_run_trains_the_users_module_and_hands_back_its_state_dict(tmp_path):
    cfg = small_config(f"model._target_={TARGET}", "model.cut=1", "+model.options.hidden=24",
                       run_dir=str(tmp_path))
    result = run_local(cfg, concurrency=2)
    history = result.history
    assert history[-1]["test_accuracy"] > history[0]["test_accuracy"] + 0.2
    state = torch.load(tmp_path / "model.pt")
    mine = TinyNet(hidden=24)
    mine.load_state_dict(state)  # the original module's keys, strictly
    # The module the user gets back is the model the run evaluated last.
    loader = DataLoader(held_out_dataset(DatasetConfig(), seed=cfg.seed), batch_size=512)
    _, accuracy, _ = evaluate_model(mine, loader)
    assert accuracy == pytest.approx(history[-1]["test_accuracy"])
