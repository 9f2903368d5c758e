"""The scale suite's bookkeeping: steady time per sample, process trees, the plot."""

from __future__ import annotations

import os

import pytest

from benchmarks.scale import descendants, plot_scale, rss_bytes, seconds_per_sample


def test_time_per_sample_is_the_median_steady_round_over_its_samples():
    rounds = [{"round": 0, "wall_s": 1.0}, {"round": 1, "wall_s": 11.0, "examples": 100},
              {"round": 2, "wall_s": 12.0, "examples": 100},
              {"round": 3, "wall_s": 14.0, "examples": 100},
              {"round": 4, "wall_s": 17.0, "examples": 100}]
    assert seconds_per_sample(rounds) == pytest.approx(0.02)  # rounds 2-4: 1, 2, 3 s
    with pytest.raises(ValueError, match="at least 2 training rounds"):
        seconds_per_sample(rounds[:2])


def test_this_process_is_in_its_own_tree_and_has_memory():
    assert os.getpid() in descendants(os.getpid())
    assert rss_bytes(os.getpid()) > 1 << 20
    assert rss_bytes(2**31 - 1) == 0  # no such process


def test_the_plot_is_written(tmp_path):
    rows = [{"registered": n, "seconds_per_sample": 1e-3, "peak_main_bytes": 7 << 28,
             "peak_tree_bytes": 2 << 30} for n in (10, 100, 1000)]
    plot_scale(rows, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").stat().st_size > 10_000
