"""Run checkpoints: atomic files, the trunk's state, and which config changes a resume allows."""

from __future__ import annotations

import os

import pytest
import torch

from server.checkpoint import first_difference
from server.trunk import Trunk
from splitlearn.atomic import write_atomic
from tests.conftest import digits_like_model, fixed_batches


def test_a_crash_while_writing_leaves_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    write_atomic(path, b"round 1")

    def power_cut(fd: int) -> None:
        raise OSError("power cut")

    monkeypatch.setattr(os, "fsync", power_cut)
    with pytest.raises(OSError, match="power cut"):
        write_atomic(path, b"round 2, half written")
    assert path.read_bytes() == b"round 1"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left


def test_the_trunk_restores_weights_momentum_and_books():
    def trained(trunk: Trunk, steps: int) -> None:
        for x, y in fixed_batches(steps, batch=8):
            acts = trunk.model.stages[0](x).detach()
            with trunk.step(samples=len(y), from_stage=1) as backward:
                backward(torch.nn.functional.cross_entropy(trunk.run(acts, 1), y))

    a = Trunk(digits_like_model(), lr=0.1, momentum=0.9)
    trained(a, 3)
    b = Trunk(digits_like_model(seed=1), lr=0.1, momentum=0.9)
    b.load_state_dict(a.state_dict())
    assert (b.steps, b.samples, b.busy_s) == (a.steps, a.samples, a.busy_s)
    # The next steps agree to the bit: the momentum came along with the weights.
    trained(a, 2)
    trained(b, 2)
    for x, y in zip(a.model.state_dict().values(), b.model.state_dict().values(), strict=True):
        assert torch.equal(x, y)


def test_a_resume_may_change_where_and_how_long_but_not_the_experiment():
    saved = {"seed": 0, "run_dir": "a", "resume": False, "logger": {"name": "wandb"},
             "strategy": {"num_rounds": 5, "lr": 0.05}, "dataplane": {"port": 0},
             "model": {"name": "cnn", "cut": 1}, "server": {"device": "cuda", "precision": "fp32"}}
    resumed = saved | {"run_dir": "a", "resume": True, "logger": {"name": "none"},
                       "strategy": {"num_rounds": 10, "lr": 0.05}, "dataplane": {"port": 9},
                       "server": {"device": "cpu", "precision": "fp32"}}
    assert first_difference(saved, resumed) is None  # a GPU's run resumes on a CPU
    assert first_difference(saved, resumed | {"server": {"device": "cpu", "precision": "bf16"}}
                            ) == "server.precision"
    assert first_difference(saved, resumed | {"model": {"name": "cnn", "cut": 2}}) == "model.cut"
    assert first_difference(saved, resumed | {"strategy": {"num_rounds": 5, "lr": 0.1}}) == (
        "strategy.lr")
    assert first_difference(saved, resumed | {"num_clients": 3}) == "num_clients"
