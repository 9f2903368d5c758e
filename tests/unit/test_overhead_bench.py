"""The overhead suite's bookkeeping: steady throughput and its plot."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from benchmarks.overhead import DEFAULTS, fraction_of, plot_overhead, steady_samples_per_s
from protocols import compose_config
from splitlearn.config import to_object
from splitlearn.models.factory import build_model_from_config


def test_steady_throughput_leaves_out_round_one_and_the_initial_evaluation():
    rounds = [{"round": 0}, {"round": 1, "examples": 100, "round_train_s": 50.0},
              {"round": 2, "examples": 300, "round_train_s": 1.0},
              {"round": 3, "examples": 300, "round_train_s": 2.0}]
    assert steady_samples_per_s(rounds) == pytest.approx(200.0)
    with pytest.raises(ValueError, match="at least 2 training rounds"):
        steady_samples_per_s(rounds[:2])


def test_the_plot_is_written(tmp_path):
    rows = [{"clients": n, "trunk_workers": w, "fraction_of_central": 0.5 + 0.1 * w}
            for n in (1, 4) for w in (1, 2)]
    plot_overhead(rows, tmp_path / "overhead.png", central=900.0)
    assert (tmp_path / "overhead.png").stat().st_size > 10_000


def test_a_run_that_did_not_learn_gets_no_fraction():
    learned = {"samples_per_s": 450.0, "test_accuracy": 0.94}
    stuck = {"samples_per_s": 900.0, "test_accuracy": 0.16}  # faster, and at chance
    assert fraction_of(learned, 900.0, central_accuracy=0.95) == pytest.approx(0.5)
    assert fraction_of(stuck, 900.0, central_accuracy=0.95) is None
    assert fraction_of(learned, 900.0, central_accuracy=0.2) is None  # nor against a stuck limit
    assert fraction_of(stuck, 900.0, central_accuracy=0.95, floor=0.1) == pytest.approx(1.0)
    rows = [{"clients": 16, "trunk_workers": 1, "fraction_of_central": None}]
    plot_overhead(rows, Path("/dev/null"), central=900.0)  # no bar, no failure


def test_the_overhead_job_is_resnet_with_group_norm():
    cfg = compose_config([*DEFAULTS])
    model = build_model_from_config(to_object(cfg.model), to_object(cfg.dataset))
    assert any(isinstance(m, nn.GroupNorm) for m in model.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
