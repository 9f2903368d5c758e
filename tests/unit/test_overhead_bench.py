"""The overhead suite's bookkeeping: steady throughput and its plot."""

from __future__ import annotations

import pytest

from benchmarks.overhead import plot_overhead, steady_samples_per_s


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
