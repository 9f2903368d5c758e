"""A user's own module through the shipped path: config -> auto_split -> training -> state dict."""

from __future__ import annotations

import threading

import pytest
import torch

from protocols import check_config
from splitlearn.config import DatasetConfig, ModelConfig
from splitlearn.models.autosplit import AutoSplitModel
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


def test_every_build_holds_its_own_seeded_weights():
    """A process traces a configured module once; later builds are copies of that split
    holding their own module's weights, not the first one's."""
    config = ModelConfig(_target_=TARGET, cut=2, options={"hidden": 24})
    first, second = (build_model_from_config(config, DatasetConfig(), seed=s) for s in (0, 1))
    x = torch.rand(5, 1, 8, 8)
    for seed, model in ((0, first), (1, second)):
        torch.manual_seed(seed)
        expected = TinyNet(hidden=24)
        source = source_module(model)
        assert isinstance(source, TinyNet) and source is not expected
        assert all(torch.equal(a, b) for a, b in zip(
            source.state_dict().values(), expected.state_dict().values(), strict=True))
        assert {p.data_ptr() for p in model.parameters()} == {
            p.data_ptr() for p in source.parameters()}
        assert torch.equal(model.eval()(x), expected.eval()(x))
    assert not {p.data_ptr() for p in first.parameters()} & {
        p.data_ptr() for p in second.parameters()}


def test_building_a_model_does_not_break_other_threads_training(tiny_switch_interval):
    """Clients run as threads in one process (experiments.local): one client building its
    model while another trains must not reach into the other's forward pass (a trace
    patches every module's call in the process)."""
    config = ModelConfig(_target_=TARGET, cut=2, options={"hidden": 20})
    build_model_from_config(config, DatasetConfig(), seed=0)  # the process's first build
    training = build_model_from_config(config, DatasetConfig(), seed=1)
    errors: list[BaseException] = []
    done = threading.Event()

    def train() -> None:
        x = torch.rand(4, 1, 8, 8)
        while not done.is_set():
            try:
                training(x).sum().backward()
            except BaseException as err:  # noqa: BLE001 - collected for the assert below
                errors.append(err)
                return

    worker = threading.Thread(target=train)
    worker.start()
    try:
        for seed in range(5):
            build_model_from_config(config, DatasetConfig(), seed=seed)
    finally:
        done.set()
        worker.join()
    assert errors == []
