"""Whole runs of the shipped apps in one process (``experiments.local``), a few seconds each.

The strategy, ClientApp, client loop and trunk are the deployed ones; only the engine
is local (clients in threads, the in-process channel).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from experiments.local import run_local
from splitlearn.config import DatasetConfig
from splitlearn.data import held_out_dataset
from splitlearn.evaluation import evaluate_model
from tests.conftest import small_config
from tests.user_nets import TinyNet

TARGET = "tests.user_nets.TinyNet"


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


@pytest.mark.parametrize("planner", [(), ("planner=rotate", "planner.cuts=[1,2,3]")],
                         ids=["one-cut", "per-client-cuts"])
def test_with_one_client_per_step_sglr_is_splitfed_v2(planner):
    """One client in each step: scale 1, the average of one gradient is its own. With
    per-client cuts too (cuts differ within a round and move), SGLR merges per stage as
    SplitFed v2 does."""
    histories = {
        name: run_local(small_config(f"strategy={name}", "strategy.momentum=0", *planner),
                        concurrency=1).history
        for name in ("sglr", "splitfed_v2")
    }
    for a, b in zip(histories["sglr"], histories["splitfed_v2"], strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-6)
        assert a["test_accuracy"] == b["test_accuracy"]


def test_ushaped_with_moving_cuts_and_one_client_is_splitfed_v2():
    """One client, plain SGD, its cut moving every round (1, 2, 3): the U-shaped tail on the
    device and the trunk's middle train what SplitFed v2's trunk trains, batch by batch, so
    both are whole-model SGD; any stage lost or mis-weighted when the cut moves differs."""
    rotating = ("planner=rotate", "planner.cuts=[1,2,3]", "num_clients=1",
                "strategy.min_train_nodes=1", "strategy.num_rounds=3", "strategy.momentum=0")
    histories = {
        name: run_local(small_config(f"strategy={name}", *rotating), concurrency=1).history
        for name in ("ushaped", "splitfed_v2")
    }
    for a, b in zip(histories["ushaped"], histories["splitfed_v2"], strict=True):
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-5)
    assert histories["ushaped"][-1]["test_accuracy"] > histories["ushaped"][0]["test_accuracy"]
